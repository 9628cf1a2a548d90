"""The harness interface, the loader and the rollout runner (no model: a scripted stub server)."""

import asyncio
import contextlib
import json
import os
import sys
import textwrap
import time

import pytest

from lightning_lite.extras.programs import SubprocessHarness
from lightning_lite.extras.sandbox import Sandbox
from lightning_lite.harness import (
    Endpoint,
    Harness,
    Task,
    RolloutResult,
    Tasks,
    load_harness,
    parse_kwargs,
    run_rollouts,
    settle_rollouts,
)
from openai_stub import StubServer


def fake_endpoint(rollout_id: str) -> Endpoint:
    return Endpoint(
        f"http://127.0.0.1:9/rollout/{rollout_id}/v1", "sk-x", "m", rollout_id, "http://127.0.0.1:9"
    )


class Scripted(Harness):
    """Each task's prompt says how its rollout behaves."""

    name = "scripted"

    def tasks(self, split):
        return [
            Task(f"t-{p}", p)
            for p in ("ok", "raise", "hang", "none", "posted", "nan", "inner-timeout")
        ]

    async def run(self, task, endpoint):
        if task.prompt == "raise":
            raise RuntimeError("boom")
        if task.prompt == "hang":
            await asyncio.sleep(60)
        if task.prompt == "inner-timeout":
            raise TimeoutError("the agent's own HTTP call timed out")
        return {"ok": 1.0, "nan": float("nan")}.get(task.prompt)


def test_failing_rollouts_are_reported_and_the_step_goes_on(capsys):
    harness = Scripted()
    jobs = [(f"r{i}", t, harness) for i, t in enumerate(harness.tasks("train"))]
    t0 = time.monotonic()
    results = asyncio.run(
        run_rollouts(
            jobs,
            fake_endpoint,
            timeout=0.5,
            posted_reward=lambda rid: 0.25 if rid == "r4" else None,
        )
    )
    assert time.monotonic() - t0 < 3  # the hanging rollout was cut at 0.5 s
    by_task = {r.task_id: r for r in results}
    assert [r.rollout_id for r in results] == [
        rid for rid, *_ in jobs
    ]  # one result per job, in order
    assert (by_task["t-ok"].reward, by_task["t-ok"].error) == (1.0, None)
    assert (by_task["t-posted"].reward, by_task["t-posted"].error) == (0.25, None)
    assert by_task["t-raise"].reward is None and by_task["t-raise"].error == "RuntimeError: boom"
    assert by_task["t-hang"].reward is None and by_task["t-hang"].error == "timeout after 0.5s"
    assert 0.4 < by_task["t-hang"].seconds < 2
    assert by_task["t-none"].reward is None and by_task["t-none"].error.startswith("no reward")
    assert by_task["t-nan"].reward is None and "bad reward" in by_task["t-nan"].error
    assert by_task["t-inner-timeout"].error.startswith(
        "TimeoutError: the agent's own"
    )  # not "timeout after"
    err = capsys.readouterr().err
    for rid in ("r1", "r2", "r3", "r5", "r6"):
        assert err.count(f"rollout {rid} ") == 1, err  # each failure reported exactly once
    assert "rollout r0 " not in err and "rollout r4 " not in err
    assert "boom" in err and "it/s" not in err  # not a terminal: no progress bar, only the failures


def test_concurrency_is_bounded():
    class Slow(Harness):
        running = peak = 0

        async def run(self, task, endpoint):
            Slow.running += 1
            Slow.peak = max(Slow.peak, Slow.running)
            await asyncio.sleep(0.02)
            Slow.running -= 1
            return 0.5

    jobs = [(f"r{i}", Task(f"t{i}", ""), Slow()) for i in range(9)]
    results = asyncio.run(run_rollouts(jobs, fake_endpoint, max_concurrency=3, progress=False))
    assert Slow.peak == 3 and all(r.reward == 0.5 for r in results)


# ---------------------------------------------------------------------------- subprocess harnesses

# A whole "agent" in a few lines of stdlib: call the chat API at OPENAI_BASE_URL, print the reward.
AGENT = """
import json, os, urllib.request
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": os.environ["OPENAI_MODEL"],
                     "messages": [{"role": "user", "content": os.environ["PROMPT"]}]}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
text = json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"]
print("agent said", text)
print(1.0 if text == "4" else 0.0)
"""


