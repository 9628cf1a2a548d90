"""The seams where an optional feature (an extra, lightning_lite/extras/) adds behaviour to the
core.

Each seam is a registry (a dict or list, empty by default) or a slot whose default is a do-nothing
object (``NoGrammar``, ``NoFastDecode``, ...: the protocol an extra's object follows, written once);
the core reads it at the one place named beside it, with no None check, and by default takes its
plain path: with lightning_lite/extras/ deleted, train.py and proxy.py still run end to end. An
extra imports the core, and fills its seams when it is imported; train.py and proxy.py import the
extras they use from one visible list (``load_extras``). The import direction is one way, extra ->
core: no core module imports an extra (tests/test_layout.py checks it).

A flag that needs a missing extra is refused at start-up, naming the file (``missing``); a request
that needs one gets a 4xx in its API's own shape.
"""

import importlib
import importlib.util

# ----------------------------------------------------------------------------- the proxy
# POST routes, path -> async handler(proxy, request), served under "/" and "/rollout/<id>". The core
# serves /v1/chat/completions (proxy.py); extras add /v1/messages, /v1/responses, /v1/completions.
ROUTES = {}

# Error bodies in another API's shape: a path fragment -> error_body(status, message, param, code).
# A path that no entry matches gets OpenAI's shape (apis.error_body).
ERROR_SHAPES = {}

# Tool-call formats by name (toolcalls.Format). The core registers "hermes"; extras/tool_formats.py
# registers the other families' formats, and a "hermes" that reads their bodies in its tags too.
TOOL_FORMATS = {}


class NoTemplateQuirks:
    """The protocol of the quirks of some families' chat templates that chat.probe tries, and its
    do-nothing default: a template is served as it renders OpenAI's shape, and one that refuses it
    (a tool call, two user messages in a row) is refused at start-up, never served as if it took
    that shape. extras/tool_formats.py knows the families' quirks."""

    # What some templates want of the messages besides OpenAI's shape, name -> fn(messages) ->
    # messages (Mistral's 9-character call ids, DeepSeek-R1's arguments as a JSON string, Gemma's
    # alternating roles): a chat.TemplateInfo's ``dialects`` name them. None here.
    dialects: dict = {}

    def tool_place(self, info, lists):
        """(``info``, ``lists(info)``): does the template render the tool list where ``info``
        gives it? Where not, the first place that makes it (``info.tools_at``: Phi-4's system
        message) and True. Here none is tried: such a template is served without its list."""
        return info, lists(info)

    def in_dialect(self, info, attempt):
        """(``info``, ``attempt(info)``) where that is not None; else the same for ``info`` in one
        more dialect, the first that makes it so. Here none is tried."""
        return info, attempt(info)

    def calls_kept(self, tok, info, call: str) -> bool:
        """Does the template (``tok``'s, as chat.TemplateInfo ``info`` says it takes messages) keep
        every call of a history as it wrote ``call``, its text of the probe's one call? Where not
        (DeepSeek-R1's drops a call's opening after a tool result), calls are written as text.
        Here every template that renders a call is taken at its word."""
        return True

    def family(self, instructions: str, specials: list):
        """The format a family's models write where its template renders the tool list (its text:
        ``instructions``) but neither a call nor instructions that name a format: by a marker of
        the list (LFM2's <|tool_list_start|>), or by the tokenizer's special tokens. Here None:
        such a template is refused unless --tool-format names the format."""
        return None


# The chat templates' quirks: NoTemplateQuirks's (extras/tool_formats.py's TemplateQuirks).
template_quirks = NoTemplateQuirks()


