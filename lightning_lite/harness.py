"""The harness interface, the harness loader, and the rollout runner (README: "Harnesses"). The trainer never
looks inside a harness: it hands each rollout its own base URL and collects one reward per rollout.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib
import importlib.util
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from tqdm import tqdm

from . import sandbox as sandboxes

REPO_ROOT = Path(__file__).resolve().parent.parent  # examples/ lives next to lightning_lite/


@dataclass
class Task:
    id: str  # unique and stable, e.g. "calc-d1-train-17"
    prompt: str  # what the agent is asked
    answer: Any = None  # whatever the harness needs to score
    meta: dict = field(default_factory=dict)


@dataclass
class Endpoint:
    base_url: str  # "http://127.0.0.1:PORT/rollout/<route>/v1" (OpenAI-style clients)
    api_key: str
    model: str
    rollout_id: str
    server_url: (
        str  # "http://127.0.0.1:PORT"; Anthropic clients use server_url + "/rollout/<route>"
    )
    route: str = ""  # "<rollout_id>.<token>" under train.py (the token makes the route this rollout's alone); the id otherwise
    reward_key: str = (
        ""  # for the X-Reward-Key header of a reward POST: the harness's, never the agent's
    )
    socket: Optional[str] = (
        None  # the proxy's Unix socket for this rollout alone (sandboxes bridge 127.0.0.1:PORT to it)
    )

    @property
    def anthropic_base_url(self) -> str:
        return f"{self.server_url}/rollout/{self.route or self.rollout_id}"

    @property
    def reward_url(self) -> str:
        """Where a harness (not its agent) may POST {"reward": x}, with header X-Reward-Key, instead of returning it."""
        return f"{self.server_url}/rollout/{self.rollout_id}/reward"


class Harness:
    """Base class of every harness: write ``tasks`` and ``run``, which returns the reward, or None when it POSTed
    one to ``endpoint.reward_url`` (header ``X-Reward-Key: endpoint.reward_key``), or ``{"reward": R, "calls": {k:
    r_k}}`` to reward calls too (k: the call's index in the rollout, or the id the API gave its reply; README
    "Training signals beyond one reward per rollout"). ``timeout`` (seconds), when set, caps one rollout below the runner's limit."""

    name = "base"
    timeout: Optional[float] = None
    # The proxy-side audit (audit.py; README "Sandboxes"): name -> regex over the model's replies and tool calls, and
    # over the tool results the harness sent back; a match flags the rollout (rollouts/step_K.jsonl, the report).
    audit: dict[str, str] = {}
    audit_results: dict[str, str] = {}
    zero_flagged = (
        False  # True: a flagged rollout (audit, or a route the proxy refused it) gets reward 0
    )

    def tasks(self, split: str) -> list[Task]:  # split in {"train", "test"}
        raise NotImplementedError(f"{type(self).__name__} must define tasks(split)")

    async def run(self, task: Task, endpoint: Endpoint) -> Optional[float]:
        raise NotImplementedError(f"{type(self).__name__} must define async run(task, endpoint)")


