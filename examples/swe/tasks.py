"""Coding tasks for agent harnesses: small Python repos with a bug, a failing test and hidden tests.

Shared by examples/swe (mini-swe-agent) and examples/openhands. Everything is
generated from a seed: each task is one of the bug families below with random
names, constants and test inputs. A task's workspace holds the buggy module(s)
and one visible test file that fails; the hidden tests are kept in the task
and only meet the agent's code when it is scored::

    >>> t = make_tasks(n_train=64, n_test=16)["test"][0]
    >>> root = new_rollout_dir("r0")                 # root/repo (the workspace), root/home
    >>> write_workspace(t, root / "repo")            # buggy code + failing visible test, no .git
    >>> score(t, root / "repo")                      # nothing fixed yet
    0.0
    >>> write_solution(t, root / "repo"); score(t, root / "repo")
    1.0

Reward (as in SWE-bench): the hidden tests are FAIL_TO_PASS tests (each fails on
the buggy code) and PASS_TO_PASS tests (each passes on it, guarding against a
"fix" that breaks what worked). reward = fraction of FAIL_TO_PASS tests that
pass, or 0 when any PASS_TO_PASS test fails. An empty change scores 0, the
reference fix 1, and fixing one of two bugs about 0.5.

Guards: scoring builds a fresh directory from the task's *source files as the
agent left them* plus the task's own test files (so an edited or deleted test
is restored, and files the agent added, e.g. a fake ``unittest.py``, are
ignored), and runs the hidden tests there with ``python -I`` in the harness's sandbox, with a timeout:
agent-written code is never imported into the trainer.

SWE-bench-format instances (real repositories, graded by their own tests) are in instances.py; CodingHarness
runs either kind.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shlex
import shutil
import signal
import sys
import tempfile
import types
import uuid
from pathlib import Path
from typing import Optional

from examples.swe import instances as swe
from lightning_lite.extras.programs import SubprocessHarness
from lightning_lite.extras.sandbox import Sandbox
from lightning_lite.harness import REPO_ROOT, Endpoint, Task

# ---------------------------------------------------------------------------- bug families
# Each family(rng) returns a dict:
#   files:  {filename: correct source}
#   bugs:   [(filename, correct snippet, buggy snippet)]  (applied to get the task's code)
#   calls:  expressions over the modules' functions; the expected values come from the
#           correct code, and each call is FAIL_TO_PASS or PASS_TO_PASS depending on whether
#           the buggy code gets it wrong
#   issue:  the first line of the problem statement

NAMES = ["data", "items", "values", "nums", "xs", "seq"]


def _ints(rng, n, lo=1, hi=20):
    return [rng.randint(lo, hi) for _ in range(n)]


def off_by_one(rng):
    fn, mod, v = (
        rng.choice(["sum_first", "head_total", "total_of_first"]),
        rng.choice(["listops", "seqtools"]),
        rng.choice(NAMES),
    )
    src = f'''def {fn}({v}, n):
    """Return the sum of the first n elements of {v}."""
    total = 0
    for i in range(n):
        total += {v}[i]
    return total
'''
    calls = [f"{fn}({_ints(rng, k)}, {rng.randint(1, k)})" for k in (3, 4, 5, 6, 7)] + [
        f"{fn}({_ints(rng, 3)}, 0)"
    ]
    return dict(
        files={f"{mod}.py": src},
        bugs=[(f"{mod}.py", "range(n)", "range(n - 1)")],
        calls=calls,
        issue=f"`{fn}` in `{mod}.py` does not add up the first n elements.",
        difficulty=1,
    )


OPERATOR_FORMULAS = [  # name, params, doc, correct expression, buggy expression
    (
        "rectangle_area",
        "width, height",
        "the area of a width x height rectangle",
        "width * height",
        "width + height",
    ),
    (
        "total_cost",
        "price, quantity",
        "price times quantity",
        "price * quantity",
        "price + quantity",
    ),
    (
        "remaining",
        "budget, spent",
        "what is left of the budget after spending",
        "budget - spent",
        "budget + spent",
    ),
    (
        "per_person",
        "total, people",
        "the total split evenly between people (a float)",
        "total / people",
        "total * people",
    ),
    (
        "distance",
        "speed, hours",
        "how far you get at speed for that many hours",
        "speed * hours",
        "speed / hours",
    ),
]


def wrong_operator(rng):
    fn, params, doc, good, bad = rng.choice(OPERATOR_FORMULAS)
    mod = rng.choice(["calc", "formulas", "mathutil"])
    src = f'def {fn}({params}):\n    """Return {doc}."""\n    return {good}\n'
    calls = [f"{fn}({rng.randint(3, 40)}, {rng.randint(3, 9)})" for _ in range(5)]
    return dict(
        files={f"{mod}.py": src},
        bugs=[(f"{mod}.py", f"return {good}", f"return {bad}")],
        calls=calls,
        issue=f"`{fn}` in `{mod}.py` computes the wrong value.",
        difficulty=1,
    )


def wrong_comparison(rng):
    fn, mod, t = (
        rng.choice(["count_above", "num_greater", "count_over"]),
        rng.choice(["scores", "grading"]),
        rng.randint(5, 15),
    )
    src = f'''def {fn}(scores, threshold={t}):
    """Count the scores strictly greater than threshold."""
    return sum(1 for s in scores if s > threshold)
'''
    calls = [f"{fn}({_ints(rng, 5, 1, 20) + [x]}, {x})" for x in _ints(rng, 4, 3, 18)] + [
        f"{fn}([{t}, {t + 1}])",
        f"{fn}([])",
    ]
    return dict(
        files={f"{mod}.py": src},
        bugs=[(f"{mod}.py", "if s > threshold", "if s >= threshold")],
        calls=calls,
        issue=f"`{fn}` in `{mod}.py` counts scores that are equal to the threshold.",
        difficulty=1,
    )


def missing_edge_case(rng):
    fn, mod, v = (
        rng.choice(["mean", "average", "avg"]),
        rng.choice(["stats", "numbers"]),
        rng.choice(NAMES),
    )
    default = rng.choice(["0.0", "None"])
    guard = f"    if not {v}:\n        return {default}\n"
    src = f'''def {fn}({v}):
    """Return the arithmetic mean of {v}, or {default} when it is empty."""
{guard}    return sum({v}) / len({v})
'''
    calls = ["%s([])" % fn, "%s(())" % fn] + [f"{fn}({_ints(rng, k)})" for k in (1, 3, 4)]
    return dict(
        files={f"{mod}.py": src},
        bugs=[(f"{mod}.py", guard, "")],
        calls=calls,
        issue=f"`{fn}` in `{mod}.py` crashes on an empty input; it should return {default}.",
        difficulty=2,
    )


def wrong_default(rng):
    fn, mod, width, wrong = (
        rng.choice(["pad_right", "ljust_to"]),
        rng.choice(["textutil", "strings"]),
        rng.randint(6, 12),
        rng.randint(2, 5),
    )
    src = f'''def {fn}(text, width={width}, fill="."):
    """Pad text on the right with fill up to width characters (default {width})."""
    return text + fill * (width - len(text))
'''
    words = ["ab", "cat", "tree", "x", "hello"]
    calls = [f"{fn}({w!r})" for w in rng.sample(words, 3)] + [
        f"{fn}({w!r}, {rng.randint(5, 9)})" for w in rng.sample(words, 2)
    ]
    return dict(
        files={f"{mod}.py": src},
        bugs=[(f"{mod}.py", f"width={width},", f"width={width - wrong},")],
        calls=calls,
        issue=f"`{fn}` in `{mod}.py` pads to the wrong width when no width is given (it should be {width}).",
        difficulty=2,
    )


def mutable_default(rng):
    fn, mod = rng.choice(["add_tag", "append_item", "collect"]), rng.choice(["tags", "bag"])
    good = f'def {fn}(item, items=None):\n    """Append item to items (a new list if none is given) and return the list."""\n    if items is None:\n        items = []\n'
    bad = f'def {fn}(item, items=[]):\n    """Append item to items (a new list if none is given) and return the list."""\n'
    src = good + "    items.append(item)\n    return items\n"
    a, b, c = rng.sample(["red", "blue", "green", "tea", "sun", "map"], 3)
    calls = [
        f"({fn}({a!r}), {fn}({b!r}))[1]",
        f"({fn}({b!r}), {fn}({c!r}), {fn}({a!r}))[2]",
        f"{fn}({c!r}, [{a!r}])",
    ]
    return dict(
        files={f"{mod}.py": src},
        bugs=[(f"{mod}.py", good, bad)],
        calls=calls,
        issue=f"`{fn}` in `{mod}.py` remembers items from earlier calls.",
        difficulty=2,
    )


def counting(rng):
    fn, mod = rng.choice(["word_counts", "count_words", "tally"]), rng.choice(["text", "wordstats"])
    src = f'''def {fn}(sentence):
    """Map each word of sentence to how many times it occurs."""
    counts = {{}}
    for word in sentence.split():
        counts[word] = counts.get(word, 0) + 1
    return counts
'''
    words = ["a", "b", "cat", "dog", "sun"]
    calls = [f"{fn}({' '.join(rng.choice(words) for _ in range(k))!r})" for k in (3, 5, 6, 8)] + [
        f"{fn}('')",
        f"{fn}('one two')",
    ]
    return dict(
        files={f"{mod}.py": src},
        bugs=[(f"{mod}.py", "counts.get(word, 0) + 1", "1")],
        calls=calls,
        issue=f"`{fn}` in `{mod}.py` does not count repeated words.",
        difficulty=1,
    )


def early_return(rng):
    fn, mod = rng.choice(["all_positive", "every_positive"]), rng.choice(["checks", "validate"])
    good = "    for x in values:\n        if x <= 0:\n            return False\n    return True\n"
    bad = "    for x in values:\n        if x <= 0:\n            return False\n        return True\n    return True\n"
    src = f'def {fn}(values):\n    """True when every value is > 0 (also for no values)."""\n{good}'
    calls = [f"{fn}({_ints(rng, 3) + [-x]})" for x in _ints(rng, 3)] + [
        f"({fn}([]), {fn}([{rng.randint(1, 9)}]))",
        f"{fn}([-1, 2])",
    ]
    return dict(
        files={f"{mod}.py": src},
        bugs=[(f"{mod}.py", good, bad)],
        calls=calls,
        issue=f"`{fn}` in `{mod}.py` only looks at the first value.",
        difficulty=2,
    )


def two_functions(rng):
    mod = rng.choice(["temperature", "units"])
    src = '''def c_to_f(celsius):
    """Degrees Celsius to Fahrenheit."""
    return celsius * 9 / 5 + 32


def f_to_c(fahrenheit):
    """Degrees Fahrenheit to Celsius."""
    return (fahrenheit - 32) * 5 / 9
'''
    calls = [f"c_to_f({x})" for x in _ints(rng, 3, 1, 100)] + [
        f"f_to_c({x})" for x in _ints(rng, 3, 40, 200)
    ]
    return dict(
        files={f"{mod}.py": src},
        calls=calls,
        difficulty=3,
        bugs=[
            (f"{mod}.py", "celsius * 9 / 5 + 32", "celsius * 5 / 9 + 32"),
            (f"{mod}.py", "(fahrenheit - 32) * 5 / 9", "fahrenheit - 32 * 5 / 9"),
        ],
        issue=f"Both conversions in `{mod}.py` (`c_to_f` and `f_to_c`) give wrong results.",
    )


def two_files(rng):
    rate = rng.choice([5, 10, 20, 25])
    pricing = f'''def with_tax(amount, percent={rate}):
    """amount plus percent % tax."""
    return amount * (100 + percent) / 100
'''
    cart = '''from pricing import with_tax


def count_items(quantities):
    """Total number of items: the sum of the quantities."""
    n = 0
    for q in quantities:
        n += q
    return n


def cart_total(prices):
    """Sum of prices, with tax."""
    return with_tax(sum(prices))
'''
    calls = (
        [f"with_tax({x})" for x in _ints(rng, 2, 10, 90)]
        + [f"cart_total({_ints(rng, 3, 1, 30)})" for _ in range(2)]
        + [f"count_items({_ints(rng, 4, 1, 5)})" for _ in range(2)]
    )
    return dict(
        files={"pricing.py": pricing, "cart.py": cart},
        calls=calls,
        difficulty=3,
        bugs=[
            ("pricing.py", "amount * (100 + percent) / 100", "amount * percent / 100"),
            ("cart.py", "n += q", "n += 1"),
        ],
        issue="The shop code is wrong in two places: `with_tax` (pricing.py) and `count_items` (cart.py).",
    )


FAMILIES = [
    off_by_one,
    wrong_operator,
    wrong_comparison,
    counting,
    missing_edge_case,
    wrong_default,
    mutable_default,
    early_return,
    two_functions,
    two_files,
]


# ---------------------------------------------------------------------------- building a task


def _load(files: dict) -> dict:
    """Exec our own (generated, trusted) sources as modules; return their functions by name.
    Modules go into sys.modules only while loading, so ``from pricing import with_tax`` works."""
    names, loaded = [f[:-3] for f in files], {}
    saved = {n: sys.modules.get(n) for n in names}
    try:
        for fname in sorted(files, key=lambda f: "import" in files[f]):  # dependencies first
            m = types.ModuleType(fname[:-3])
            sys.modules[m.__name__] = m
            exec(files[fname], m.__dict__)
            loaded.update(
                {k: v for k, v in vars(m).items() if callable(v) and not k.startswith("_")}
            )
    finally:
        for n, old in saved.items():
            if old is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = old
    return loaded


def _outcome(files: dict, call: str):
    """("ok", value) or ("raises", exception name), on fresh modules (mutable defaults!)."""
    try:
        return ("ok", eval(call, _load(files)))
    except Exception as e:
        return ("raises", type(e).__name__)


def _assertion(call: str, outcome) -> str:
    kind, value = outcome
    if kind == "raises":
        return f"with self.assertRaises({value}):\n            {call}"
    if isinstance(value, float):
        return f"self.assertAlmostEqual({call}, {value!r}, places=6)"
    return f"self.assertEqual({call}, {value!r})"


def _test_file(files: dict, classes: dict) -> str:
    """A unittest file: {class name: [(call, outcome)]}."""
    used = " ".join(call for cases in classes.values() for call, _ in cases)
    imports = ""
    for fname, src in sorted(files.items()):
        names = [n for n in re.findall(r"^def (\w+)\(", src, re.M) if f"{n}(" in used]
        imports += f"from {fname[:-3]} import {', '.join(names)}\n" if names else ""
    body = ""
    for cls, cases in classes.items():
        tests = "\n\n".join(
            f"    def test_{i}(self):\n        {_assertion(c, o)}" for i, (c, o) in enumerate(cases)
        )
        body += f"\n\nclass {cls}(unittest.TestCase):\n{tests or '    pass'}\n"
    return f'import unittest\n\n{imports}{body.rstrip()}\n\n\nif __name__ == "__main__":\n    unittest.main()\n'


def build_task(family, rng: random.Random, task_id: str):
    """One task from a bug family, or None when the random draw gave no failing case."""
    spec = family(rng)
    good = spec["files"]
    bad = dict(good)
    for fname, old, new in spec["bugs"]:
        assert old in bad[fname], (family.__name__, old)
        bad[fname] = bad[fname].replace(old, new, 1)
    f2p, p2p = [], []
    for call in dict.fromkeys(spec["calls"]):  # unique, in order
        want, got = _outcome(good, call), _outcome(bad, call)
        if want[0] == "ok":  # only calls that work on the reference are tests
            (p2p if got == want else f2p).append((call, want))
    if not f2p:
        return None
    # the visible test: the first failing case of each function, plus one that already works
    first = {}
    for call, want in f2p:
        first.setdefault(call.lstrip("(").split("(")[0], (call, want))
    shown = f2p[0]
    visible = _test_file(good, {"TestVisible": list(first.values()) + p2p[:1]})
    hidden = _test_file(good, {"FailToPass": f2p, "PassToPass": p2p})
    test_name = f"test_{sorted(good)[-1][:-3]}.py"
    got = _outcome(bad, shown[0])
    got_text = f"raises {got[1]}" if got[0] == "raises" else f"returns {got[1]!r}"
    prompt = (
        f"{spec['issue']} For example `{shown[0]}` should be {shown[1][1]!r} but {got_text}.\n"
        f"The repository is in the current directory. Fix the code, not the tests: "
        f"`python -m unittest` must pass (it runs {test_name})."
    )
    answer = {
        "files": bad,
        "solution": good,
        "tests": {test_name: visible},
        "hidden": hidden,
        "f2p": len(f2p),
        "p2p": len(p2p),
    }
    return Task(
        task_id, prompt, answer, {"family": family.__name__, "difficulty": spec["difficulty"]}
    )


def make_tasks(n_train: int = 64, n_test: int = 16, seed: int = 0) -> dict[str, list[Task]]:
    """{"train": [...], "test": [...]}: deterministic in (n_train, n_test, seed); every family
    in both splits (round robin); the splits share no task (same code and tests)."""
    out, seen = {}, set()
    for split, n in (("test", n_test), ("train", n_train)):
        rng, tasks = random.Random(f"swe-{split}-{seed}"), []
        for k in range(50 * n + 100):
            if len(tasks) == n:
                break
            family = FAMILIES[len(tasks) % len(FAMILIES)]
            task = build_task(family, rng, f"swe-{family.__name__}-{split}-{len(tasks)}")
            key = task and json.dumps([task.answer["files"], task.answer["hidden"]])
            if task and key not in seen:
                seen.add(key)
                tasks.append(task)
        else:
            raise ValueError(f"too few distinct tasks for n_{split}={n}")
        out[split] = tasks
    return out


# ---------------------------------------------------------------------------- workspaces


def new_rollout_dir(rollout_id: str) -> Path:
    """A fresh private directory for one rollout: ``repo/`` (the agent's workspace) and ``home/``
    (its HOME, config and trajectory: kept out of the repo)."""
    root = Path(tempfile.mkdtemp(prefix=f"ll-coding-{rollout_id}-"))
    (root / "repo").mkdir()
    (root / "home" / "tmp").mkdir(parents=True)
    return root


def write_workspace(task: Task, repo: Path):
    """The buggy sources and the visible tests; no hidden tests, no .git with the fix."""
    for name, text in {**task.answer["files"], **task.answer["tests"]}.items():
        (Path(repo) / name).write_text(text)


def write_solution(task: Task, repo: Path):
    """The reference fix (for tests and for checking the task set)."""
    for name, text in task.answer["solution"].items():
        (Path(repo) / name).write_text(text)


RUNNER = """import json, os, sys, unittest
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.argv = ["hidden"]
suite = unittest.defaultTestLoader.loadTestsFromName("hidden_tests")
result = unittest.TestResult()
suite.run(result)
bad = [t.id().split(".")[1] for t, _ in result.failures + result.errors]
print(json.dumps({"run": result.testsRun, "f2p_bad": bad.count("FailToPass"), "p2p_bad": bad.count("PassToPass")}))
"""


# The interpreter of the task repos, for the agent (``python`` on its PATH) and for scoring: the
# base Python, not the trainer's venv, so that an agent's ``pip install`` cannot touch the trainer.
PYTHON = getattr(sys, "_base_executable", None) or sys.executable


def score(
    task: Task, repo, timeout: float = 30.0, python: str = PYTHON, box=None, ro_binds=(), image=None
) -> float:
    """Reward of the workspace ``repo`` as the agent left it (see the module docstring). Runs in a fresh
    directory and a subprocess, in the sandbox ``box`` when given (the interpreter's prefix in ``ro_binds``);
    a crash or timeout scores 0."""
    a = task.answer
    with tempfile.TemporaryDirectory(prefix="ll-score-") as d:
        for name in a[
            "files"
        ]:  # the sources the agent may fix; nothing else is taken from the workspace
            src = Path(repo) / name
            if src.is_file() and not src.is_symlink():
                shutil.copyfile(src, Path(d) / name)
        for name, text in {
            **a["tests"],
            "hidden_tests.py": a["hidden"],
            "run_hidden.py": RUNNER,
        }.items():
            (Path(d) / name).write_text(
                text
            )  # the task's own tests: an agent's edit is undone here
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
        rc, out = swe.run_in_sandbox(
            box or Sandbox(),
            f"exec {shlex.quote(python)} -I -B run_hidden.py",
            env,
            d,
            image=image,
            ro_binds=ro_binds,
            timeout=timeout,
        )
        try:
            res = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return 0.0  # a hang, a crash, or output the runner did not write
    if rc is None or res["run"] != a["f2p"] + a["p2p"] or res["p2p_bad"]:
        return 0.0
    return (a["f2p"] - res["f2p_bad"]) / a["f2p"]


def kill_leftovers(marker: str):
    """SIGKILL every process of ours whose environment contains ``LL_WORKSPACE=marker``. The
    harness already kills the agent's process group; this also reaches what left the group
    (``setsid`` shells, tmux servers), since they inherit the environment. Linux only."""
    needle = f"LL_WORKSPACE={marker}\0".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(pid) != os.getpid() and needle in Path(f"/proc/{pid}/environ").read_bytes():
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # gone already, or not ours


# ---------------------------------------------------------------------------- the harness base


class CodingHarness(SubprocessHarness):
    """Coding tasks for an agent program; a subclass writes ``agent(task, endpoint, repo, home) -> (argv, env)``.
    The tasks are the generated ones above, or with ``instances`` SWE-bench-format instances (a JSONL file,
    ``"shipped"``, or a ``datasets`` name with its ``split``; examples/swe/instances.py), whose repositories come
    from ``repos_dir`` or their images. Each rollout gets a fresh ``repo`` (the agent's workspace) and ``home``
    under one private directory (the program's cwd, all the sandbox lets it write), removed afterwards with every
    process that still carries its marker."""

    # In the sandbox: the tests' Python, not the repo (a subclass adds its agent's venv, which may lie inside it):
    # tasks.py regenerates every task's fix from its seed, and make_instances.py holds the instances' fixes.
    ro_binds = tuple(dict.fromkeys((sys.base_prefix, os.path.dirname(os.path.dirname(PYTHON)))))
    hide = (str(REPO_ROOT),)

    def __init__(
        self,
        n_train: int = 64,
        n_test: int = 16,
        seed: int = 0,
        score_timeout: Optional[float] = None,
        instances: Optional[str] = None,
        split: str = "test",
        repos_dir: Optional[str] = None,
        test_split: Optional[float] = None,
        image: Optional[str] = None,
    ):
        self.sources = None
        if instances is None:
            self._tasks = make_tasks(n_train, n_test, seed)
        else:
            insts = swe.load_instances(instances, split)
            self._tasks = swe.make_splits(insts, test_split, seed)
            if (
                repos_dir is None
            ):  # a JSONL's repositories beside it, as make_instances.py writes them
                jsonl = (
                    swe.shipped()
                    if instances == "shipped"
                    else Path(os.path.expanduser(str(instances)))
                )
                repos_dir = jsonl.parent / "repos" if (jsonl.parent / "repos").is_dir() else None
            self.sources = swe.Sources(repos_dir)
            self.hide = (
                *self.hide,
                *([str(repos_dir)] if repos_dir else []),
            )  # the repositories' later history
            for inst in {
                i["repo"] + i["base_commit"]: i for i in insts
            }.values():  # fail now, not at each rollout
                self.sources.local(inst)
        # a repository's tests take longer than a generated task's
        self.score_timeout = score_timeout or (30.0 if instances is None else 600.0)
        self.image = image  # docker's image: an instance's own first, then this, --sandbox-image, DEFAULT_IMAGE
        self._roots: dict[str, Path] = {}  # rollout id -> its directory

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            raise ValueError(f"{self.name} has splits 'train' and 'test', not {split!r}")
        return self._tasks[split]

    def agent(
        self, task: Task, endpoint: Endpoint, repo: Path, home: Path
    ) -> tuple[list[str], dict]:
        raise NotImplementedError

    def _image(self, task: Task) -> str:
        own = task.answer.get("image") if task.meta.get("instance") else None
        return own or self.image or getattr(self.sandbox, "image", None) or swe.DEFAULT_IMAGE

    def sandbox_options(self, task):
        return {**super().sandbox_options(task), "image": self._image(task)}

    def _prepare(self, task: Task, rollout_id: str) -> Path:
        """The rollout's directory: the workspace (the instance's repository at base_commit, or the generated
        task's files) and a home whose bin/ holds the ``python`` the tests run with."""
        root = new_rollout_dir(rollout_id)
        (root / "home" / "bin").mkdir()
        if task.meta.get("instance"):
            (root / "repo").rmdir()
            swe.checkout(self.sources.base(task.answer), root / "repo")
            python = "/usr/bin/python3"  # the graders' (examples/swe/instances.py TEST_PATH), with pytest
        else:
            write_workspace(task, root / "repo")
            python = PYTHON
        for name in ("python", "python3"):  # the tests' python first on PATH
            (root / "home" / "bin" / name).symlink_to(python)
        return root

    def command(self, task, endpoint):
        root = self._roots[endpoint.rollout_id]
        repo, home = root / "repo", root / "home"
        argv, env = self.agent(task, endpoint, repo, home)
        path = (
            swe.TEST_PATH if task.meta.get("instance") else os.environ.get("PATH", "/usr/bin:/bin")
        )
        env = {
            "HOME": str(home),
            "TMPDIR": str(home / "tmp"),
            "LL_WORKSPACE": str(root),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PATH": f"{home / 'bin'}{os.pathsep}{path}",
            **env,
        }
        return argv, env, str(root)  # the cwd, bound writable in the sandbox: repo/ and home/

    def reward(self, task, stdout, returncode, workdir):
        # A crashed agent (an API error, a bad config) fails the rollout: it is not trained on.
        if returncode != 0:
            return None
        repo = Path(workdir) / "repo"
        if not task.meta.get("instance"):
            return score(
                task,
                repo,
                self.score_timeout,
                box=self.sandbox,
                ro_binds=self.ro_binds,
                image=self._image(task),
            )
        patch = swe.agent_diff(self.sources.base(task.answer), repo)
        return swe.grade(
            task.answer,
            patch,
            self.sources,
            self.sandbox,
            image=self._image(task),
            limits=self.limits,
            name=f"ll-grade-{os.getpid()}-{uuid.uuid4().hex[:12]}",
            timeout=self.score_timeout,
        ).reward

    async def run(self, task, endpoint):
        try:  # cloning a repository takes a while: off the event loop
            self._roots[endpoint.rollout_id] = await asyncio.to_thread(
                self._prepare, task, endpoint.rollout_id
            )
            return await super().run(task, endpoint)
        finally:  # also on timeout and cancellation
            root = self._roots.pop(endpoint.rollout_id, None)
            if root:
                kill_leftovers(str(root))
                shutil.rmtree(root, ignore_errors=True)


if (
    __name__ == "__main__"
):  # python -m examples.swe.tasks: check every task (buggy 0, fixed 1) and show one
    tasks = make_tasks()
    bad = []
    for t in tasks["train"] + tasks["test"]:
        root = new_rollout_dir("check")
        write_workspace(t, root / "repo")
        r0 = score(t, root / "repo")
        write_solution(t, root / "repo")
        r1 = score(t, root / "repo")
        shutil.rmtree(root)
        if (r0, r1) != (0.0, 1.0):
            bad.append((t.id, r0, r1))
    print(
        f"{len(tasks['train'])} train / {len(tasks['test'])} test tasks; wrong rewards: {bad or 'none'}"
    )
    t = tasks["test"][0]
    print(
        t.prompt,
        "",
        *[f"--- {n}\n{s}" for n, s in {**t.answer["files"], **t.answer["tests"]}.items()],
        sep="\n",
    )