class NoGrammar:
    """Constrained decoding's protocol, and its do-nothing default: a forced tool call is opened by
    the prompt alone (its name), and its arguments are not constrained. extras/grammar.py (the
    module itself) is the one that constrains: the proxy calls ``constrain``, the backend samples
    under its ``Matcher``, the trainer scores under its ``replay_samples``."""

    def constrain(self, req, renderer, opened: bool) -> str:
        """The text a request's reply is forced to begin with (a forced call's opening, a JSON
        reply's; "" for neither); the grammar it follows is put into ``req.sampling.grammar``. Here
        none is."""
        return renderer.forced_prefix(req.force_tool, opened, req.response_schema is not None)

    def Matcher(self, grammar: str, tokenizer, n_vocab: int):
        """The sampler's state of one reply under ``grammar``: .allowed() -> [V] bool and
        .consume(token). Here a grammar is an error: only the grammar extra sets one."""
        raise RuntimeError(missing("a request with a grammar", "grammar"))

    def replay_samples(self, samples: list, tokenizer, n_vocab: int):
        """What a grammar allowed each of a micro-batch's constrained tokens, replayed:
        algo.trainer_logprobs' ``allowed`` (with the counts .constrained and .forced), or None when
        no sample was sampled under a grammar (``Sample.grammars``)."""
        if any(s.grammars for s in samples):
            raise RuntimeError(missing("training on calls sampled under a grammar", "grammar"))
        return None


# Constrained decoding: NoGrammar's methods (extras/grammar.py, the module).
grammar = NoGrammar()


class NoIsolation:
    """Per-rollout isolation's protocol, and its do-nothing default: every rollout id is served as
    it is, and a reward is taken from anyone. Proxy keeps one of these as ``proxy.isolation``, and
    under ``rollout_tokens`` one of ``isolation``'s instead (extras/isolation.py: each rollout
    served under a route only it knows, rewards only with the harness's key)."""

    def __init__(self):
        # rollout id -> what it tried that was refused (Proxy.flags): nothing, here
        self.flags: dict[str, list[dict]] = {}

    def admit(self, request, rollout_id: str, reward: bool = False) -> str:
        """The rollout that ``request`` (to route ``rollout_id``; ``reward``: a reward POST) is for,
        or a 403 (chat.BadRequest): here the route itself, always."""
        return rollout_id

    def endpoint(self, server, plain, socket: bool):
        """A new rollout's harness.Endpoint on ``server`` (a proxy.ProxyServer), given ``plain``,
        its endpoint on the route of its bare id; ``socket``: with a Unix socket of its own (for a
        sandbox to bridge). Here ``plain``, and no socket."""
        if socket:
            message = "a rollout's own Unix socket (socket=True) needs Proxy(rollout_tokens=True)"
            raise ValueError(message + " and lightning_lite/extras/isolation.py")
        return plain

    def close_sockets(self, rollout_ids=None):
        """Close these rollouts' own sockets once they are done; None: all of them, for good
        (ProxyServer.stop)."""

    def reset(self):
        """The step is over: forget its rollouts (a straggler's next call is refused)."""


# The class of the object Proxy(rollout_tokens=True) keeps: NoIsolation's methods
# (extras/isolation.py). NoIsolation itself: rollout_tokens is refused, naming that file.
isolation = NoIsolation


# ----------------------------------------------------------------------------- the embedded backend
class NoPrefixCache:
    """The protocol of the KV cache of prompts seen before (HFBackend keeps one), and its
    do-nothing default: nothing is kept, and every prompt is prefilled whole."""

    def lookup(self, ids: list[int], adapter=None) -> tuple:
        """What is cached of ``ids`` under ``adapter`` (a LoRA adapter's name; None without): (n,
        the KV of ids[:n], [1, H_kv, n, D] keys and values per layer, the logits [V] after ids when
        n is all of it, else None). Here (0, None, None): nothing."""
        return 0, None, None

    def store(self, ids: list[int], kv: list, adapter=None, logits=None):
        """Remember ``kv``, the KV of ``ids`` under ``adapter``, and the ``logits`` [V] after them
        when given. Here nothing is kept."""

    def clear(self):
        """Forget everything: the weights are about to change (HFBackend.pause)."""


