"""The harness interface, the harness loader, and the rollout runner (README: "Harnesses"). The trainer never
looks inside a harness: it hands each rollout its own base URL and collects one reward per rollout.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib.util
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from tqdm import tqdm

from .records import UNANSWERED

# examples/ lives next to lightning_lite/
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Task:
    """One thing to ask the agent: ``Task("calc-d1-train-17", "What is 3 + 4?", answer=7)``."""

    # unique and stable
    id: str
    prompt: str
    # whatever the harness needs to score
    answer: Any = None
    meta: dict = field(default_factory=dict)


@dataclass
class Endpoint:
    """Where one rollout's agent talks to the model (built by ProxyServer.endpoint)."""

    # "http://127.0.0.1:PORT/rollout/<route>/v1", for OpenAI-style clients
    base_url: str
    api_key: str
    model: str
    rollout_id: str
    # "http://127.0.0.1:PORT"; Anthropic clients use server_url + "/rollout/<route>"
    server_url: str
    # "<rollout_id>.<token>" under train.py (the token makes the route this rollout's alone); the id otherwise
    route: str = ""
    # the X-Reward-Key header of a reward POST: the harness's, never the agent's
    reward_key: str = ""
    # the proxy's Unix socket for this rollout alone (sandboxes bridge 127.0.0.1:PORT to it)
    socket: Optional[str] = None

    @property
    def anthropic_base_url(self) -> str:
        return f"{self.server_url}/rollout/{self.route or self.rollout_id}"

    @property
    def reward_url(self) -> str:
        """Where a harness (not its agent) may POST {"reward": x}, with header X-Reward-Key."""
        return f"{self.server_url}/rollout/{self.rollout_id}/reward"


class Harness:
    """Write ``tasks(split)`` and ``async run(task, endpoint)``, which returns the reward (README "Harnesses"),
    e.g. ``float(await ask(endpoint.base_url, task.prompt) == task.answer)``; or None when it POSTed one to
    ``endpoint.reward_url``; or ``{"reward": R, "calls": {k: r_k}}`` to reward calls too (k: the call's index in
    the rollout, or its reply's id). ``timeout`` (seconds), when set, caps a rollout below the runner's limit."""

    name = "base"
    timeout: Optional[float] = None
    # The proxy-side audit (extras/audit.py; README "Sandboxes"): name -> regex over the model's replies and tool
    # calls, and over the tool results the harness sent back; a match flags the rollout (rollouts/step_K.jsonl).
    audit: dict[str, str] = {}
    audit_results: dict[str, str] = {}
    # True: a flagged rollout (audit, or a route the proxy refused it) gets reward 0
    zero_flagged = False

    # split: "train" or "test"
    def tasks(self, split: str) -> list[Task]:
        raise NotImplementedError(f"{type(self).__name__} must define tasks(split)")

    async def run(self, task: Task, endpoint: Endpoint) -> Optional[float]:
        raise NotImplementedError(f"{type(self).__name__} must define async run(task, endpoint)")


