"""The harness interface, the harness loader, the step's tasks and the rollout runner (README:
"Harnesses"). The trainer never looks inside a harness: it hands each rollout its own base URL and
collects one reward per rollout.
"""

import ast
import asyncio
import importlib.util
import math
import random
import re
import signal
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from tqdm import tqdm

from . import hooks
from .records import UNANSWERED
from .samples import build_batch_samples

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
    # "<rollout_id>.<token>" under train.py (the token makes the route this rollout's alone); the
    # rollout id otherwise
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
    """Write ``tasks(split)`` and ``async run(task, endpoint)``, which returns the reward (README
    "Harnesses"), e.g. ``float(await ask(endpoint.base_url, task.prompt) == task.answer)``; or None
    when it POSTed one to ``endpoint.reward_url``; or ``{"reward": R, "calls": {k: r_k}}`` to reward
    calls too (k: the call's index in the rollout, or its reply's id). ``timeout`` (seconds), when
    set, caps a rollout below the runner's limit. The extras read more fields when a harness sets
    them: ``audit``, ``audit_results`` and ``zero_flagged`` (extras/audit.py)."""

    name = "base"
    timeout: Optional[float] = None

    # split: "train" or "test"
    def tasks(self, split: str) -> list[Task]:
        raise NotImplementedError(f"{type(self).__name__} must define tasks(split)")

    async def run(self, task: Task, endpoint: Endpoint) -> Optional[float]:
        raise NotImplementedError(f"{type(self).__name__} must define async run(task, endpoint)")


