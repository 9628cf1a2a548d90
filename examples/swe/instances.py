"""SWE-bench-format instances: loading, the agent's checkout, and grading (examples/swe/README.md).

An instance is a dict with SWE-bench's fields: ``instance_id``, ``repo`` ("owner/name"), ``base_commit``,
``problem_statement``, ``patch`` (the reference fix), ``test_patch`` (the tests that check it), ``FAIL_TO_PASS`` and
``PASS_TO_PASS`` (pytest ids: lists, or JSON strings of lists as in SWE-bench's dataset), and optionally ``image``
(a docker image with the repository at ``/testbed``) and ``test_cmd`` (a shell command; the test ids are appended)::

    >>> insts = load_instances(shipped())                   # the five shipped ones (make_instances.py)
    >>> src = Sources(repos_dir=shipped().parent / "repos")
    >>> checkout(src.base(insts[0]), "/tmp/x/repo")         # base_commit and its ancestors only
    >>> grade(insts[0], insts[0]["patch"], src, sandbox.make("none")).reward
    1.0

The repository comes from ``<repos_dir>/<owner>__<name>`` (any git repository holding base_commit), else from the
instance image's ``/testbed`` (copied out once). From it a *base* repository is made once per base commit: only
base_commit and its ancestors, one branch ``main``, no tags, no other refs, and checked to hold no other object,
so the fix commit and everything after it are absent. Each rollout and each grading clones that.

Grading (``grade``): a fresh clone the agent never saw; the agent's change applied; every file it changed that
``test_patch`` touches, or that looks like a test or test configuration (``is_test_path``), put back as it was
at base_commit; ``test_patch`` applied; the FAIL_TO_PASS and PASS_TO_PASS tests run in the sandbox. Reward 1.0
when every one of them passes, else 0.0.
"""

from __future__ import annotations

import fnmatch
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lightning_lite.harness import Task

REQUIRED = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)
TEST_CMD = "python3 -m pytest -rA -p no:cacheprovider"
# The tests' PATH: /usr/bin first, so that under bwrap (the host's system, read-only) Debian's python3 with its
# python3-pytest runs them, and in a docker image its system python3. An image whose Python is elsewhere (SWE-bench's
# conda envs) says so in its instance's test_cmd.
TEST_PATH = "/usr/bin:/bin:/usr/sbin:/sbin:/usr/local/bin"
DEFAULT_IMAGE = "lightning-lite/sandbox:bookworm"
MAX_PATCH = 50 << 20  # bytes: a bigger change (a venv or a build left in the repo) scores 0
# What no hidden test can check through the agent's code but the agent could use to make tests pass: it stays as
# it was at base_commit. The directories and names pytest finds tests and its configuration in, and modules that
# would shadow the test runner (``python3 -m pytest`` imports from the repo's root first).
TEST_DIRS = {"test", "tests", "testing"}
TEST_NAMES = ("test_*.py", "*_test.py", "conftest.py")
ROOT_NAMES = {"pytest.ini", "tox.ini", "pytest.py", "pytest", "_pytest", "py.py", "pluggy"}


def is_test_path(path: str) -> bool:
    """Whether the grader undoes the agent's change to ``path`` (repository-relative, "/"-separated)."""
    parts = path.split("/")
    return (
        any(p in TEST_DIRS for p in parts[:-1])
        or any(fnmatch.fnmatch(parts[-1], n) for n in TEST_NAMES)
        or parts[0] in ROOT_NAMES
    )


# ---------------------------------------------------------------------------- loading


def shipped() -> Path:
    """The shipped instances' JSONL (examples/swe/make_instances.py), built on first use (about a second)."""
    from examples.swe import make_instances

    path = make_instances.default_dir() / "instances.jsonl"
    return path if path.exists() else make_instances.build(path.parent)


def _ids(value, field_name, where) -> list[str]:
    if isinstance(value, str):  # SWE-bench's dataset stores the lists as JSON strings
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(
                f"{where}: {field_name} is a string but not a JSON list: {value[:80]!r}"
            ) from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ValueError(
            f"{where}: {field_name} must be a list of test ids (or a JSON string of one), not {value!r:.80}"
        )
    return value


