"""The seams where an optional feature (an extra, lightning_lite/extras/) adds behaviour to the
core.

Each seam is a plain dict, list or slot that the core reads at the one place named beside it. Each
is empty or None by default, and then the core takes its plain path: with lightning_lite/extras/
deleted, train.py and proxy.py still run end to end. An extra imports the core, and fills its seams
when it is imported; train.py and proxy.py import the extras they use from one visible list
(``load_extras``). The import direction is one way, extra -> core: no core module imports an extra
(tests/test_layout.py checks it).

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

# What some chat templates want of the messages besides OpenAI's shape, name -> fn(messages) ->
# messages (extras/tool_formats.py: Mistral's 9-character call ids, DeepSeek-R1's arguments as a
# JSON string, Gemma's alternating roles). chat.Renderer probes them in order where a template
# refuses a probe, and keeps the first that makes it render. Empty: a template that refuses a probe
# (a tool call in OpenAI's shape, two user messages in a row) is refused at start-up.
TEMPLATE_DIALECTS = {}

# Checks of a template that renders tool calls, fn(renderer, call) -> bool, call: the text of its
# first call after the generation prompt (extras/tool_formats.py: a call after a tool result is
# written as the first, which DeepSeek-R1's is not). chat.Renderer writes the calls of a template
# that fails one as text. Empty: every template that renders a call is taken at its word.
TEMPLATE_CHECKS = []

# Where some chat templates take the tool list instead of the ``tools`` argument, name ->
# fn(messages, tools) -> (messages, template arguments) (extras/tool_formats.py: in the system
# message's ``tools``, a list as GLM-4-9B-chat's reads it or a JSON string as Phi-4's; as
# ``available_tools`` too, as some Granite 3.3 templates read it; each tool without OpenAI's
# wrapper). chat.Renderer probes them in order where a template does not render the list it is
# given as ``tools``, and keeps the first that shows it. Empty: such a template is served as one
# without a tool list.
TOOL_PLACES = {}

# The format a family's models write where its template renders the tool list but neither a call
# nor instructions that name one, a marker of the family's tool list -> a format's name
# (extras/tool_formats.py: LFM2's <|tool_list_start|>, Kimi's tool_declare, Phi-4's <|tool|>).
# chat.Renderer reads a template's instructions first, then these, then its tokenizer's special
# tokens. Empty: such a template is refused at start-up unless --tool-format names the format.
TOOL_FAMILIES = {}

# Constrained decoding (extras/grammar.py): an object with
#   constrain(req, renderer, opened) -> the text a forced reply begins with (it sets
#     req.sampling.grammar);
#   Matcher(grammar, tokenizer, n_vocab), the sampler's state: .allowed() -> [V] bool and
#     .consume(token);
#   Replay(samples, tokenizer, n_vocab), the trainer's replay of what a micro-batch's tokens were
#     sampled under: algo.trainer_logprobs' ``allowed``, with the counts .constrained, .forced.
# None: a forced tool call is opened by the prompt alone (its name), and its arguments are not
# constrained.
grammar = None

# Per-rollout isolation (extras/isolation.py): a factory of the object Proxy keeps when asked for
# rollout_tokens. It admits each request (admit(request, rollout_id, reward) -> rollout id), gives
# each rollout its endpoint (endpoint(server, rollout_id, model, socket, api_key) ->
# harness.Endpoint: its route, the harness's reward key, with socket a Unix socket of its own),
# closes sockets (close_sockets(rollout_ids=None), None: all), holds what each rollout was refused
# (flags: rollout id -> list), and forgets a step (reset). None: every rollout id is served as it
# is, and a reward is taken from anyone.
isolation = None

# ----------------------------------------------------------------------------- the embedded backend
# Decoding at agent-length contexts (extras/fast_decode.py): an object with install(model), called
# once by HFBackend; PrefixCache(), the KV of the prompts seen before (lookup(ids, adapter) -> (n,
# KV or None), store(ids, kv, adapter), clear()); and RoomyLayer, the class the running batch's
# KV-cache layers take. None: every prompt prefilled whole, transformers' own attention and cache
# layers.
fast_decode = None

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

# A model adapter (extras/lora.py under --lora), set when its flags ask for one: see trainer.Learner
# for what it must provide. None: the whole model is trained.
adapter = None

# Loss metrics besides the loss's own (algo.reduce_metrics), e.g. the rollout-vs-trainer mismatch's
# prob_corr and extremes (extras/mismatch.py): factories fn() -> an object with add(logprobs,
# old_logprobs, loss_mask), given each micro-batch's [B, T] tensors, and result() -> {key: float},
# the step's over all ranks (a collective: a rank without samples calls it too). trainer.Learner's
# backward makes one of each per pass.
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

# After the last step, on rank 0: fn(run_dir), e.g. the HTML report.
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
# micro-batch's samples, its algo.collate batch ([B, T] rows in the samples' order), the trainer's
# [B, T] logprobs (detached) and entropies, and close() after the last micro-batch. ``loss_options``
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