class NoFastDecode:
    """The protocol of the faster attention and cache layers on a CPU and at agent-length contexts,
    and its do-nothing default: transformers' own attention and cache layers, every prompt
    prefilled whole. extras/fast_decode.py (the module itself) is the fast one: the same numbers,
    sooner."""

    # The class of the prefix cache HFBackend keeps, called with no arguments.
    PrefixCache = NoPrefixCache

    def install(self, model):
        """Make HFBackend's ``model`` decode faster, in place (called once). Here it stays as it
        is."""

    def install_trainer(self, model):
        """Make the trainer's ``model`` (the policy, the KL reference) run a packed tree faster, in
        place, once its parameters are where it trains. Here it keeps transformers' attention."""

    def batch_cache(self, cache):
        """The cache a decoding batch keeps, made of its first request's ``cache`` (a
        DynamicCache). Here ``cache`` as it is: transformers' DynamicLayer, which copies the whole
        cache at each token."""
        return cache


# Decoding at agent-length contexts and training on a CPU, faster: NoFastDecode's methods
# (extras/fast_decode.py, the module).
fast_decode = NoFastDecode()

# --model names that are not directories: fn(name) -> a directory, or None when the name is not its
# (extras/embedded.py prepares the embedded models).
MODEL_RESOLVERS = []

# ----------------------------------------------------------------------------- train.py
# --backend choices besides "hf": name -> start(args, learner, resume_dir, device) -> a backend with
# HFBackend's surface (extras/vllm.py).
BACKENDS = {}

# --parallel choices besides "ddp": name -> an object with load(load_whole, device), wrap(model,
# dtype), accumulating(model, last), full_state_dict(model), optimizer_state(model, opt) and
# load_optimizer_state(model, opt, state) (extras/fsdp.py).
PARALLEL = {}


class NoAdapter:
    """The protocol of a model adapter as train.py and the backends use it, and its do-nothing
    default: none, the whole model trains and serves every rollout. extras/lora.py's LoRA is one
    (--lora); under --lora-per-harness each harness has an adapter, which serves its rollouts and
    trains on them alone."""

    # What trainer.Learner takes as its model adapter (see there for what it asks of one). None: the
    # whole model trains.
    model_adapter = None
    # Whether its adapters train apart: then train.py calls its update(learner, samples, results,
    # step) instead of Learner.update.
    trains_apart = False

    def name_after(self, tasks):
        """Name its adapters after the harnesses of ``tasks`` (harness.Tasks), once they are
        loaded. Here there is nothing to name."""

    def route(self, harness_of: dict) -> dict:
        """Each rollout of a batch (``harness_of``: rollout id -> its harness) to the adapter that
        serves it: {rollout id: the adapter's name}, which its endpoint gives as the model and the
        backends serve it by (``serving``). Here none: --model's name, the model as it is."""
        return {}

    def serving(self, rollout_id: str):
        """The adapter that serves ``rollout_id`` (the last ``route``'s; the backends ask at each
        call), or None: the served model as it is."""
        return None


# The model adapter (extras/lora.py sets its LoRA when --lora asks for one).
adapter = NoAdapter()

# Loss metrics besides the loss's own (algo.reduce_metrics), e.g. the rollout-vs-trainer mismatch's
# prob_corr and extremes (extras/mismatch.py), a grammar's token counts (extras/grammar.py):
# factories fn() -> an object with add(samples, batch, logprobs, entropy), given what
# TOKEN_RECORDERS' add is given, and result() -> {key: value}, the step's over all ranks (a
# collective: a rank without samples calls it too). trainer.Learner.backward makes one of each per
# pass, beside the core's own of this protocol (trainer.TokenCounts: fwd_tokens and staleness).
LOSS_METRICS = []

# Another source of a step's rollouts than running the harnesses (--from-calls, set when its flag is
# given): fn(tokenizer, log) -> a source whose step(step, rank, world, batch_size, draw) returns
# (groups, results, calls) as running the rollouts would.
step_source = None

# The step's tasks: a factory fn(args, log) -> an object of harness.Tasks's surface. None:
# harness.Tasks.from_flags, one harness (extras/harnesses.py adds several --harness, weights,
# grouping across them).
tasks = None

# Before the first rollout: fn(harnesses, args, server, log), e.g. each harness's sandbox.
ROLLOUT_SETUP = []
# After each batch of rollouts, whose flags hold what the proxy refused them:
# fn(results, calls_of, decode), e.g. the audit's flags (extras/audit.py).
ROLLOUT_FILTERS = []