def normalize(raw: dict, where: str) -> dict:
    """An instance with its test lists as lists; a clear error for a missing or malformed field."""
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ValueError(
            f"{where}: missing {', '.join(missing)} (an instance needs {', '.join(REQUIRED)})"
        )
    inst = dict(
        raw,
        FAIL_TO_PASS=_ids(raw["FAIL_TO_PASS"], "FAIL_TO_PASS", where),
        PASS_TO_PASS=_ids(raw["PASS_TO_PASS"], "PASS_TO_PASS", where),
    )
    inst.setdefault("patch", "")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(inst["repo"])):
        raise ValueError(f"{where}: repo must be 'owner/name', not {inst['repo']!r}")
    if not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", str(inst["base_commit"])):
        raise ValueError(
            f"{where}: base_commit must be a full commit SHA, not {inst['base_commit']!r}"
        )
    if not inst["FAIL_TO_PASS"]:
        raise ValueError(f"{where}: FAIL_TO_PASS is empty: nothing would tell a fix from no change")
    return inst


def load_instances(source, split: str = "test") -> list[dict]:
    """Instances from a JSONL file (one per line), ``"shipped"``, or a ``datasets`` name and split (e.g.
    ``princeton-nlp/SWE-bench_Verified``, ``SWE-Gym/SWE-Gym`` with split ``train``) where a hub is reachable."""
    if str(source) == "shipped":
        source = shipped()
    path = Path(os.path.expanduser(str(source)))
    if path.is_file():
        rows = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append((json.loads(line), f"{path}:{n}"))
                    except ValueError as e:
                        raise ValueError(f"{path}:{n} is not JSON: {e}") from None
    elif path.suffix in (".jsonl", ".json") or path.is_absolute() or str(source).startswith("."):
        raise ValueError(f"instances file {path} does not exist")
    else:
        try:
            import datasets  # only for hub names: a JSONL needs nothing
        except ImportError:
            raise ValueError(
                f"instances={source!r} is not a file, and loading it as a dataset needs the `datasets` "
                "package (pip install datasets), or pass a JSONL file of instances"
            ) from None
        try:
            ds = datasets.load_dataset(str(source), split=split)
        except Exception as e:
            raise ValueError(
                f"could not load the dataset {source!r} (split {split!r}): {type(e).__name__}: {e}. Without "
                "a reachable hub, save it as JSONL where there is one (ds.to_json('x.jsonl')) and pass the file"
            ) from None
        rows = [(dict(r), f"{source}[{i}]") for i, r in enumerate(ds)]
    insts = [normalize(r, where) for r, where in rows]
    seen = set()
    for inst in insts:
        if inst["instance_id"] in seen:
            raise ValueError(f"{source}: instance_id {inst['instance_id']!r} appears twice")
        seen.add(inst["instance_id"])
    if not insts:
        raise ValueError(f"{source}: no instances")
    return insts


def make_splits(
    insts: list[dict], test_split: Optional[float] = None, seed: int = 0
) -> dict[str, list[Task]]:
    """Instances have no train/test split: both splits are all of them, or with ``test_split`` (a fraction) a
    seeded random share of them is "test" and the rest "train"."""
    tasks = [to_task(i) for i in insts]
    if not test_split:
        return {"train": tasks, "test": list(tasks)}
    if not 0 < test_split < 1:
        raise ValueError(f"test_split must be a fraction between 0 and 1, not {test_split!r}")
    order = sorted(range(len(tasks)), key=lambda k: tasks[k].id)
    random.Random(seed).shuffle(order)
    n_test = max(1, round(test_split * len(tasks)))
    if n_test >= len(tasks):
        raise ValueError(
            f"test_split={test_split} of {len(tasks)} instances leaves none for training"
        )
    test = set(order[:n_test])
    return {
        "train": [t for k, t in enumerate(tasks) if k not in test],
        "test": [t for k, t in enumerate(tasks) if k in test],
    }


def to_task(inst: dict) -> Task:
    prompt = (
        f"{inst['problem_statement'].strip()}\n\n"
        f"The repository {inst['repo']} is checked out in the current directory, at commit {inst['base_commit'][:12]}. "
        "Resolve the issue by changing its code; hidden tests will check the result (changes to the tests are not kept)."
    )
    return Task(inst["instance_id"], prompt, inst, {"repo": inst["repo"], "instance": True})


# ---------------------------------------------------------------------------- git