class Script(SubprocessHarness):
    sandbox = (
        Sandbox()
    )  # on the host: these tests are about the runner (tests/test_sandbox.py: the sandboxes)

    def __init__(self, code, cwd=None):
        self.code, self.cwd = code, cwd

    def command(self, task, endpoint):
        return [sys.executable, "-c", self.code], {"PROMPT": task.prompt}, self.cwd


def test_subprocess_harness_gets_its_own_base_url_and_key():
    async def main():
        async with StubServer(lambda rid, body, n: {"content": "4"}) as stub:
            script = Script(AGENT)
            jobs = [("roll-a", Task("t0", "2+2?"), script), ("roll-b", Task("t1", "2+2?"), script)]
            endpoint_for = lambda rid: stub.endpoint(rid, api_key=f"key-{rid}")
            return stub, await run_rollouts(jobs, endpoint_for, timeout=20, progress=False)

    stub, results = asyncio.run(main())
    assert [(r.rollout_id, r.reward, r.error) for r in results] == [
        ("roll-a", 1.0, None),
        ("roll-b", 1.0, None),
    ]
    seen = sorted((rid, auth, body["model"]) for rid, auth, body in stub.requests)
    assert seen == [
        ("roll-a", "Bearer key-roll-a", "stub-model"),
        ("roll-b", "Bearer key-roll-b", "stub-model"),
    ]


ENV_PRINTER = """
import json, os
print(json.dumps(dict(os.environ)))
"""


def test_subprocess_harness_gets_a_scrubbed_environment(monkeypatch):
    """The trainer's secrets stay out of the agent's environment; what the harness declares gets in."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("MY_TOOL_HOME", "/opt/tool")

    class Printer(Script):
        pass_env = ("MY_TOOL_HOME",)

        def reward(self, task, stdout, returncode, workdir):
            self.env, self.workdir = json.loads(stdout), workdir
            return 1.0

    h = Printer(ENV_PRINTER)
    endpoint = Endpoint("http://127.0.0.1:9/rollout/r/v1", "k", "m", "r", "http://127.0.0.1:9")
    assert (
        asyncio.run(
            run_rollouts([("r", Task("t", "hi"), h)], lambda rid: endpoint, progress=False)
        )[0].reward
        == 1.0
    )
    assert (
        "HF_TOKEN" not in h.env
        and h.env["MY_TOOL_HOME"] == "/opt/tool"
        and h.env["PATH"] == os.environ["PATH"]
    )
    assert (
        h.env["OPENAI_BASE_URL"] == endpoint.base_url
        and h.env["PROMPT"] == "hi"
        and h.env["LL_ROLLOUT_ID"] == "r"
    )
    assert (
        not set(h.env)
        - set(SubprocessHarness.BASE_ENV)
        - {"MY_TOOL_HOME", "PROMPT"}
        - {k for k in h.env if k.startswith(("LC_", "OPENAI_", "ANTHROPIC_", "LL_"))}
    )
    assert os.path.basename(h.workdir).startswith("ll-r-") and not os.path.exists(
        h.workdir
    )  # its own directory, removed


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just unreaped
    except FileNotFoundError:
        return False


def test_subprocess_timeout_kills_the_whole_process_group(tmp_path):
    # The agent starts a grandchild (as agents start shells and servers), then hangs.
    code = textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open("pids", "w").write("%d %d" % (__import__("os").getpid(), child.pid))
        time.sleep(60)
    """)
    results = asyncio.run(
        run_rollouts(
            [("r0", Task("t", ""), Script(code, cwd=str(tmp_path)))],
            fake_endpoint,
            timeout=1.5,
            progress=False,
        )
    )
    assert results[0].error == "timeout after 1.5s"
    assert results[0].seconds < 5  # killing only the child would wait on the grandchild's pipes
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 2  # SIGKILL is asynchronous; give the kernel a moment
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(map(_alive, pids))
    children = []
    for thread in os.listdir("/proc/self/task"):
        # a thread of an earlier test may end between the listing and the read
        with contextlib.suppress(FileNotFoundError):
            children += open(f"/proc/self/task/{thread}/children").read().split()
    assert str(pids[0]) not in children  # our direct child was reaped: no zombie