def __getattr__(name: str):
    """A name that moved: ``lightning_lite.harness.SubprocessHarness`` is in extras/programs.py."""
    if name == "SubprocessHarness":
        # ImportError, not AttributeError: `from lightning_lite.harness import SubprocessHarness`
        # would replace an AttributeError's message with its own "cannot import name".
        raise ImportError(
            "SubprocessHarness moved to the extra of program harnesses: write "
            "`from lightning_lite.extras.programs import SubprocessHarness`"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------- loading


def load_harness(spec: str, **kwargs) -> Harness:
    """The harness ``spec`` names, built with ``kwargs``: ``"calc"`` (examples/calc/harness.py), a
    module (``"my_pkg.harnesses"``) or a file (``"path/to/h.py"``), each with ``":Name"`` for a
    Harness subclass or a function that returns one; without it, the one Harness subclass the module
    defines."""
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
    known = ", ".join(examples) or "none"
    raise ValueError(
        f"no harness {spec!r}: not examples/{target}/harness.py (known: {known}) "
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
    """Harness arguments, Python literals: ``["difficulty=2", "name=x"]`` -> ``{"difficulty": 2,
    "name": "x"}``."""
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


# ---------------------------------------------------------------------------- the step's tasks

# "search:2": a spec with a WEIGHT (several harnesses: extras/harnesses.py). "file.py:Class" has
# none.
WEIGHTED = re.compile(r"(.+):(\d+(?:\.\d+)?)")


def several(specs: list[str], harness_args: list[str]) -> bool:
    """Whether train.py's --harness SPECs and --harness-arg items ask for what extras/harnesses.py
    runs: more than one SPEC, a SPEC with a WEIGHT or an item for one SPEC (SPEC:K=V)."""
    weighted = any(WEIGHTED.fullmatch(spec) for spec in specs)
    targeted = any(":" in item.partition("=")[0] for item in harness_args)
    return len(specs) > 1 or weighted or targeted


class Tasks:
    """Which tasks each step runs, for one harness (``--harness SPEC``, each ``--harness-arg K=V`` a
    keyword of it): step k draws ``batch_size`` of its train tasks from a fixed shuffle per epoch,
    and runs each ``group_size`` times, one advantage group. The same seed and step draw the same
    tasks, so --resume goes on where the run stopped. extras/harnesses.py runs several harnesses."""

    def __init__(self, specs, harness_args, batch_size, group_size, eval_tasks, seed, log):
        if several(specs, harness_args):
            what = "several --harness, a --harness WEIGHT or a --harness-arg SPEC:K=V"
            sys.exit(hooks.missing(what, "harnesses"))
        self.batch_size = batch_size
        self.group_size = group_size
        self.seed = seed
        # no spec: no harness (train.py --from-calls only draws)
        self.harnesses = [load_harness(spec, **parse_kwargs(harness_args)) for spec in specs]
        # harness name -> its tasks
        self.train = {h.name: h.tasks("train") for h in self.harnesses}
        self.test = {h.name: h.tasks("test")[:eval_tasks] for h in self.harnesses}
        for h, spec in zip(self.harnesses, specs):
            counts = f"{len(self.train[h.name])} train / {len(self.test[h.name])} test tasks"
            log(f"harness {h.name} ({spec}): {counts}")

    @classmethod
    def from_flags(cls, args, log) -> "Tasks":
        """The tasks of train.py's flags (an argparse Namespace): hooks.tasks's signature."""
        return cls(
            args.harness,
            args.harness_arg,
            args.batch_size,
            args.group_size,
            args.eval_tasks,
            args.seed,
            log,
        )

    def names(self) -> list[str]:
        return [h.name for h in self.harnesses]

    def pick(self, step: int) -> list[list[tuple]]:
        """The step's batch_size groups (all ranks'), each group_size (harness, task, group id)."""
        groups = []
        for h in self.harnesses:
            for task in self.draw(self.train[h.name], step, self.batch_size):
                groups.append([(h, task, f"{h.name}/{task.id}")] * self.group_size)
        return groups

    def jobs(self, step: int, rank: int, world: int) -> tuple[list[tuple], dict]:
        """This rank's share of the step's groups as rollouts: [(rollout id, task, harness)] and
        {rollout id: its advantage group}. The ids are unique in a run: "s{step}-r{rank}-t{i}-g{g}"."""
        jobs = []
        groups = {}
        for i, group in enumerate(self.pick(step)[rank::world]):
            for g, (harness, task, group_id) in enumerate(group):
                rollout_id = f"s{step}-r{rank}-t{i}-g{g}"
                jobs.append((rollout_id, task, harness))
                groups[rollout_id] = group_id
        return jobs, groups

    def draw(self, items: list, step: int, n: int) -> list:
        """The step's n items of a fixed shuffle per epoch, so --resume sees the same order."""
        epoch, k = divmod(step, max(1, len(items) // max(1, n)))
        items = list(items)
        random.Random(self.seed * 1000 + epoch).shuffle(items)
        return items[k * n : (k + 1) * n]

    def eval_jobs(self, step: int, rank: int, world: int) -> tuple[list[tuple], dict]:
        """This rank's share of the evaluation at ``step``, each test task once, as rollouts:
        [(rollout id, task, harness)] and {rollout id: its seed}, the ids "eval{step}-r{rank}-{i}".
        A call that asks for no seed samples with its rollout's (``Proxy.seeds``), made from the
        run's seed and the task: every evaluation draws the same tokens for a task wherever the
        weights agree, so two steps are compared on the same random numbers."""
        every = [(h, t) for h in self.harnesses for t in self.test[h.name]]
        jobs = []
        seeds = {}
        for i, (harness, task) in enumerate(every[rank::world]):
            rollout_id = f"eval{step}-r{rank}-{i}"
            jobs.append((rollout_id, task, harness))
            # << 16: room for the call index the proxy adds
            seeds[rollout_id] = zlib.crc32(f"{self.seed}/{harness.name}/{task.id}".encode()) << 16
        return jobs, seeds

    def eval_row(self, results: list, seconds: float) -> dict:
        """eval_reward, eval_success (reward >= 1), eval_tasks, eval_failed and eval_s over every
        rank's results (a collective)."""
        # torch only when evaluating: a harness module imports this file
        from .algo import all_reduce

        rewards = [r.reward for r in results if r.reward is not None]
        successes = sum(reward >= 1.0 for reward in rewards)
        sums = [len(results), sum(rewards), successes, len(results) - len(rewards)]
        n, total, success, failed = all_reduce(sums)
        return {
            "eval_reward": total / max(1, n),
            "eval_success": success / max(1, n),
            "eval_tasks": int(n),
            "eval_failed": int(failed),
            "eval_s": round(seconds, 1),
        }

    def merge(self, results: list, calls: list, max_seq_len) -> tuple[list, Counter]:
        """The finished rollouts' ``calls`` merged into samples, and the merge statistics
        (samples.build_batch_samples). extras/harnesses.py merges each harness's apart, and keeps
        its statistics for ``harness_columns``."""
        return build_batch_samples(calls, max_seq_len)

    def harness_columns(self, results: list, calls: list) -> dict:
        """The step row's columns of each harness (KEY/NAME) over every rank, of this rank's
        ``results`` and their ``calls``: none with one harness (extras/harnesses.py has some)."""
        return {}

    def by_harness(self, row: dict, *keys: str) -> str:
        """The log line's tail of each harness's ``keys`` in ``row`` (KEY/NAME): nothing with one
        harness."""
        return ""


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
    # what it tried that it may not: {kind, what, call, where, match} (docs/sandboxes.md)
    flags: list = field(default_factory=list)
    # the name of the harness that ran it
    harness: str = ""
    # call (its index, or its reply's id until train.py resolves it) -> reward
    call_rewards: dict = field(default_factory=dict)


def settle_rollouts(results: list[RolloutResult], calls: list, proxy, decode) -> None:
    """What the records say of a batch of finished rollouts, once their calls are read back: each
    one's call rewards keyed by call index (resolve_call_rewards), its flags (what ``proxy`` refused
    it, then what hooks.ROLLOUT_FILTERS find in its calls, e.g. extras/audit.py's patterns), and
    failed where the backend failed one of its calls."""
    calls_of = {}
    for c in calls:
        calls_of.setdefault(c.rollout_id, []).append(c)
    resolve_call_rewards(results, calls_of, proxy.call_rewards)
    for result in results:
        # another's route, a reward of its own (extras/isolation.py)
        result.flags = proxy.flags(result.rollout_id)
    for flag in hooks.ROLLOUT_FILTERS:
        flag(results, calls_of, decode)
    fail_rollouts_the_backend_failed(results, calls)


def fail_rollouts_the_backend_failed(results: list[RolloutResult], calls) -> None:
    """A rollout one of whose calls the backend failed (``finish_reason == "error"``) is failed,
    even if the harness carried on and got a reward: part of its conversation was never sampled by
    the policy."""
    broken = {c.rollout_id for c in calls if c.finish_reason == "error"}
    error = "the backend failed one of its calls (finish_reason 'error' in the calls file)"
    for result in results:
        if result.rollout_id in broken and result.error is None:
            result.reward = None
            result.error = error


def _finite(x) -> bool:
    # a bool counts: True is a reward of 1
    return isinstance(x, (int, float)) and math.isfinite(x)


def _call_reward_ok(key, reward) -> bool:
    # a call's index (not a bool) or its reply's id, and a finite reward
    return isinstance(key, (int, str)) and not isinstance(key, bool) and _finite(reward)


def parse_reward(returned) -> tuple[Optional[float], dict]:
    """What ``run()`` returned -> (reward, call rewards): ``0.5`` -> ``(0.5, {})``, ``None`` ->
    ``(None, {})``, ``{"reward": 1, "calls": {0: 0.2, "chatcmpl-7": 1}}`` -> ``(1, {0: 0.2,
    "chatcmpl-7": 1.0})``."""
    if not isinstance(returned, dict):
        return returned, {}
    calls = returned.get("calls", {})
    calls_ok = isinstance(calls, dict) and all(_call_reward_ok(k, r) for k, r in calls.items())
    if set(returned) - {"reward", "calls"} or not calls_ok:
        raise ValueError(
            f"run() returned {str(returned)[:200]}: want {{'reward': R, 'calls': {{k: r}}}}, "
            "k a call's index in its rollout (int) or its reply's id (str), r a finite number"
        )
    return returned.get("reward"), {k: float(r) for k, r in calls.items()}


class CtrlC:
    """Takes Ctrl-C while rollouts run (train.py): ``pressed`` is set, which the loop checks at
    every step, since Python drops a KeyboardInterrupt raised while a finalizer runs (a run once
    went on for 20 steps). Within the rollouts' event loop it cancels them (their clients close), as
    asyncio.run would; outside it raises KeyboardInterrupt."""

    def __init__(self):
        self.pressed = False
        signal.signal(signal.SIGINT, self.handle)

    def handle(self, signum, frame):
        self.pressed = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise KeyboardInterrupt from None
        for task in asyncio.all_tasks(loop):
            task.cancel()
        # the signal does not end the loop's select(): wake it
        loop.call_soon_threadsafe(lambda: None)


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
    ``[RolloutResult("r0", "t0", 1.0, None, 2.1, harness="calc")]``. A rollout that raises, runs
    past ``timeout`` or ends without a reward (returned, or ``posted_reward``) fails:
    ``reward=None``, an ``error``."""
    semaphore = asyncio.Semaphore(max_concurrency)
    # the results of the rollouts done so far
    done = []

    async def run_one(rollout_id: str, task: Task, harness: Harness) -> RolloutResult:
        result = RolloutResult(rollout_id, task.id, None, None, 0.0, harness=harness.name)
        async with semaphore:
            start = time.monotonic()
            hooks.progress("rollout_start", rollout_id=rollout_id, task=task, harness=harness)
            result.reward, result.error, result.call_rewards = await _reward_or_error(
                harness, task, rollout_id, endpoint_for, timeout, posted_reward
            )
            result.seconds = time.monotonic() - start
        if result.error is not None:
            # the end of a traceback says what happened
            message = " ".join(result.error.split())
            if len(message) > 400:
                message = "..." + message[-400:]
            where = f"[{desc}] rollout {rollout_id} (task {task.id})"
            tqdm.write(f"{where} failed: {message}", file=sys.stderr)
        done.append(result)
        hooks.progress("rollout_end", result=result)
        rewards = [r.reward for r in done if r.error is None]
        mean_reward = "-"
        if rewards:
            mean_reward = f"{sum(rewards) / len(rewards):.3f}"
        bar.update(1)
        bar.set_postfix(failed=len(done) - len(rewards), reward=mean_reward)
        return result

    # The bar counts the rollouts done, its postfix the failed ones and the mean reward so far.
    # It is quiet in logs.
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
        # asyncio.timeout (not wait_for) tells our deadline apart from a TimeoutError raised inside
        # the harness.
        async with asyncio.timeout(limit) as deadline:
            reward, call_rewards = parse_reward(await harness.run(task, endpoint_for(rollout_id)))
    except TimeoutError as e:
        if deadline.expired():
            return None, f"timeout after {limit:g}s", {}
        return None, f"TimeoutError: {e}", {}
    # a crashed harness fails its rollout, not the step
    except (Exception, SystemExit) as e:
        error = type(e).__name__
        if str(e):
            error = f"{error}: {e}"
        return None, error, {}
    if reward is None:
        reward = posted_reward(rollout_id)
    if reward is None:
        return None, "no reward (run() returned None and nothing was POSTed)", {}
    if not _finite(reward):
        return None, f"bad reward {reward!r} (want a finite float)", {}
    return float(reward), None, call_rewards


def resolve_call_rewards(results: list[RolloutResult], calls_of: dict, posted) -> None:
    """Each rollout's call rewards (``posted(rollout_id)``: POSTed to the proxy, then those
    ``run()`` returned) keyed by call index: a call is named by its index or by its reply's id (a
    reply of one choice). A reward for a call the rollout does not have fails the rollout."""
    for r in results:
        calls = calls_of.get(r.rollout_id, [])
        answered = [c for c in calls if c.finish_reason not in UNANSWERED]
        # A call's index names it, and so does its reply's id where no other call has that id.
        ids = Counter(c.reply_id for c in answered)
        index_of = {}
        for c in answered:
            index_of[c.index] = c.index
            if ids[c.reply_id] == 1:
                index_of[c.reply_id] = c.index
        rewards = {**posted(r.rollout_id), **r.call_rewards}
        unknown = [k for k in rewards if k not in index_of]
        if r.reward is not None and unknown:
            why = "name a call by its index in the rollout or its reply's id"
            r.reward = None
            r.error = f"rewards for calls it does not have: {unknown[:3]} ({why})"
        r.call_rewards = {}
        if r.reward is not None:
            r.call_rewards = {index_of[k]: v for k, v in rewards.items()}