def git(
    *args, cwd=None, env=None, check=True, timeout=600, input=None
) -> subprocess.CompletedProcess:
    """git with no system or global configuration (the same behaviour on every machine) and no prompts."""
    full = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/"),
        "LC_ALL": "C",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        **(env or {}),
    }
    p = subprocess.run(
        ["git", "-c", "safe.directory=*", *args],
        cwd=cwd,
        env=full,
        capture_output=True,
        timeout=timeout,
        input=input,
    )
    if check and p.returncode:
        raise RuntimeError(
            f"git {' '.join(map(str, args))[:200]} failed: {p.stderr.decode(errors='replace').strip()[-800:]}"
        )
    return p


def _out(*args, **kw) -> str:
    return git(*args, **kw).stdout.decode()


def checkout(base_git, dest) -> Path:
    """A working copy of the base repository at ``dest``: branch ``main`` at base_commit, its own objects (no
    alternates: it must work inside a sandbox), no remote, no reflog, and an identity to commit with."""
    dest = Path(dest)
    git("init", "-q", "-b", "main", str(dest))
    git(
        "-C",
        str(dest),
        "fetch",
        "-q",
        "--no-tags",
        "--update-head-ok",
        str(base_git),
        "refs/heads/main:refs/heads/main",
    )
    git("-C", str(dest), "reset", "-q", "--hard")
    for name in ("FETCH_HEAD", "logs"):  # they name where the objects came from
        p = dest / ".git" / name
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    git("-C", str(dest), "config", "user.name", "agent")
    git("-C", str(dest), "config", "user.email", "agent@localhost")
    return dest


@dataclass
class Sources:
    """Where repositories come from: ``repos_dir/<owner>__<name>``, else the instance image's /testbed (copied
    out with docker once). ``cache`` holds the base repositories and the copies."""

    repos_dir: Optional[Path] = None
    cache: Optional[Path] = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        from lightning_lite.models import cache_dir

        self.repos_dir = Path(os.path.expanduser(str(self.repos_dir))) if self.repos_dir else None
        self.cache = Path(self.cache or Path(cache_dir()) / "swe-repos")

    def source(self, inst: dict) -> Path:
        """A git repository holding base_commit (possibly with its future: only base() reads it)."""
        local = self.local(inst)
        return local if local else self._testbed(inst["image"])

    def local(self, inst: dict) -> Optional[Path]:
        """``repos_dir/<owner>__<name>`` when it exists; None when the image's /testbed is to be used; else an
        error that says what is missing (the harness asks at its start, without copying anything)."""
        name = inst["repo"].replace("/", "__")
        if self.repos_dir and (self.repos_dir / name).exists():
            return self.repos_dir / name
        if inst.get("image"):
            return None
        where = (
            f"{self.repos_dir / name}"
            if self.repos_dir
            else f"repos_dir/{name} (no repos_dir given)"
        )
        raise ValueError(
            f"{inst['instance_id']}: no repository for {inst['repo']}: not at {where}, and the instance has "
            f"no image to take /testbed from. Clone it there (git clone https://github.com/{inst['repo']} "
            f"{where}) or give the instance an image"
        )

    def _testbed(self, image: str) -> Path:
        """The .git of the image's /testbed (SWE-bench's convention), copied out once: ``docker create`` runs nothing."""
        dest = self.cache / "testbeds" / re.sub(r"[^\w.-]+", "_", image)
        if dest.exists():
            return dest
        if not shutil.which("docker"):
            raise ValueError(
                f"the repository is to come from {image}:/testbed, but docker is not installed"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".testbed-", dir=dest.parent))
        p = subprocess.run(
            ["docker", "create", image, "true"], capture_output=True, text=True, timeout=600
        )
        if p.returncode:
            raise ValueError(
                f"docker create {image} failed (is the image here? docker pull it): {p.stderr.strip()}"
            )
        cid = p.stdout.strip()
        try:
            p = subprocess.run(
                ["docker", "cp", f"{cid}:/testbed/.git", str(tmp / "testbed.git")],
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if p.returncode:
                raise ValueError(
                    f"{image} has no /testbed/.git to take the repository from: {p.stderr.strip()}"
                )
            if not dest.exists():  # else another rollout copied it meanwhile
                os.replace(tmp / "testbed.git", dest)
        finally:
            subprocess.run(["docker", "rm", "-f", cid], capture_output=True, timeout=120)
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def base(self, inst: dict) -> Path:
        """The base repository of ``inst`` (bare): base_commit and its ancestors, branch main, nothing else.
        Built once per (repo, base_commit) and verified object by object."""
        sha = inst["base_commit"]
        dest = self.cache / "bases" / inst["repo"].replace("/", "__") / f"{sha}.git"
        with (
            self._lock
        ):  # one build at a time in this process; a rename makes it visible to others whole
            if dest.exists():
                return dest
            src = self.source(inst)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".base-", dir=dest.parent))
            try:
                git("init", "-q", "--bare", str(tmp))
                # by SHA, --no-tags, into one ref: no other branch, tag or note comes along, nor any commit not
                # reachable from base_commit (the fix, the later history)
                r = git(
                    "-C",
                    str(tmp),
                    "-c",
                    "uploadpack.allowAnySHA1InWant=true",
                    "fetch",
                    "-q",
                    "--no-tags",
                    str(src),
                    f"{sha}:refs/heads/main",
                    check=False,
                )
                if r.returncode:
                    raise ValueError(
                        f"{inst['instance_id']}: {src} does not have base_commit {sha}: "
                        f"{r.stderr.decode(errors='replace').strip()[-300:]}"
                    )
                for name in ("FETCH_HEAD", "logs"):
                    p = tmp / name
                    shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
                verify_base(tmp, sha)
                try:
                    os.rename(tmp, dest)
                except OSError:  # another process built it meanwhile
                    if not dest.exists():
                        raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return dest