def test_a_grandchild_that_escapes_the_group_does_not_hold_the_rollout(tmp_path):
    """An agent whose helper left the process group (setsid) and kept stdout open: the rollout ends when the
    agent does (its output goes to files, not pipes that the grandchild would hold open)."""
    code = textwrap.dedent("""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        open("pid", "w").write(str(child.pid))
        print(0.5)
    """)
    t0 = time.monotonic()
    result = asyncio.run(
        run_rollouts(
            [("r0", Task("t", ""), Script(code, cwd=str(tmp_path)))],
            fake_endpoint,
            timeout=30,
            progress=False,
        )
    )[0]
    os.kill(int((tmp_path / "pid").read_text()), 9)
    assert (result.reward, result.error) == (0.5, None) and time.monotonic() - t0 < 10


def test_subprocess_crash_reports_exit_code_and_stderr():
    code = "import sys; sys.stderr.write('Traceback...\\nValueError: bad task\\n'); sys.exit(3)"
    result = asyncio.run(
        run_rollouts([("r0", Task("t", ""), Script(code))], fake_endpoint, progress=False)
    )[0]
    assert result.reward is None
    assert "exited with code 3" in result.error and "ValueError: bad task" in result.error


def test_subprocess_default_workdir_is_fresh_and_removed():
    code = "import os; print(os.getcwd()); print(0.5)"

    class Keep(Script):
        def reward(self, task, stdout, returncode, workdir):
            self.seen = (stdout.split()[0], workdir, os.path.isdir(workdir))
            return super().reward(task, stdout, returncode, workdir)

    harness = Keep(code)
    assert (
        asyncio.run(run_rollouts([("r0", Task("t", ""), harness)], fake_endpoint, progress=False))[
            0
        ].reward
        == 0.5
    )
    cwd, workdir, existed = harness.seen
    assert (
        os.path.realpath(cwd) == os.path.realpath(workdir)
        and existed
        and not os.path.exists(workdir)
    )


# ---------------------------------------------------------------------------- loading