class SubprocessHarness(Harness):
    """A harness that is a program (README: "Harnesses"): write ``command(task, endpoint) -> (argv, env_extra,
    cwd)``, e.g. ``return ["python", "agent.py", task.prompt], {}, None``, and maybe ``reward``. Of the
    trainer's environment it gets only ``BASE_ENV`` and ``pass_env``: no secret reaches an agent that may print it.
    It runs in ``sandbox`` (README "Sandboxes"; train.py's ``--sandbox``, default bwrap), which sees the trainer's
    HOME only where ``ro_binds`` says; ``reward`` runs on the host after the program has exited."""

    BASE_ENV = (
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TERM",
        "TZ",
        "TMPDIR",
        "PYENV_ROOT",
    )
    pass_env: tuple[
        str, ...
    ] = ()  # more of the trainer's variables the program needs (e.g. "HF_HOME")
    sandbox: Optional[sandboxes.Sandbox] = None  # None: sandboxes.make("auto") at the first rollout
    # Read-only in the sandbox (bwrap hides the trainer's HOME; docker sees only its image): the interpreter and the
    # repo the program runs from, and the harness's own installs.
    ro_binds: tuple[str, ...] = tuple(dict.fromkeys((sys.base_prefix, sys.prefix, str(REPO_ROOT))))
    binds: tuple[str, ...] = ()  # more read-write dirs than the cwd
    hide: tuple[
        str, ...
    ] = ()  # bwrap: dirs it must not see though the system is visible (its answers, hidden tests)
    image: Optional[str] = None  # docker's image (a task's own: override sandbox_options)
    limits: Optional[sandboxes.Limits] = None  # docker's CPU, memory, PID limits

    def sandbox_options(self, task: Task) -> dict:
        """Per task: what ``Sandbox.wrap`` gets besides the command (a SWE instance's own image, say)."""
        return dict(
            binds=self.binds,
            ro_binds=self.ro_binds,
            hide=self.hide,
            image=self.image,
            limits=self.limits,
        )

    def command(self, task: Task, endpoint: Endpoint) -> tuple[list[str], dict, Optional[str]]:
        raise NotImplementedError(f"{type(self).__name__} must define command(task, endpoint)")

    def reward(self, task: Task, stdout: str, returncode: int, workdir: str) -> Optional[float]:
        """Default: the last non-empty stdout line, as a float; None if it is not one."""
        try:
            return float(stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return None

    async def run(self, task: Task, endpoint: Endpoint) -> Optional[float]:
        argv, env_extra, cwd = self.command(task, endpoint)
        env = {
            k: v
            for k, v in os.environ.items()
            if k in self.BASE_ENV or k.startswith("LC_") or k in self.pass_env
        }
        env.update(
            OPENAI_BASE_URL=endpoint.base_url,
            OPENAI_API_KEY=endpoint.api_key,
            OPENAI_MODEL=endpoint.model,
            ANTHROPIC_BASE_URL=endpoint.anthropic_base_url,
            ANTHROPIC_API_KEY=endpoint.api_key,
            LL_ROLLOUT_ID=endpoint.rollout_id,
            LL_TASK_ID=task.id,
        )
        env.update({k: str(v) for k, v in (env_extra or {}).items()})
        workdir, proc = cwd or tempfile.mkdtemp(prefix=f"ll-{endpoint.rollout_id}-"), None
        box = self.sandbox = self.sandbox or sandboxes.make("auto")
        name = (
            f"ll-{endpoint.rollout_id}-{os.getpid()}"  # a container's name: unique on the machine
        )
        host = box.wrap(
            argv,
            env,
            workdir,
            socket=endpoint.socket,
            port=urllib.parse.urlsplit(endpoint.server_url).port,
            name=name,
            **self.sandbox_options(task),
        )
        # Output goes to files, not pipes: a grandchild that escaped the process group and keeps
        # a pipe open would otherwise hold communicate() until the rollout's timeout.
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                # start_new_session: its own process group, so killpg reaches its children too
                proc = await asyncio.create_subprocess_exec(
                    *host,
                    cwd=workdir,
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                    stdout=out,
                    stderr=err,
                    stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True,
                )
                await proc.wait()
                out.seek(0), err.seek(0)
                stdout, stderr = (
                    out.read().decode(errors="replace"),
                    err.read().decode(errors="replace"),
                )
                # scoring may run tests for a while: off the event loop, so other rollouts go on
                reward = await asyncio.to_thread(
                    self.reward, task, stdout, proc.returncode, workdir
                )
                if reward is None and proc.returncode != 0:
                    tail = " | ".join(stderr.strip().splitlines()[-3:])
                    raise RuntimeError(
                        f"{argv[0]} (sandbox {box.name}) exited with code {proc.returncode}: {tail or '(no stderr)'}"
                    )
                return reward
            finally:
                # Timeout and cancellation land here too: kill the whole group (the
                # agent's shells, servers, test runners), then reap the child:
                # awaiting wait() is what prevents a zombie.
                if proc is not None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()  # at once when it has exited
                await asyncio.to_thread(box.kill, name)
                if not cwd:  # the temporary directory it ran in
                    shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------- loading


def load_harness(spec: str, **kwargs) -> Harness:
    """The harness ``spec`` names (README "Harnesses"), built with ``kwargs``: ``":Name"`` names a Harness subclass
    or a function that returns one; without it, the one Harness subclass the module defines."""
    target, _, attr = spec.partition(":")
    is_file = target.endswith(".py") or "/" in target
    path = Path(target) if is_file else REPO_ROOT / "examples" / target / "harness.py"
    if is_file or path.exists():
        module = _import_file(
            path, f"ll_harness_{path.stem}" if is_file else f"ll_examples_{target}"
        )
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name != target and not target.startswith(f"{e.name}."):
                raise  # the harness module exists but one of its own imports is missing
            known = (
                ", ".join(
                    sorted(p.parent.name for p in (REPO_ROOT / "examples").glob("*/harness.py"))
                )
                or "none"
            )
            raise ValueError(
                f"no harness {spec!r}: not examples/{target}/harness.py (known: {known}) and not an importable module"
            ) from None
    found = [
        v
        for v in vars(module).values()
        if isinstance(v, type) and issubclass(v, Harness) and v.__module__ == module.__name__
    ]
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
    if harness.name == "base":  # a harness that did not name itself is named after its spec
        harness.name = path.stem if is_file else target.split(".")[-1]
    return harness


def _import_file(path: Path, module_name: str):
    path = path.resolve()
    if not path.exists():
        raise ValueError(f"harness file {path} does not exist")
    module = sys.modules.get(module_name)
    if module is None or getattr(module, "__file__", None) != str(
        path
    ):  # load once: its classes stay the same objects
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # dataclasses and pickle look modules up by name
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
    reward: Optional[float]  # None when failed
    error: Optional[
        str
    ]  # "timeout after 60s", "RuntimeError: ...", "no reward"; None when it worked
    seconds: float
    flags: list = field(
        default_factory=list
    )  # what it tried that it may not: {kind, what, call, where, match} (README "Sandboxes")
    harness: str = ""  # the name of the harness that ran it (train.py: several --harness)
    call_rewards: dict = field(
        default_factory=dict
    )  # call (index, or reply id until train.py resolves it) -> reward


def fail_rollouts_the_backend_failed(results: list[RolloutResult], calls) -> None:
    """A rollout one of whose calls the backend failed (``finish_reason == "error"``) is failed, even if the
    harness carried on and got a reward: part of its conversation was never sampled by the policy."""
    broken = {c.rollout_id for c in calls if c.finish_reason == "error"}
    for r in results:
        if r.rollout_id in broken and r.error is None:
            r.reward, r.error = (
                None,
                "the backend failed one of its calls (finish_reason 'error' in the calls file)",
            )


def _finite(x) -> bool:  # a bool counts: True is a reward of 1
    return isinstance(x, (int, float)) and math.isfinite(x)


def parse_reward(got) -> tuple[Optional[float], dict]:
    """What ``run()`` returned -> (reward, call rewards): a number, None, or ``{"reward": R, "calls": {k: r_k}}``."""
    if not isinstance(got, dict):
        return got, {}
    calls = got.get("calls", {})
    if (
        set(got) - {"reward", "calls"}
        or not isinstance(calls, dict)
        or not all(_finite(r) for r in calls.values())
    ):
        raise ValueError(
            f"run() returned {str(got)[:200]}: want {{'reward': R, 'calls': {{call index or reply id: r}}}}, finite numbers"
        )
    if any(not isinstance(k, (int, str)) or isinstance(k, bool) for k in calls):
        raise ValueError(
            f"call reward keys {list(calls)[:5]}: a call's index in its rollout (int) or its reply's id (str)"
        )
    return got.get("reward"), {k: float(r) for k, r in calls.items()}


async def run_rollouts(
    harness: Optional[Harness],
    jobs: list[tuple],
    endpoint_for: Callable[[str], Endpoint],
    max_concurrency: int = 8,
    timeout: float = 300.0,
    posted_reward: Callable[[str], Optional[float]] = lambda rid: None,
    desc: str = "rollouts",
    progress: bool = True,
) -> list[RolloutResult]:
    """Run ``jobs`` (rollout id, task), or (rollout id, task, harness) to mix harnesses, concurrently; one result per
    job, in order. A rollout that raises, runs past ``timeout`` or ends without a reward (returned or
    ``posted_reward``) fails: ``reward=None``, an ``error``."""
    sem = asyncio.Semaphore(max_concurrency)
    bar = tqdm(
        total=len(jobs),
        desc=desc,
        disable=not (progress and sys.stderr.isatty()),
        file=sys.stderr,
        dynamic_ncols=True,
    )  # quiet in logs
    rewards, failed = [], []  # of the rollouts done: for the bar's postfix

    async def one(rollout_id: str, task: Task, h: Harness) -> RolloutResult:
        limit = min((t for t in (timeout, h.timeout) if t), default=None)  # None: no limit
        async with sem:
            t0 = time.monotonic()
            reward, error, call_rewards = None, None, {}
            try:
                # asyncio.timeout (not wait_for) tells our deadline apart from a
                # TimeoutError raised inside the harness.
                async with asyncio.timeout(limit) as deadline:
                    reward, call_rewards = parse_reward(await h.run(task, endpoint_for(rollout_id)))
            except TimeoutError as e:
                error = f"timeout after {limit:g}s" if deadline.expired() else f"TimeoutError: {e}"
            except (
                Exception,
                SystemExit,
            ) as e:  # a crashed harness fails its rollout, not the step
                error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if error is None:
                reward = posted_reward(rollout_id) if reward is None else reward
                if reward is None:
                    error = "no reward (run() returned None and nothing was POSTed)"
                elif not _finite(reward):
                    error, reward = f"bad reward {reward!r} (want a finite float)", None
            seconds = time.monotonic() - t0
        if error is None:
            rewards.append(float(reward))
        else:
            failed.append(rollout_id)
            msg = " ".join(error.split())
            msg = (
                msg if len(msg) <= 400 else "..." + msg[-400:]
            )  # the end of a traceback says what happened
            tqdm.write(
                f"[{desc}] rollout {rollout_id} (task {task.id}) failed: {msg}", file=sys.stderr
            )
        bar.update(1)
        # the bar counts rollouts done; the postfix says how many failed and the mean reward so far
        bar.set_postfix(
            failed=len(failed), reward=f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
        )
        return RolloutResult(
            rollout_id,
            task.id,
            None if error else float(reward),
            error,
            seconds,
            harness=h.name,
            call_rewards={} if error else call_rewards,
        )

    try:
        return list(
            await asyncio.gather(*(one(rid, task, (h or [harness])[0]) for rid, task, *h in jobs))
        )
    finally:
        bar.close()