def verify_base(repo, sha: str):
    """Raise unless ``repo`` holds exactly base_commit's history: one ref, and every object reachable from it."""
    refs = _out("-C", str(repo), "for-each-ref", "--format=%(refname) %(objectname)").split("\n")
    if [r for r in refs if r] != [f"refs/heads/main {sha}"]:
        raise RuntimeError(f"{repo}: expected only refs/heads/main at {sha}, found {refs}")
    reachable = {
        line.split()[0]
        for line in _out("-C", str(repo), "rev-list", "--objects", "--all").splitlines()
    }
    present = set(
        _out(
            "-C", str(repo), "cat-file", "--batch-all-objects", "--batch-check=%(objectname)"
        ).split()
    )
    if present - reachable:
        raise RuntimeError(
            f"{repo}: {len(present - reachable)} objects not reachable from {sha[:12]} (e.g. {sorted(present - reachable)[0]})"
        )


# ---------------------------------------------------------------------------- the agent's change


def agent_diff(base_git, workdir, timeout: float = 300) -> bytes:
    """What the agent changed in ``workdir`` against base_commit, as a binary-safe patch: every file as it is
    now, new (untracked) files included, whatever the agent did to its own .git (commits, resets, config: unread).

    Git runs with the base repository's config and a private index and object directory, the agent's tree as its
    work tree, so nothing the agent configured (hooks, filters, fsmonitor) runs here. ``.gitignore`` still applies
    to new files, as in SWE-bench's ``git add -A``."""
    with tempfile.TemporaryDirectory(prefix="ll-diff-") as d:
        env = {
            "GIT_DIR": str(base_git),
            "GIT_WORK_TREE": str(workdir),
            "GIT_INDEX_FILE": f"{d}/index",
            "GIT_OBJECT_DIRECTORY": f"{d}/objects",
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": f"{base_git}/objects",
        }
        os.mkdir(f"{d}/objects")
        safe = [
            "-c",
            "core.fsmonitor=false",
            "-c",
            "core.hooksPath=/dev/null",
            "-c",
            "core.autocrlf=false",
        ]
        git(*safe, "read-tree", "refs/heads/main", env=env, cwd=workdir, timeout=timeout)
        git(*safe, "add", "-A", env=env, cwd=workdir, timeout=timeout)
        return git(
            *safe,
            "diff",
            "--cached",
            "--binary",
            "--no-renames",
            "--no-ext-diff",
            "--no-textconv",
            "--no-color",
            "refs/heads/main",
            env=env,
            cwd=workdir,
            timeout=timeout,
        ).stdout


def patch_paths(patch: bytes, cwd) -> set[str]:
    """The paths a patch touches (both sides of a rename), as git reads them."""
    out = git("apply", "--numstat", "-z", cwd=cwd, input=patch, check=False, timeout=60)
    if out.returncode:
        raise ValueError(
            f"not a patch git can read: {out.stderr.decode(errors='replace').strip()[-300:]}"
        )
    tokens, paths, k = out.stdout.decode(errors="surrogateescape").split("\0"), set(), 0
    while k < len(tokens):
        head = tokens[k].split("\t")
        if len(head) == 3 and head[2]:
            paths.add(head[2])
            k += 1
        elif len(head) == 3:  # a rename: "added\tdeleted\t\0old\0new"
            paths.update(tokens[k + 1 : k + 3])
            k += 3
        else:
            k += 1
    return paths