# Where each metrics row goes besides metrics.jsonl: a factory fn(args, config) -> an object with
# log(row) and close() (TensorBoard, W&B).
METRIC_SINKS = []

# After the last step, on rank 0: fn(run_dir), e.g. the heartbeat's "done" (extras/recorder.py),
# then report.html (extras/report.py), in the order of train.py's EXTRAS.
AFTER_RUN = []

# ----------------------------------------------------------------------------- seeing a run
# What the run is doing as it happens: fns fn(event, info) that the core calls through ``progress``
# (extras/recorder.py writes RUN_DIR/heartbeat.json of them). The events and their info dicts:
#   "run"            rundir.RunDir.start, before the first step: out (the run dir), rank, config
#                    (config.json's: world_size, start_step, ...)
#   "phase"          train.py and trainer.Learner.start_update: phase ("rollouts", "train", "sync",
#                    "eval") and step
#   "rollout_start"  harness.run_rollouts, a rollout begun: rollout_id, task, harness (objects)
#   "rollout_end"    harness.run_rollouts, a rollout finished: result (a RolloutResult)
#   "call_start"     the proxy, a call begun: rollout_id
#   "call_end"       the proxy, a call recorded: call (a records.Call)
# Each runs in its caller's thread (the proxy has one of its own), so a fn must be quick and must
# not raise. Empty: nothing is called.
PROGRESS = []

# Per-token training data (extras/recorder.py: RUN_DIR/tokens/step_K.jsonl): factories
# fn(version, loss_options) -> an object with add(samples, batch, logprobs, entropy), given each
# trained micro-batch's samples, its algo.collate batch ([B, T] rows in the samples' order; its
# "allowed": grammar.replay_samples'), the trainer's [B, T] logprobs (detached) and entropies, and
# close() after the last micro-batch. ``loss_options``
# holds algo.policy_loss's options (loss, clip_low, ...): which tokens it clipped follows from
# them. trainer.Learner.backward makes one of each per pass. Empty: nothing is recorded.
TOKEN_RECORDERS = []


def progress(event: str, **info) -> None:
    """Tell each fn of ``PROGRESS`` that ``event`` happened (nothing when it is empty)."""
    for fn in PROGRESS:
        fn(event, info)


def load_extras(names: list[str]) -> list:
    """Import each extra named (lightning_lite/extras/NAME.py), which fills its seams here; one
    whose file is missing is skipped, and one that fails to import fails loudly. Returns the modules
    imported."""
    loaded = []
    if importlib.util.find_spec("lightning_lite.extras") is None:
        return loaded
    for name in names:
        module = f"lightning_lite.extras.{name}"
        if importlib.util.find_spec(module) is not None:
            loaded.append(importlib.import_module(module))
    return loaded


def parse_args(parser, names: list[str], loaded: list):
    """``parser``'s flags, parsed. A flag that no parser knows is refused: one that starts as an
    extra's name (--lora of lora.py) that is not ``loaded`` names the extra's file; any other names
    the extras of ``names`` that this process lacks."""
    args, unknown = parser.parse_known_args()
    have = [module.__name__.rsplit(".", 1)[1] for module in loaded]
    lacking = [name for name in names if name not in have]
    for flag in unknown:
        for name in lacking:
            if flag.startswith("--" + name.replace("_", "-")):
                parser.error(missing(flag.split("=")[0], name))
    if unknown:
        maybe = ""
        if lacking:
            maybe = f" (this copy lacks the extras {', '.join(lacking)}: it may be theirs)"
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{maybe}")
    return args


def missing(what: str, extra: str) -> str:
    """The message for a flag or request that needs an extra this process has not loaded: one this
    copy does not have, or (a script of one's own) one it has not imported."""
    if importlib.util.find_spec("lightning_lite.extras") is not None:
        if importlib.util.find_spec(f"lightning_lite.extras.{extra}") is not None:
            return (
                f"{what} needs lightning_lite/extras/{extra}.py, which this process has not "
                f"loaded: import lightning_lite.extras.{extra} first"
            )
    return (
        f"{what} needs lightning_lite/extras/{extra}.py, which this copy of lightning-lite does "
        "not have"
    )