class SubprocessHarness(Harness):
    """A harness that is a program: write ``command(task, endpoint) -> (argv, env_extra, cwd)``, e.g. ``return
    ["python", "agent.py", task.prompt], {}, None``, and maybe ``reward``, run on the host once it exited. Of the
    trainer's environment it gets only ``BASE_ENV`` and ``pass_env``: no secret reaches an agent that may print
    it. It runs through ``sandbox``: any object with ``wrap(argv, env, cwd, **options) -> host argv`` and
    ``kill(name)`` (extras/sandbox.py); None: bwrap, chosen at its first rollout (train.py: ``--sandbox``)."""

    BASE_ENV = tuple("PATH HOME USER LOGNAME SHELL LANG LANGUAGE TERM TZ TMPDIR PYENV_ROOT".split())
    # more of the trainer's variables the program needs (e.g. "HF_HOME")
    pass_env: tuple[str, ...] = ()
    # where it runs (see above); None: bwrap, chosen at its first rollout
    sandbox = None
    # What the sandbox gets besides the command (see sandbox_options). Read-only: the interpreter and the repo the
    # program runs from (bwrap hides the trainer's HOME; docker sees only its image), the harness's own installs.
    ro_binds: tuple[str, ...] = tuple(dict.fromkeys((sys.base_prefix, sys.prefix, str(REPO_ROOT))))
    # more read-write dirs than the cwd
    binds: tuple[str, ...] = ()
    # bwrap: dirs it must not see though the system is visible (its answers, hidden tests)
    hide: tuple[str, ...] = ()
    # docker's image (a task's own: override sandbox_options) and its CPU, memory, PID limits (sandbox.Limits)
    image: Optional[str] = None
    limits = None

    def sandbox_options(self, task: Task) -> dict:
        """Per task: what ``sandbox.wrap`` gets besides the command (a SWE instance's own image, say)."""
        return {key: getattr(self, key) for key in ("binds", "ro_binds", "hide", "image", "limits")}

    def command(self, task: Task, endpoint: Endpoint) -> tuple[list[str], dict, Optional[str]]:
        raise NotImplementedError(f"{type(self).__name__} must define command(task, endpoint)")

    def reward(self, task: Task, stdout: str, returncode: int, workdir: str) -> Optional[float]:
        """Default: the last non-empty stdout line, as a float; None if it is not one."""
        try:
            return float(stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return None

    def environment(self, task: Task, endpoint: Endpoint, extra: Optional[dict]) -> dict:
        """The program's whole environment: the allowed part of ours, the endpoint, then ``extra``."""
        allowed = (*self.BASE_ENV, *self.pass_env)
        env = {k: v for k, v in os.environ.items() if k in allowed or k.startswith("LC_")}
        env.update(
            OPENAI_BASE_URL=endpoint.base_url,
            OPENAI_API_KEY=endpoint.api_key,
            OPENAI_MODEL=endpoint.model,
            ANTHROPIC_BASE_URL=endpoint.anthropic_base_url,
            ANTHROPIC_API_KEY=endpoint.api_key,
            LL_ROLLOUT_ID=endpoint.rollout_id,
            LL_TASK_ID=task.id,
        )
        return env | {key: str(value) for key, value in (extra or {}).items()}

    async def run(self, task: Task, endpoint: Endpoint) -> Optional[float]:
        argv, env_extra, cwd = self.command(task, endpoint)
        # the hook to extras/sandbox.py, where a harness (or train.py's --sandbox) chose none
        if self.sandbox is None:
            from .extras import sandbox

            self.sandbox = sandbox.make("auto")
        workdir = cwd or tempfile.mkdtemp(prefix=f"ll-{endpoint.rollout_id}-")
        # a container's name: unique on the machine
        name = f"ll-{endpoint.rollout_id}-{os.getpid()}"
        port = urllib.parse.urlsplit(endpoint.server_url).port
        options = dict(socket=endpoint.socket, port=port, name=name, **self.sandbox_options(task))
        env = self.environment(task, endpoint, env_extra)
        host_argv = self.sandbox.wrap(argv, env, workdir, **options)
        proc = None
        # Output goes to files, not pipes: a grandchild that escaped the process group and keeps a pipe open
        # would otherwise hold the rollout until its timeout.
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                # start_new_session: its own process group, so killpg reaches its children too
                proc = await asyncio.create_subprocess_exec(
                    *host_argv,
                    cwd=workdir,
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                    stdout=out,
                    stderr=err,
                    stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True,
                )
                await proc.wait()
                out.seek(0), err.seek(0)
                stdout, stderr = (f.read().decode(errors="replace") for f in (out, err))
                # scoring may run tests for a while: off the event loop, so other rollouts go on
                reward = await asyncio.to_thread(
                    self.reward, task, stdout, proc.returncode, workdir
                )
                if reward is None and proc.returncode != 0:
                    tail = " | ".join(stderr.strip().splitlines()[-3:]) or "(no stderr)"
                    what = f"{argv[0]} (sandbox {self.sandbox.name}) exited with code {proc.returncode}"
                    raise RuntimeError(f"{what}: {tail}")
                return reward
            finally:
                # Timeout and cancellation land here too: kill the whole group (the agent's shells, servers,
                # test runners), then reap the child (awaiting wait() is what prevents a zombie).
                if proc is not None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
                await asyncio.to_thread(self.sandbox.kill, name)
                if not cwd:
                    shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------- loading


def load_harness(spec: str, **kwargs) -> Harness:
    """The harness ``spec`` names, built with ``kwargs``: ``"calc"`` (examples/calc/harness.py), a module
    (``"my_pkg.harnesses"``) or a file (``"path/to/h.py"``), each with ``":Name"`` for a Harness subclass or a
    function that returns one; without it, the one Harness subclass the module defines."""
    target, _, attr = spec.partition(":")
    is_file = target.endswith(".py") or "/" in target
    path = Path(target) if is_file else REPO_ROOT / "examples" / target / "harness.py"
    # a file, or an example: imported under a name of ours; else a module on sys.path
    module_name = f"ll_harness_{path.stem}" if is_file else f"ll_examples_{target}"
    if is_file or path.exists():
        module = _import_file(path, module_name)
    else:
        module = _import_module(spec, target)
    classes = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Harness)]
    found = [c for c in classes if c.__module__ == module.__name__]
    if attr and not hasattr(module, attr):
        raise ValueError(f"harness module {module.__name__!r} has no attribute {attr!r}")
    if not attr and len(found) != 1:
        raise ValueError(
            f"harness module {module.__name__!r} defines {len(found)} Harness subclasses "
            f"({', '.join(c.__name__ for c in found) or 'none'}); say which one: '{spec}:ClassName'"
        )
    try:
        harness = (getattr(module, attr) if attr else found[0])(**kwargs)
    except TypeError as e:
        raise ValueError(f"could not build harness {spec!r} with {kwargs}: {e}") from e
    if not isinstance(harness, Harness):
        raise ValueError(f"{spec!r} gave a {type(harness).__name__}, not a Harness instance")
    # a harness that did not name itself is named after its spec
    if harness.name == "base":
        harness.name = path.stem if is_file else target.split(".")[-1]
    return harness