# ---------------------------------------------------------------------------- grading


@dataclass
class Grade:
    reward: float
    tests: dict  # test id -> "PASSED", "FAILED", "ERROR", ... or "missing" (not reported)
    note: str = ""  # why it is 0 when no test said so ("the change does not apply", "timeout")
    restored: list = field(
        default_factory=list
    )  # the agent's changes to test files that were undone
    output: str = ""  # the test command's output (its end)


def parse_summary(output: str, ids: list[str]) -> Optional[dict]:
    """Each id's status from pytest's ``-rA`` short test summary (``PASSED id``, ``FAILED id - msg``, ...); None
    when there is no summary at all. Only lines after the last summary header count (what the code under test
    printed before it does not), and an id reported both passing and failing counts as failing."""
    at = output.rfind("short test summary info")
    if at < 0:
        return None
    want, seen = set(ids), {}
    for line in output[at:].splitlines()[1:]:
        status, _, rest = line.partition(" ")
        if status not in ("PASSED", "FAILED", "ERROR", "XFAIL", "XPASS", "SKIPPED"):
            continue
        # the id, or the id before " - <message>" (an id may itself contain " - ")
        cands = [rest] + [rest[: m.start()] for m in re.finditer(" - ", rest)]
        for tid in (c for c in cands if c in want):
            if seen.get(tid) in (None, "PASSED", "XFAIL"):  # a failing status, once reported, stays
                seen[tid] = status
    return {t: seen.get(t, "missing") for t in ids}


