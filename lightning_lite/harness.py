"""The harness interface, the harness loader, and the rollout runner (README: "Harnesses"). The trainer never
looks inside a harness: it hands each rollout its own base URL and collects one reward per rollout.
"""

import ast
import asyncio
import importlib.util
import math
import sys
import time
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


def __getattr__(name: str):
    """``lightning_lite.harness.SubprocessHarness``: a harness that is a program lives with its
    sandboxes' extra (extras/programs.py)."""
    if name == "SubprocessHarness":
        from .extras.programs import SubprocessHarness

        return SubprocessHarness
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    valid = lambda k, r: isinstance(k, (int, str)) and not isinstance(k, bool) and _finite(r)
    calls_ok = isinstance(calls, dict) and all(valid(k, r) for k, r in calls.items())
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
            why = "name a call by its index in the rollout or its reply's id"
            r.reward, r.error = None, f"rewards for calls it does not have: {bad[:3]} ({why})"
        r.call_rewards = {index_of[k]: v for k, v in rewards.items() if r.reward is not None}