def _import_module(spec: str, target: str):
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        # the harness module exists but one of its own imports is missing
        if e.name != target and not target.startswith(f"{e.name}."):
            raise
    examples = sorted(p.parent.name for p in (REPO_ROOT / "examples").glob("*/harness.py"))
    raise ValueError(
        f"no harness {spec!r}: not examples/{target}/harness.py (known: {', '.join(examples) or 'none'}) "
        "and not an importable module"
    )


def _import_file(path: Path, module_name: str):
    path = path.resolve()
    if not path.exists():
        raise ValueError(f"harness file {path} does not exist")
    module = sys.modules.get(module_name)
    # loaded once: its classes stay the same objects
    if module is None or getattr(module, "__file__", None) != str(path):
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        # dataclasses and pickle look modules up by name
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return module


def parse_kwargs(items: list[str]) -> dict:
    """Harness arguments: ``["difficulty=2", "name=x"]`` -> ``{"difficulty": 2, "name": "x"}`` (Python literals)."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise ValueError(f"harness argument {item!r} is not KEY=VALUE")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


# ---------------------------------------------------------------------------- running


@dataclass
class RolloutResult:
    rollout_id: str
    task_id: str
    # None when it failed
    reward: Optional[float]
    # "timeout after 60s", "RuntimeError: ...", "no reward"; None when it worked
    error: Optional[str]
    seconds: float
    # what it tried that it may not: {kind, what, call, where, match} (README "Sandboxes")
    flags: list = field(default_factory=list)
    # the name of the harness that ran it
    harness: str = ""
    # call (its index, or its reply's id until train.py resolves it) -> reward
    call_rewards: dict = field(default_factory=dict)


def fail_rollouts_the_backend_failed(results: list[RolloutResult], calls) -> None:
    """A rollout one of whose calls the backend failed (``finish_reason == "error"``) is failed, even if the
    harness carried on and got a reward: part of its conversation was never sampled by the policy."""
    broken = {c.rollout_id for c in calls if c.finish_reason == "error"}
    error = "the backend failed one of its calls (finish_reason 'error' in the calls file)"
    for result in results:
        if result.rollout_id in broken and result.error is None:
            result.reward, result.error = None, error


def _finite(x) -> bool:
    # a bool counts: True is a reward of 1
    return isinstance(x, (int, float)) and math.isfinite(x)


def parse_reward(returned) -> tuple[Optional[float], dict]:
    """What ``run()`` returned -> (reward, call rewards): ``0.5`` -> ``(0.5, {})``, ``None`` -> ``(None, {})``,
    ``{"reward": 1, "calls": {0: 0.2, "chatcmpl-7": 1}}`` -> ``(1, {0: 0.2, "chatcmpl-7": 1.0})``."""
    if not isinstance(returned, dict):
        return returned, {}
    calls = returned.get("calls", {})
    calls_ok = isinstance(calls, dict) and all(
        isinstance(k, (int, str)) and not isinstance(k, bool) and _finite(r)
        for k, r in calls.items()
    )
    if set(returned) - {"reward", "calls"} or not calls_ok:
        raise ValueError(
            f"run() returned {str(returned)[:200]}: want {{'reward': R, 'calls': {{k: r}}}}, k a call's index "
            "in its rollout (int) or its reply's id (str), r a finite number"
        )
    return returned.get("reward"), {k: float(r) for k, r in calls.items()}


async def run_rollouts(
    jobs: list[tuple[str, Task, Harness]],
    endpoint_for: Callable[[str], Endpoint],
    max_concurrency: int = 8,
    timeout: float = 300.0,
    posted_reward: Callable[[str], Optional[float]] = lambda rollout_id: None,
    desc: str = "rollouts",
    progress: bool = True,
) -> list[RolloutResult]:
    """Run ``jobs`` (rollout id, task, harness) concurrently; one result per job, in order, e.g.
    ``[RolloutResult("r0", "t0", 1.0, None, 2.1, harness="calc")]``. A rollout that raises, runs past ``timeout``
    or ends without a reward (returned, or ``posted_reward``) fails: ``reward=None``, an ``error``."""
    semaphore = asyncio.Semaphore(max_concurrency)
    rewards, failed = [], []

    async def run_one(rollout_id: str, task: Task, harness: Harness) -> RolloutResult:
        result = RolloutResult(rollout_id, task.id, None, None, 0.0, harness=harness.name)
        async with semaphore:
            start = time.monotonic()
            result.reward, result.error, result.call_rewards = await _reward_or_error(
                harness, task, rollout_id, endpoint_for, timeout, posted_reward
            )
            result.seconds = time.monotonic() - start
        if result.error is None:
            rewards.append(result.reward)
        else:
            failed.append(rollout_id)
            # the end of a traceback says what happened
            message = " ".join(result.error.split())
            message = message if len(message) <= 400 else "..." + message[-400:]
            where = f"[{desc}] rollout {rollout_id} (task {task.id})"
            tqdm.write(f"{where} failed: {message}", file=sys.stderr)
        bar.update(1)
        mean_reward = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
        bar.set_postfix(failed=len(failed), reward=mean_reward)
        return result

    # the bar counts rollouts done, its postfix the failed ones and the mean reward so far; quiet in logs
    quiet = not (progress and sys.stderr.isatty())
    with tqdm(
        total=len(jobs), desc=desc, disable=quiet, file=sys.stderr, dynamic_ncols=True
    ) as bar:
        return list(await asyncio.gather(*(run_one(*job) for job in jobs)))


async def _reward_or_error(harness, task, rollout_id, endpoint_for, timeout, posted_reward):
    """One rollout: (reward, None, call rewards), or (None, error, {}) when it failed."""
    # the tighter of the runner's limit and the harness's own; None: no limit
    limit = min((t for t in (timeout, harness.timeout) if t), default=None)
    try:
        # asyncio.timeout (not wait_for) tells our deadline apart from a TimeoutError raised inside the harness
        async with asyncio.timeout(limit) as deadline:
            reward, call_rewards = parse_reward(await harness.run(task, endpoint_for(rollout_id)))
    except TimeoutError as e:
        return None, f"timeout after {limit:g}s" if deadline.expired() else f"TimeoutError: {e}", {}
    # a crashed harness fails its rollout, not the step
    except (Exception, SystemExit) as e:
        return None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__, {}
    reward = posted_reward(rollout_id) if reward is None else reward
    if reward is None:
        return None, "no reward (run() returned None and nothing was POSTed)", {}
    if not _finite(reward):
        return None, f"bad reward {reward!r} (want a finite float)", {}
    return float(reward), None, call_rewards


def resolve_call_rewards(results: list[RolloutResult], calls_of: dict, posted) -> None:
    """Each rollout's call rewards (``posted(rollout_id)``: POSTed to the proxy, then those ``run()``
    returned) keyed by call index: a call is named by its index or by its reply's id (a reply of
    one choice). A reward for a call the rollout does not have fails the rollout."""
    for r in results:
        mine = [c for c in calls_of.get(r.rollout_id, []) if c.finish_reason not in UNANSWERED]
        ids = Counter(c.reply_id for c in mine)
        index_of = {c.index: c.index for c in mine}
        index_of |= {c.reply_id: c.index for c in mine if ids[c.reply_id] == 1}
        rewards = {**posted(r.rollout_id), **r.call_rewards}
        if r.reward is not None and (bad := [k for k in rewards if k not in index_of]):
            r.reward = None
            r.error = (
                f"rewards for calls it does not have: {bad[:3]} (name a call by its index in the "
                "rollout or its reply's id)"
            )
        r.call_rewards = (
            {index_of[k]: v for k, v in rewards.items()} if r.reward is not None else {}
        )