def run_in_sandbox(
    box, cmd: str, env: dict, cwd, *, image=None, limits=None, name=None, ro_binds=(), timeout=600.0
):
    """``sh -c cmd`` in the sandbox ``box`` (a lightning_lite.extras.sandbox Sandbox), stdout and stderr together;
    (exit code, output), or (None, output so far) after ``timeout``. Then its process group is killed and the
    sandbox's leftovers (a container) with it."""
    name = (
        name or f"ll-run-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    )  # a container needs one to be killed by
    argv = box.wrap(
        ["sh", "-c", cmd], env, str(cwd), image=image, limits=limits, name=name, ro_binds=ro_binds
    )
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            box.kill(name)
        out.seek(0)
        return rc, out.read().decode(errors="replace")


def grade(
    inst: dict,
    patch,
    sources: Sources,
    box,
    *,
    image: Optional[str] = None,
    limits=None,
    name: Optional[str] = None,
    timeout: float = 600.0,
) -> Grade:
    """The instance's reward for ``patch`` (the agent's change, bytes or text), in a fresh clone of the base
    commit, the tests run in ``box`` (a lightning_lite.extras.sandbox Sandbox) within ``timeout`` seconds."""
    patch = patch.encode() if isinstance(patch, str) else patch
    ids = inst["FAIL_TO_PASS"] + inst["PASS_TO_PASS"]
    if len(patch) > MAX_PATCH:
        return Grade(
            0.0, {}, f"the change is {len(patch) >> 20} MB (more than {MAX_PATCH >> 20} MB)"
        )
    base = sources.base(inst)
    with tempfile.TemporaryDirectory(
        prefix="ll-grade-", ignore_cleanup_errors=True
    ) as d:  # (files a container made)
        repo = checkout(base, Path(d) / "repo")
        if patch.strip():
            r = git(
                "-C",
                str(repo),
                "apply",
                "--index",
                "--whitespace=nowarn",
                input=patch,
                check=False,
                timeout=120,
            )
            if r.returncode:
                return Grade(
                    0.0,
                    {},
                    f"the change does not apply: {r.stderr.decode(errors='replace').strip()[-300:]}",
                )
        # Undo the change to every test file (and what could stand in for the tests): test_patch's files and
        # anything that looks like a test, as they were at base_commit (or gone, if base_commit had none).
        changed = _out(
            "-C",
            str(repo),
            "diff",
            "--cached",
            "--name-only",
            "-z",
            "--no-renames",
            "refs/heads/main",
        ).split("\0")
        hidden = (
            patch_paths(inst["test_patch"].encode(), repo) if inst["test_patch"].strip() else set()
        )
        restore = sorted(p for p in changed if p and (p in hidden or is_test_path(p)))
        if restore:
            at_base = set(
                _out(
                    "-C",
                    str(repo),
                    "--literal-pathspecs",
                    "ls-tree",
                    "-r",
                    "-z",
                    "--name-only",
                    "refs/heads/main",
                    "--",
                    *restore,
                ).split("\0")
            )
            old = [p for p in restore if p in at_base]
            new = [p for p in restore if p not in at_base]
            if old:
                git(
                    "-C",
                    str(repo),
                    "--literal-pathspecs",
                    "checkout",
                    "refs/heads/main",
                    "--",
                    *old,
                )
            if new:
                git("-C", str(repo), "--literal-pathspecs", "rm", "-q", "-r", "-f", "--", *new)
        if inst[
            "test_patch"
        ].strip():  # (empty: the tests are in the repository already, as in SWE-smith)
            r = git(
                "-C",
                str(repo),
                "apply",
                "--whitespace=nowarn",
                input=inst["test_patch"].encode(),
                check=False,
                timeout=120,
            )
            if r.returncode:  # the instance is broken, not the agent's change: fail loudly
                raise ValueError(
                    f"{inst['instance_id']}: test_patch does not apply at base_commit: "
                    f"{r.stderr.decode(errors='replace').strip()[-300:]}"
                )
        # d is the sandbox's writable dir: repo/ and a HOME beside it that is not part of the repository
        os.mkdir(Path(d) / "home")
        cmd = (
            f"cd repo && {inst.get('test_cmd') or TEST_CMD} {' '.join(shlex.quote(t) for t in ids)}"
        )
        env = {
            "PATH": TEST_PATH,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "HOME": f"{d}/home",
        }
        rc, output = run_in_sandbox(
            box,
            cmd,
            env,
            d,
            image=inst.get("image") or image,
            limits=limits,
            name=name,
            timeout=timeout,
        )
    if rc is None:
        return Grade(0.0, {}, f"the tests ran past {timeout:g} s", restore, output[-4000:])
    tests = parse_summary(output, ids)
    if (
        tests is None
    ):  # no pytest summary: the sandbox or the test command is broken, not (only) the agent's code
        raise RuntimeError(
            f"{inst['instance_id']}: the test command printed no pytest short summary (-rA) (exit code {rc}, "
            f"sandbox {box.name}): {' | '.join(output.strip().splitlines()[-5:])[-800:]}"
        )
    reward = float(all(s in ("PASSED", "XFAIL") for s in tests.values()))
    return Grade(reward, tests, "", restore, output[-4000:])


def check_with(insts: list[dict], sources: Sources, box) -> list[str]:
    """Every instance's tests as its fields claim, graded in ``box``: at base_commit each FAIL_TO_PASS test fails
    and each PASS_TO_PASS test passes; with ``patch`` all pass. The problems found (empty: all good)."""
    problems = []
    for inst in insts:
        iid, before, after = (
            inst["instance_id"],
            grade(inst, b"", sources, box),
            grade(inst, inst["patch"], sources, box),
        )
        problems += [
            f"{iid}: {t} passes at base_commit"
            for t in inst["FAIL_TO_PASS"]
            if before.tests.get(t) == "PASSED"
        ]
        problems += [
            f"{iid}: {t} is {before.tests.get(t)} at base_commit"
            for t in inst["PASS_TO_PASS"]
            if before.tests.get(t) != "PASSED"
        ]
        problems += [
            f"{iid}: {t} is {s} with the patch" for t, s in after.tests.items() if s != "PASSED"
        ]
        problems += [f"{iid}: {after.note}"] if after.note else []
    return problems


def check(path=None, sandbox_kind: str = "none", repos_dir=None) -> list[str]:
    """check_with for a JSONL (default: the shipped instances), its repositories beside it unless ``repos_dir``."""
    from lightning_lite.extras import sandbox

    path = Path(path or shipped())
    box = sandbox.make(sandbox_kind, image=DEFAULT_IMAGE)
    return check_with(load_instances(path), Sources(repos_dir or path.parent / "repos"), box)


if (
    __name__ == "__main__"
):  # python -m examples.swe.instances [INSTANCES.jsonl] [--sandbox none|bwrap|docker]
    args = sys.argv[1:]
    kind = args[args.index("--sandbox") + 1] if "--sandbox" in args else "none"
    files = [a for a in args if a.endswith(".jsonl")]
    found = check(files[0] if files else None, kind)
    print(
        "\n".join(found)
        or "every instance checks out (FAIL_TO_PASS fail at base_commit, all pass with the patch)"
    )
    sys.exit(1 if found else 0)
