"""SWE-bench-format instances in examples/swe (instances.py, make_instances.py, the CodingHarness path).

Without a sandbox (``none``): loading, the shipped build, the agent's checkout (no history past base_commit, no
hidden tests), the agent's diff (binary, untracked, its own .git unread) and the grader (the reference fix 1, no
change 0, a fix with trivially-passing tests 1, tests edited alone 0, a planted conftest.py 0), and a rollout's
lifecycle through the harness with a fake agent. @pytest.mark.sandbox: the same grader cases under bwrap and under
docker, a repository taken from an image's /testbed, and one train.py step of examples/swe on the shipped instances
on the embedded model under each sandbox.
"""

import asyncio
import glob
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, require
from examples.swe import instances as swe
from examples.swe import make_instances
from examples.swe.tasks import CodingHarness
from lightning_lite.harness import Endpoint, run_rollouts
from lightning_lite.extras.sandbox import Sandbox, make


@pytest.fixture(scope="session")
def graders_python():
    """The graders run an instance's tests with /usr/bin/python3 -m pytest (examples/swe): without it a
    grader test skips, and fails under CI (conftest.require: .ci/run's make setup-sandbox installs it)."""
    try:
        ok = (
            subprocess.run(
                ["/usr/bin/python3", "-c", "import pytest"], capture_output=True, timeout=60
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    require(
        ok,
        "the graders run the tests with /usr/bin/python3 -m pytest: apt-get install python3-pytest "
        "(make setup-sandbox)",
    )


needs_pytest = pytest.mark.usefixtures("graders_python")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The shipped instances, built into a private directory, and Sources with a private cache."""
    out = tmp_path_factory.mktemp("instances")
    path = make_instances.build(out)
    return path, swe.load_instances(path), swe.Sources(out / "repos", cache=out / "cache")


def by_id(insts, suffix):
    return next(i for i in insts if i["instance_id"].endswith(suffix))


def fix_files(inst, sources):
    """{path: bytes} of the reference fix (the fix commit's code files), read from the full source repository."""
    src = sources.source(inst)
    fix = swe.git("-C", str(src), "rev-list", "--all", "--children").stdout.decode()
    child = next(
        line.split()[1] for line in fix.splitlines() if line.startswith(inst["base_commit"])
    )
    return {
        p: swe.git("-C", str(src), "show", f"{child}:{p}").stdout
        for p in swe.patch_paths(inst["patch"].encode(), src)
    }, child


# ---------------------------------------------------------------------------- loading and the shipped build


def test_shipped_build_is_deterministic_and_swe_bench_shaped(built, tmp_path):
    path, insts, _ = built
    assert (
        make_instances.build(tmp_path / "again").read_text() == path.read_text()
    )  # same SHAs, same patches
    assert 4 <= len(insts) <= 6 and len({i["repo"] for i in insts}) == 3
    for raw in map(json.loads, path.read_text().splitlines()):
        assert set(swe.REQUIRED) | {"patch"} <= set(raw)
        assert isinstance(raw["FAIL_TO_PASS"], str) and json.loads(
            raw["FAIL_TO_PASS"]
        )  # JSON strings, as SWE-bench's dataset
    for inst in insts:
        assert inst["patch"].startswith("diff --git") and inst["test_patch"].startswith(
            "diff --git"
        )
        assert not any(
            swe.is_test_path(p) for p in swe.patch_paths(inst["patch"].encode(), path.parent)
        )
        assert all(
            swe.is_test_path(p) for p in swe.patch_paths(inst["test_patch"].encode(), path.parent)
        )
    assert any(
        " " in t and "[" in t for i in insts for t in i["PASS_TO_PASS"]
    )  # a parametrized id with spaces


def test_shipped_is_built_on_first_use(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_LITE_CACHE", str(tmp_path))
    path = swe.shipped()
    assert path == make_instances.default_dir() / "instances.jsonl" and str(path).startswith(
        str(tmp_path)
    )
    assert len(swe.load_instances("shipped")) == len(make_instances.INSTANCES)
    h = CodingHarness(instances="shipped")  # repos_dir defaults to the repos beside the JSONL
    assert (
        [t.id for t in h.tasks("train")]
        == [t.id for t in h.tasks("test")]
        == [i["instance_id"] for i in swe.load_instances(path)]
    )


def test_load_lists_json_strings_and_clear_errors(tmp_path):
    good = {
        "instance_id": "o__r-1",
        "repo": "o/r",
        "base_commit": "a" * 40,
        "problem_statement": "p",
        "patch": "",
        "test_patch": "t",
        "FAIL_TO_PASS": ["t::a"],
        "PASS_TO_PASS": '["t::b", "t::c[x - y]"]',
    }
    f = tmp_path / "i.jsonl"
    f.write_text(
        json.dumps(good)
        + "\n\n"
        + json.dumps({**good, "instance_id": "o__r-2", "FAIL_TO_PASS": '["t::d"]'})
        + "\n"
    )
    a, b = swe.load_instances(f)
    assert (
        a["FAIL_TO_PASS"] == ["t::a"]
        and a["PASS_TO_PASS"] == ["t::b", "t::c[x - y]"]
        and b["FAIL_TO_PASS"] == ["t::d"]
    )
    cases = [
        ({k: v for k, v in good.items() if k != "test_patch"}, "missing test_patch"),
        ({**good, "PASS_TO_PASS": "[not json"}, "not a JSON list"),
        ({**good, "FAIL_TO_PASS": [1]}, "list of test ids"),
        ({**good, "FAIL_TO_PASS": []}, "FAIL_TO_PASS is empty"),
        ({**good, "repo": "nope"}, "owner/name"),
        ({**good, "base_commit": "HEAD"}, "full commit SHA"),
    ]
    for bad, msg in cases:
        f.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=msg) as e:
            swe.load_instances(f)
        assert f"{f}:1" in str(e.value)  # where
    f.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(ValueError, match="appears twice"):
        swe.load_instances(f)
    with pytest.raises(ValueError, match="does not exist"):
        swe.load_instances(tmp_path / "missing.jsonl")
    with pytest.raises(
        ValueError, match="datasets"
    ):  # not installed here, or no hub: either way it says so
        swe.load_instances("princeton-nlp/SWE-bench_Verified")


def test_splits(built):
    _, insts, _ = built
    same = swe.make_splits(insts)
    assert (
        [t.id for t in same["train"]]
        == [t.id for t in same["test"]]
        == [i["instance_id"] for i in insts]
    )
    split = swe.make_splits(insts, test_split=0.4, seed=1)
    train, test = {t.id for t in split["train"]}, {t.id for t in split["test"]}
    assert len(test) == 2 and not train & test and train | test == {i["instance_id"] for i in insts}
    assert [t.id for t in swe.make_splits(insts, test_split=0.4, seed=1)["test"]] == [
        t.id for t in split["test"]
    ]
    with pytest.raises(ValueError, match="fraction"):
        swe.make_splits(insts, test_split=2)


def test_missing_repository_says_what_to_do(built, tmp_path):
    _, insts, _ = built
    with pytest.raises(ValueError, match="no repository for acme/textkit.*git clone"):
        swe.Sources(tmp_path / "empty", cache=tmp_path / "c").source(insts[0])
    path = tmp_path / "i.jsonl"
    path.write_text(json.dumps(insts[0]) + "\n")
    with pytest.raises(
        ValueError, match="no repository"
    ):  # at construction, not at the first rollout
        CodingHarness(instances=str(path))


# ---------------------------------------------------------------------------- the agent's checkout


def test_checkout_has_no_history_after_base_and_no_hidden_tests(built, tmp_path):
    _, insts, sources = built
    for k, inst in enumerate(insts):
        src, base = sources.source(inst), inst["base_commit"]
        repo = swe.checkout(sources.base(inst), tmp_path / str(k))
        run = lambda *a: swe.git("-C", str(repo), *a).stdout.decode()  # noqa: E731
        assert run("rev-parse", "HEAD").strip() == base and not run("status", "--porcelain")
        assert (
            run("log", "--all", "--format=%H").split()
            == swe.git("-C", str(src), "rev-list", base).stdout.decode().split()
        )
        assert run("for-each-ref", "--format=%(refname)").split() == [
            "refs/heads/main"
        ]  # no tags, no remotes
        assert not run("tag") and not run("remote") and not (repo / ".git" / "FETCH_HEAD").exists()
        assert not (
            repo / ".git" / "objects" / "info" / "alternates"
        ).exists()  # self-contained: works in a sandbox
        later = (
            swe.git("-C", str(src), "rev-list", "--objects", "--all", "--not", base)
            .stdout.decode()
            .split("\n")
        )
        later = [line.split()[0] for line in later if line]
        assert later  # the fix commit and what came after it exist in the source ...
        for obj in later:  # ... and none of their objects is in the agent's copy
            assert swe.git("-C", str(repo), "cat-file", "-e", obj, check=False).returncode != 0, (
                inst["instance_id"],
                obj,
            )
        _, fix = fix_files(inst, sources)
        assert fix in later
        history = run("log", "--all", "-p")
        for test in inst[
            "FAIL_TO_PASS"
        ]:  # the hidden tests are nowhere: not in the tree, not in the history
            name = test.split("::")[1].split("[")[0]
            if name != "test_camel_to_snake":  # (that one exists; test_patch adds parameters to it)
                assert f"def {name}" not in history and f"def {name}" not in run(
                    "grep", "-h", "def ", "HEAD"
                )
        assert "HTTPServer" not in history


def test_base_repository_is_verified(built, tmp_path):
    _, insts, sources = built
    base = sources.base(insts[0])
    swe.verify_base(base, insts[0]["base_commit"])
    bad = tmp_path / "bad.git"
    swe.git(
        "clone", "-q", "--bare", str(sources.source(insts[0])), str(bad)
    )  # everything, tags and the fix included
    with pytest.raises(RuntimeError, match="expected only refs/heads/main"):
        swe.verify_base(bad, insts[0]["base_commit"])


# ---------------------------------------------------------------------------- the agent's change


def test_agent_diff_is_binary_safe_takes_untracked_files_and_ignores_the_agents_git(
    built, tmp_path
):
    _, insts, sources = built
    inst = by_id(insts, "ledger-7")  # its fix adds a new module (untracked in the agent's copy)
    repo = swe.checkout(sources.base(inst), tmp_path / "agent")
    files, _ = fix_files(inst, sources)
    for p, data in files.items():
        (repo / p).write_bytes(data)
    blob = bytes(range(256)) * 4 + b"\0\xff\xfe not utf-8"
    (repo / "src" / "ledger" / "rates.bin").write_bytes(blob)
    (repo / "README.md").unlink()
    # the agent commits part of it and plants config that would run code on the host if its .git were used
    swe.git("-C", str(repo), "add", "src/ledger/money.py")
    swe.git("-C", str(repo), "commit", "-q", "-m", "wip")
    marker = tmp_path / "pwned"
    for key in ("core.fsmonitor", "core.pager", "diff.external"):
        swe.git("-C", str(repo), "config", key, f"touch {marker}; false")
    swe.git("-C", str(repo), "config", "filter.x.clean", f"touch {marker}; cat")
    (repo / ".gitattributes").write_text("* filter=x\n")
    (repo / ".git" / "hooks" / "pre-commit").write_text(f"#!/bin/sh\ntouch {marker}\n")
    patch = swe.agent_diff(sources.base(inst), repo)
    assert not marker.exists()
    assert (
        b"GIT binary patch" in patch
        and b"src/ledger/_parse.py" in patch
        and b"deleted file mode" in patch
    )
    paths = swe.patch_paths(patch, tmp_path)
    assert {
        "src/ledger/_parse.py",
        "src/ledger/money.py",
        "src/ledger/rates.bin",
        "README.md",
        ".gitattributes",
    } <= paths
    fresh = swe.checkout(sources.base(inst), tmp_path / "fresh")
    swe.git("-C", str(fresh), "apply", "--index", input=patch)
    assert (fresh / "src" / "ledger" / "rates.bin").read_bytes() == blob and not (
        fresh / "README.md"
    ).exists()
    assert all((fresh / p).read_bytes() == data for p, data in files.items())
    assert (
        swe.agent_diff(sources.base(inst), swe.checkout(sources.base(inst), tmp_path / "untouched"))
        == b""
    )


def test_parse_summary():
    ids = ["t.py::a", "t.py::b[x - y]", "t.py::c", "t.py::d", "t.py::e"]
    out = (
        "PASSED t.py::c\n"  # printed by the code under test, before pytest's summary: ignored
        "==== short test summary info ====\n"
        "PASSED t.py::a\nFAILED t.py::b[x - y] - AssertionError: x - y\nPASSED t.py::d\nERROR t.py::d - boom\n"
        "XFAIL t.py::e - known\n==== 1 failed, 2 passed in 0.1s ====\n"
    )
    assert swe.parse_summary(out, ids) == {
        "t.py::a": "PASSED",
        "t.py::b[x - y]": "FAILED",
        "t.py::c": "missing",
        "t.py::d": "ERROR",
        "t.py::e": "XFAIL",
    }
    assert swe.parse_summary("collected 0 items\n", ids) is None


# ---------------------------------------------------------------------------- the grader


def grader_cases(inst, sources, box, tmp_path):
    """(case, reward, grade) for the grader's cases on one instance, in the sandbox ``box``."""
    files, _ = fix_files(inst, sources)
    out = []

    def change(name, write):
        repo = swe.checkout(sources.base(inst), tmp_path / name)
        write(repo)
        g = swe.grade(
            inst, swe.agent_diff(sources.base(inst), repo), sources, box, image=swe.DEFAULT_IMAGE
        )
        out.append((name, g.reward, g))

    def fix(repo):
        for p, data in files.items():
            (repo / p).write_bytes(data)

    def gut_tests(repo):  # every test file: one test that passes
        for p in repo.glob("tests/test_*.py"):
            p.write_text("def test_ok():\n    pass\n")

    def conftest(repo):  # a hook that makes every test pass
        (repo / "conftest.py").write_text(
            "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
            "    rep = (yield).get_result()\n    rep.outcome = 'passed'\n"
        )

    change("fix", fix)
    change("nothing", lambda repo: None)
    change("fix+gutted tests", lambda repo: (fix(repo), gut_tests(repo)))
    change("gutted tests", gut_tests)
    change("conftest", conftest)
    change(
        "shadow pytest",
        lambda repo: (repo / "pytest.py").write_text(
            "import sys\nfor t in sys.argv[1:]: print('short test summary info\\nPASSED', t)\n"
        ),
    )
    out.append(("reference patch", swe.grade(inst, inst["patch"], sources, box).reward, None))
    return out


EXPECTED = {
    "fix": 1.0,
    "nothing": 0.0,
    "fix+gutted tests": 1.0,
    "gutted tests": 0.0,
    "conftest": 0.0,
    "shadow pytest": 0.0,
    "reference patch": 1.0,
}


@needs_pytest
def test_grader_without_a_sandbox(built, tmp_path):
    _, insts, sources = built
    cases = grader_cases(by_id(insts, "textkit-12"), sources, Sandbox(), tmp_path)
    assert {name: r for name, r, _ in cases} == EXPECTED
    g = dict((name, g) for name, _, g in cases)
    assert g["fix+gutted tests"].restored == ["tests/test_slug.py", "tests/test_wrap.py"]
    assert g["conftest"].restored == ["conftest.py"] and g["shadow pytest"].restored == [
        "pytest.py"
    ]
    assert g["nothing"].tests["tests/test_slug.py::test_collapses_runs"] == "FAILED"
    assert (
        g["nothing"].tests["tests/test_wrap.py::test_line_count[the quick brown fox-10-2]"]
        == "PASSED"
    )
    for (
        inst
    ) in insts:  # every instance: the reference fix 1, no change 0, each test as its list says
        fixed, nothing = (
            swe.grade(inst, inst["patch"], sources, Sandbox()),
            swe.grade(inst, "", sources, Sandbox()),
        )
        assert fixed.reward == 1.0 and nothing.reward == 0.0, inst["instance_id"]
        assert {t: nothing.tests[t] for t in inst["FAIL_TO_PASS"]} == dict.fromkeys(
            inst["FAIL_TO_PASS"], "FAILED"
        )
        assert {t: nothing.tests[t] for t in inst["PASS_TO_PASS"]} == dict.fromkeys(
            inst["PASS_TO_PASS"], "PASSED"
        )


@needs_pytest
def test_grader_hangs_broken_patches_and_broken_sandboxes(built, tmp_path):
    _, insts, sources = built
    inst = by_id(insts, "intervals-3")
    repo = swe.checkout(sources.base(inst), tmp_path / "a")
    swe.git("-C", str(repo), "apply", input=inst["patch"].encode())
    (repo / "intervals" / "__init__.py").write_text("import time\ntime.sleep(60)\n")
    g = swe.grade(inst, swe.agent_diff(sources.base(inst), repo), sources, Sandbox(), timeout=3)
    assert g.reward == 0.0 and "ran past 3 s" in g.note
    g = swe.grade(
        inst,
        "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n",
        sources,
        Sandbox(),
    )
    assert g.reward == 0.0 and "does not apply" in g.note
    assert swe.grade(inst, b"x" * (swe.MAX_PATCH + 1), sources, Sandbox()).reward == 0.0
    in_repo = dict(
        inst, test_patch="", FAIL_TO_PASS=["tests/test_intervals.py::test_overlap"]
    )  # SWE-smith's shape
    assert swe.grade(in_repo, inst["patch"], sources, Sandbox()).reward == 1.0
    broken = dict(
        inst, test_cmd="python3 -c 'print(1)'"
    )  # no pytest summary: the setup is broken, say so
    with pytest.raises(RuntimeError, match="no pytest short summary"):
        swe.grade(broken, inst["patch"], sources, Sandbox())


class FakeAgent(CodingHarness):
    """Applies the instance's reference patch with git (or changes nothing) inside the workspace."""

    name = "fake-swe"
    sandbox = Sandbox()

    def __init__(self, fix, **kw):
        super().__init__(**kw)
        self.fix = fix

    def agent(self, task, endpoint, repo, home):
        assert task.meta["instance"] and task.answer["problem_statement"].strip() in task.prompt
        code = (
            f"import os, subprocess\nos.chdir({str(repo)!r})\n"  # the cwd is the rollout's directory: repo/ and home/
            + (
                f"subprocess.run(['git', 'apply'], input={task.answer['patch']!r}, text=True, check=True)\n"
                if self.fix
                else ""
            )
        )
        return [sys.executable, "-c", code], {}


@needs_pytest
@pytest.mark.parametrize("fix", [True, False])
def test_rollouts_through_the_harness(built, fix):
    path, insts, sources = built
    h = FakeAgent(fix, instances=str(path))
    h.sources = sources  # the module's cache
    jobs = [(f"fake-swe-{i}", t, h) for i, t in enumerate(h.tasks("train"))]
    endpoint_for = lambda rid: Endpoint(
        "http://127.0.0.1:9/v1", "k", "m", rid, "http://127.0.0.1:9"
    )  # noqa: E731
    results = asyncio.run(run_rollouts(jobs, endpoint_for, timeout=120, progress=False))
    assert [(r.reward, r.error) for r in results] == [(float(fix), None)] * len(insts), results
    assert (
        not h._roots
        and not glob.glob("/tmp/ll-coding-fake-swe-*")
        and not glob.glob("/tmp/ll-grade-*")
    )


# ---------------------------------------------------------------------------- in the sandboxes


@pytest.fixture(params=["bwrap", "docker"])
def box(request):
    if request.param == "bwrap":
        request.getfixturevalue("bwrap_ok")
        request.getfixturevalue("graders_python")  # bwrap shows the graders the host's system
        return make("bwrap")
    return make("docker", image=request.getfixturevalue("docker_image"))


@pytest.mark.sandbox
def test_grader_in_the_sandbox(built, box, tmp_path):
    _, insts, sources = built
    cases = grader_cases(
        by_id(insts, "ledger-7"), sources, box, tmp_path
    )  # test_cmd with PYTHONPATH=src
    assert {name: r for name, r, _ in cases} == EXPECTED
    assert swe.check_with(insts, sources, box) == []


@pytest.mark.sandbox
def test_repository_from_an_image_testbed(built, docker_image, tmp_path):
    """An instance with an image and no local repository: /testbed's .git is copied out of the image once."""
    _, insts, sources = built
    inst = by_id(insts, "intervals-3")
    image = f"ll-test-testbed:{os.getpid()}"
    cid = subprocess.run(
        ["docker", "create", docker_image, "true"], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        subprocess.run(
            ["docker", "cp", str(sources.source(inst)), f"{cid}:/testbed"],
            check=True,
            capture_output=True,
        )
        subprocess.run(["docker", "commit", cid, image], check=True, capture_output=True)
        inst = dict(inst, image=image)
        fresh = swe.Sources(tmp_path / "no-repos", cache=tmp_path / "cache")
        assert fresh.source(inst) == tmp_path / "cache" / "testbeds" / image.replace(":", "_")
        box = make("docker", image=docker_image)
        assert swe.grade(inst, inst["patch"], fresh, box).reward == 1.0  # in the instance's image
        assert swe.grade(inst, "", fresh, box).reward == 0.0
        repo = swe.checkout(fresh.base(inst), tmp_path / "agent")
        assert (
            swe.git("-C", str(repo), "log", "--all", "--oneline").stdout.decode().count("\n") == 3
        )
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)
        subprocess.run(["docker", "rmi", "-f", image], capture_output=True)


@pytest.mark.sandbox
@pytest.mark.parametrize("kind", ["bwrap", "docker"])
def test_train_step_on_the_shipped_instances(built, kind, request, tmp_path):
    """One train.py step of examples/swe (mini-swe-agent) on the shipped instances, in the sandbox: every rollout
    graded (reward 0.0 or 1.0), none failed."""
    require(
        os.path.exists(os.path.join(ROOT, ".harnesses", "mini-swe-agent-venv", "bin", "mini")),
        "swe: .harnesses/mini-swe-agent-venv is not installed "
        "(run tests/real_harnesses/install.sh mini-swe-agent)",
    )
    image = None
    if kind == "docker":
        image = request.getfixturevalue("docker_image")
    else:
        request.getfixturevalue("bwrap_ok")
        request.getfixturevalue("graders_python")  # bwrap shows the graders the host's system
    path, _, _ = built
    out = str(tmp_path / "run")
    p = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--harness",
            "swe",
            "--harness-arg",
            f"instances={path}",
            "--sandbox",
            kind,
            *(["--sandbox-image", image] if image else []),
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--group-size",
            "2",
            "--eval-tasks",
            "0",
            "--max-new-tokens",
            "64",
            "--max-seq-len",
            "8192",
            "--harness-arg",
            "step_limit=2",
            "--rollout-timeout",
            "600",
            "--out",
            out,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    (row,) = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rollouts = [
        json.loads(line)
        for f in glob.glob(os.path.join(out, "rollouts", "step_*.jsonl"))
        for line in open(f)
    ]
    assert len(rollouts) == 2 and row["failed"] == 0, (rollouts, p.stderr[-5000:])
    assert all(r["error"] is None and r["reward"] in (0.0, 1.0) for r in rollouts), rollouts
    assert {r["task_id"] for r in rollouts} <= {i["instance_id"] for i in swe.load_instances(path)}