def test_load_harness_by_example_name_module_and_path(tmp_path, monkeypatch):
    calc = load_harness("calc", difficulty=2, n_train=5)
    assert calc.name == "calc" and calc.difficulty == 2 and len(calc.tasks("train")) == 5

    (tmp_path / "my_harnesses.py").write_text(
        textwrap.dedent("""
        from lightning_lite.harness import Harness
        class Helper:  # not a harness: ignored
            pass
        class Mine(Harness):
            def __init__(self, k=1):
                self.k = k
        def make(k=2):
            return Mine(k)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_harness("my_harnesses").k == 1  # the single Harness subclass
    assert load_harness("my_harnesses:Mine", k=5).k == 5
    assert load_harness("my_harnesses:make").k == 2  # a factory works too
    assert (
        load_harness("my_harnesses").name == "my_harnesses"
    )  # unnamed harnesses take the spec's name
    assert load_harness(str(tmp_path / "my_harnesses.py"), k=3).k == 3


def test_load_harness_errors_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"no harness 'nope'.*known: .*calc"):
        load_harness("nope")
    with pytest.raises(ValueError, match="could not build harness 'calc'.*colour"):
        load_harness("calc", colour="red")
    (tmp_path / "two_harnesses.py").write_text(
        "from lightning_lite.harness import Harness\nclass A(Harness): pass\nclass B(Harness): pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ValueError, match=r"2 Harness subclasses \(A, B\).*'two_harnesses:ClassName'"
    ):
        load_harness("two_harnesses")
    with pytest.raises(ValueError, match="has no attribute 'C'"):
        load_harness("two_harnesses:C")


def test_parse_kwargs():
    assert parse_kwargs(["difficulty=2", "name=x", "rate=0.5", "flag=True"]) == {
        "difficulty": 2,
        "name": "x",
        "rate": 0.5,
        "flag": True,
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_kwargs(["difficulty"])


def test_one_harness_draws_its_step_tasks_and_more_needs_the_extra():
    """harness.Tasks: step k's groups are batch_size tasks of a fixed shuffle per epoch, each run
    group_size times under one group id; the same seed and step draw the same tasks. Several
    harnesses, a WEIGHT or a SPEC:K=V are refused, naming extras/harnesses.py."""
    tasks = Tasks(["calc"], ["difficulty=2"], 4, 2, 3, 7, lambda *line: None)
    assert tasks.names() == ["calc"] and tasks.harnesses[0].difficulty == 2
    groups = tasks.pick(5)
    drawn = tasks.draw(tasks.train["calc"], 5, 4)
    assert [[(h.name, t.id, g) for h, t, g in group] for group in groups] == [
        [("calc", t.id, f"calc/{t.id}")] * 2 for t in drawn
    ]
    assert tasks.pick(5) == groups and tasks.pick(6) != groups
    # the evaluation: each test task once over the ranks, its seed the same at every step
    jobs, seeds = tasks.eval_jobs(4, 0, 1)
    assert [(rid, t.id) for rid, t, _ in jobs] == [
        (f"eval4-r0-{i}", t.id) for i, t in enumerate(tasks.test["calc"])
    ]
    assert len(set(seeds.values())) == 3 and sorted(seeds) == sorted(rid for rid, _, _ in jobs)
    assert list(tasks.eval_jobs(9, 0, 1)[1].values()) == list(seeds.values())
    rank1, _ = tasks.eval_jobs(4, 1, 2)
    assert [t.id for _, t, _ in rank1] == [t.id for t in tasks.test["calc"][1::2]]
    other_seed = Tasks(["calc"], ["difficulty=2"], 4, 2, 3, 8, lambda *line: None)
    assert set(other_seed.eval_jobs(4, 0, 1)[1].values()).isdisjoint(seeds.values())
    assert tasks.by_harness({}, "reward", "loss") == "" and tasks.harness_columns([], []) == {}
    for specs, items in ((["calc", "search"], []), (["calc:2"], []), (["calc"], ["calc:k=1"])):
        with pytest.raises(SystemExit, match="needs lightning_lite/extras/harnesses.py"):
            Tasks(specs, items, 4, 2, 3, 7, print)


def test_a_ranks_jobs_are_its_share_of_the_groups_under_ids_unique_in_the_run():
    """Tasks.jobs: rank r of w takes groups r, r + w, ...; each rollout's id names its step, rank,
    group and place in the group, and maps to the group's id."""
    tasks = Tasks(["calc"], [], 4, 2, 0, 7, lambda *line: None)
    groups = tasks.pick(3)
    jobs, group_of = tasks.jobs(3, 1, 2)
    assert [rid for rid, _, _ in jobs] == [
        "s3-r1-t0-g0",
        "s3-r1-t0-g1",
        "s3-r1-t1-g0",
        "s3-r1-t1-g1",
    ]
    assert [task.id for _, task, _ in jobs] == [groups[k][0][1].id for k in (1, 1, 3, 3)]
    assert group_of == {rid: groups[1 + 2 * int(rid[7])][0][2] for rid, _, _ in jobs}


def test_settled_rollouts_carry_call_rewards_by_index_flags_and_the_backends_failures(
    monkeypatch,
):
    """settle_rollouts: call rewards named by reply id end keyed by index, the proxy's refusals and
    hooks.ROLLOUT_FILTERS's findings are the flags, and a rollout one of whose calls the backend
    failed is failed, reward and all."""
    from lightning_lite import hooks
    from lightning_lite.records import Call

    def call(rid, index, reply_id, finish="stop"):
        return Call(
            rollout_id=rid,
            index=index,
            api="chat",
            model_version=0,
            prompt_ids=[1],
            response_ids=[2],
            response_logprobs=[-0.1],
            finish_reason=finish,
            reply_id=reply_id,
        )

    results = [RolloutResult("a", "t", 1.0, None, 0.1), RolloutResult("b", "t", 0.5, None, 0.1)]
    calls = [call("a", 0, "r0"), call("a", 1, "r1"), call("b", 0, "q0", finish="error")]

    class Proxy:
        def call_rewards(self, rid):
            return {"r1": 0.25} if rid == "a" else {}

        def flags(self, rid):
            return [{"kind": "route"}] if rid == "b" else []

    seen = []
    # this test's filter alone (the audit's, which conftest's import registers, needs its set-up)
    monkeypatch.setattr(
        hooks, "ROLLOUT_FILTERS", [lambda rs, calls_of, decode: seen.append(sorted(calls_of))]
    )
    settle_rollouts(results, calls, Proxy(), decode=str)
    assert results[0].call_rewards == {1: 0.25} and results[0].reward == 1.0
    assert results[1].flags == [{"kind": "route"}] and seen == [["a", "b"]]
    assert results[1].reward is None and "backend failed" in results[1].error


def test_subprocess_harness_moved_and_the_error_says_where():
    with pytest.raises(ImportError, match="from lightning_lite.extras.programs import"):
        from lightning_lite.harness import SubprocessHarness  # noqa: F401
