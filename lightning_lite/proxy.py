"""The proxy: an OpenAI-compatible HTTP endpoint that serves the policy and records every call (its
routes and records: docs/serving.md).

State. The proxy keeps one :class:`Session` per rollout id: the :class:`~chat.Turn` of each call it
answered, which lets the next call of the rollout reuse the tokens the model sampled
(chat.Renderer), and the rewards POSTed for it. The trainer marks its steps with ``set_output`` (the
calls file each step records into) and ``reset`` (forget the sessions); rollout ids are not reused
across steps.

Threads. Requests are served on the proxy's own event loop (``ProxyServer`` runs it in a background
thread; ``python proxy.py`` in its main thread); the backend decodes on its worker thread and hands
each sampled token back to that loop; the trainer calls ``set_output``, ``reset``, ``reward`` and
``flags`` from its own thread, hence ``_lock`` around the sessions and the calls file.

One call, in :meth:`Proxy.converse`: the request is parsed (apis.py; bad input: a 4xx in the API's
shape) -> its prompt ids are built, reusing the tokens an earlier call of the rollout sampled -> its
response ids and logprobs are generated (streamed as server-sent events while sampled, when asked)
-> its :class:`~records.Call` is appended to ``calls.jsonl`` -> the reply is sent. The routes are
hooks.ROUTES: the chat completions route here, the other APIs' from the extras.
"""

import asyncio
import functools
import hmac
import json
import logging
import math
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Optional

from aiohttp import web

from . import apis, hooks
from .chat import BadRequest, ContentStream, Renderer, Request, Turn, fingerprints
from .harness import Endpoint
from .models import eos_ids
from .records import Call, prepare_append, to_json

log = logging.getLogger("lightning_lite.proxy")
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


@dataclass
class CallsFile:
    """A calls file the proxy records into (path None: none), and each rollout's next call index in
    it."""

    path: Optional[str]
    next: dict[str, int] = field(default_factory=dict)


@dataclass
class Session:
    """What the proxy keeps of one rollout until :meth:`Proxy.reset` (a call in flight keeps its
    session)."""

    # its answered calls, for token reuse (chat.Renderer.build_prompt)
    turns: list[Turn] = field(default_factory=list)
    # per API: what apis.convert keeps of the last request (Responses: its earlier responses too)
    memo: dict[str, dict] = field(default_factory=dict)
    reward: Optional[float] = None
    # call index -> reward (POSTed with "call")
    call_rewards: dict[int, float] = field(default_factory=dict)
    # reply id -> its calls (n choices: several)
    replies: dict[str, list[int]] = field(default_factory=dict)
    # where its calls go: the calls file current when it began (Proxy.session), also after a switch
    out: Optional[CallsFile] = None


@dataclass
class Exchange:
    """One request in flight: whose it is, what it asked, the prompt built for it."""

    rollout_id: str
    session: Session
    api: str
    req: Request
    # the per-call cap lowered (or set) what the request asked for
    capped: bool = False
    prompt_ids: list[int] = field(default_factory=list)
    # the call whose prompt + response ids the prompt starts with, or why none (build_prompt)
    parent: Optional[int] = None
    split: Optional[str] = None
    # fingerprints of the request's messages (chat.fingerprints)
    fps: Optional[list[bytes]] = None
    # the text the reply is forced to begin with (a forced call, a JSON reply); did the prompt open
    # a reasoning block
    forced: str = ""
    opened: bool = False
    created: float = field(default_factory=time.time)


def conversation(api: str, open_api):
    """A route served by :meth:`Proxy.converse`. ``open_api(body, memo, proxy) -> (Request,
    new_writer)``: ``memo`` is the rollout's dict for this API, ``new_writer(n_prompt)`` the reply
    writer given the prompt's length (its methods: apis.py's docstring)."""

    async def handler(proxy: "Proxy", request: web.Request):
        return await proxy.converse(request, api, open_api)

    return handler


hooks.ROUTES["/v1/chat/completions"] = conversation("chat", apis.open_chat)
# The other APIs' routes and the extras that serve them: a request to one this copy lacks is told
# which file it needs.
EXTRA_ROUTES = {
    "/v1/messages": "anthropic",
    "/v1/messages/count_tokens": "anthropic",
    "/v1/responses": "responses",
    "/v1/completions": "completions",
}


class Proxy:
    def __init__(
        self,
        backend,
        tokenizer,
        model_name: str = "smollm2",
        out_dir: Optional[str] = None,
        reuse_tokens: bool = True,
        max_body_mb: float = 32.0,
        max_new_tokens: Optional[int] = None,
        call_timeout: Optional[float] = None,
        api_key: Optional[str] = None,
        max_requests: int = 1024,
        pause_retry_after: Optional[float] = None,
        tool_format: Optional[str] = None,
        keep_history_tokens: bool = False,
        rollout_tokens: bool = False,
    ):
        """Options as proxy.py's flags of the same names, see their help; train.py's:
        ``pause_retry_after``, ``rollout_tokens`` (each rollout served under a token of its own:
        extras/isolation.py)."""
        self.backend = backend
        self.tok = tokenizer
        self.model_name = model_name
        self.max_new_tokens = max_new_tokens
        self.call_timeout = call_timeout
        self.api_key = api_key
        self.max_requests = max_requests
        # requests being handled now (_guard)
        self.active = 0
        self.pause_retry_after = pause_retry_after
        # the EOS set generation stops on: the backend's (HFBackend), else models.eos_ids
        stop_ids = getattr(backend, "eos_ids", None) or eos_ids(tokenizer)
        self.renderer = Renderer(tokenizer, stop_ids, tool_format, keep_history_tokens)
        # reuse_tokens False: render every prompt fresh (a bench comparison: proxy.py
        # --no-reuse-tokens)
        self.reuse_tokens = reuse_tokens
        self.max_body = int(max_body_mb * 2**20)
        self.sessions: dict[str, Session] = {}
        # who may use each route (hooks.NoIsolation: anyone, any rollout id; rewards from anyone)
        self.isolation = hooks.NoIsolation()
        if rollout_tokens:
            if hooks.isolation is hooks.NoIsolation:
                raise ValueError(hooks.missing("rollout_tokens", "isolation"))
            self.isolation = hooks.isolation()
        # rollout id -> the seed of its calls that ask for none: call k of the rollout samples with
        # seed + k (train.py's evaluation: each task draws the same tokens at every evaluation of
        # the run, whatever order the calls arrive in). Other rollouts draw from the backend's
        # generator.
        self.seeds: dict[str, int] = {}
        # backend errors (the last 100; all counted): reported, never trained on
        self.failures = deque(maxlen=100)
        self.n_failures = 0
        # set_output runs on the trainer's thread, record on the loop's
        self._lock = threading.Lock()
        self._out = CallsFile(None)
        self.set_output(os.path.join(out_dir, "calls.jsonl") if out_dir else None)
        # rewards POSTed while serving
        self.rewards_path = os.path.join(out_dir, "rewards.jsonl") if out_dir else None

    # ------------------------------------------------------------------ used by the trainer

    def set_output(self, path: Optional[str]):
        """Append calls to ``path`` from now on (train.py switches files every step). A session's
        calls, also one in flight after the switch, go to the file current when it began; in a file
        with calls they number on."""
        with self._lock:
            # each call was written (closed) as recorded; a crashed machine loses none of them now
            if self._out.path:
                with open(self._out.path, "a") as f:
                    os.fsync(f.fileno())
            self._out = CallsFile(path)
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                self._out.next, cut = prepare_append(path)
                # its writer was killed mid-line
                if cut:
                    log.warning(f"{path}: cut off a torn last line ({cut} bytes) before appending")
                # the file exists from now on, even if no call comes
                open(path, "a").close()

    def reset(self):
        """Forget the sessions (between training steps; rollout ids are not reused). A call still in
        flight holds its session, recorded into the file current when it began; a straggler's next
        call gets a 403."""
        self.sessions = {}
        self.isolation.reset()

    def flags(self, rollout_id: str) -> list[dict]:
        """What the rollout tried that was refused (extras/isolation.py; none without it)."""
        return self.isolation.flags.get(rollout_id, [])

    def reward(self, rollout_id: str) -> Optional[float]:
        """The reward POSTed for the rollout; None: no such session, or no reward posted."""
        return getattr(self.sessions.get(rollout_id), "reward", None)

    def call_rewards(self, rollout_id: str) -> dict[int, float]:
        return getattr(self.sessions.get(rollout_id), "call_rewards", {})

    # ------------------------------------------------------------------ one call

    def session(self, rollout_id: str) -> Session:
        """The rollout's session, begun now if it has none: its calls go to the current calls
        file."""
        return self.sessions.setdefault(rollout_id, Session(out=self._out))

    async def converse(self, request: web.Request, api: str, open_api):
        """One chat-shaped call (chat completions, Anthropic Messages, Responses):
        parse -> build the prompt -> generate (streaming) -> record -> reply."""
        rollout_id, body = await self.read(request)
        session = self.session(rollout_id)
        hooks.progress("call_start", rollout_id=rollout_id)
        req, new_writer = open_api(body, session.memo.setdefault(api, {}), self)
        exchange = Exchange(rollout_id, session, api, req, capped=self.cap(req))
        self.build_prompt(exchange)
        writer = new_writer(len(exchange.prompt_ids))
        stream = await sse_start(request, writer.start()) if req.stream else None
        try:
            generations, visible = await self.generate_streaming(exchange, writer, stream)
        except BackendError as e:
            if stream is None:
                raise
            # the stream has begun: the error goes in it
            await stream.write(writer.error(str(e)))
            return stream
        except ConnectionResetError:
            # the client left mid-stream; its generation was cancelled
            return stream
        answers = [self.answer(exchange, gen, i, writer.id) for i, gen in enumerate(generations)]
        if stream is None:
            return web.json_response(writer.body(answers))
        # what was not streamed live
        await stream.write(writer.end(answers, visible.sent, visible.reasoning))
        return stream

    def build_prompt(self, exchange: Exchange):
        """The prompt ids: the conversation rendered, reusing the sampled tokens of the turn it
        extends, then the text a forced tool call or JSON reply begins with."""
        req = exchange.req
        turns = exchange.session.turns
        # hashes only the messages new since the latest turn
        exchange.fps = fingerprints(req.messages, req.tools, turns[-1] if turns else None)
        ids, exchange.parent, exchange.split = self.renderer.build_prompt(
            req.messages, req.tools, turns, self.reuse_tokens, exchange.fps, req.template_kwargs
        )
        # the generation prompt opened a reasoning block
        exchange.opened = self.renderer.opens_reasoning(ids)
        # A forced call or JSON reply: its opening text ends the prompt, and its arguments follow
        # their schema where constrained decoding is loaded (extras/grammar.py).
        exchange.forced = hooks.grammar.constrain(req, self.renderer, exchange.opened)
        forced_ids = self.renderer.encode(exchange.forced) if exchange.forced else []
        exchange.prompt_ids = ids + forced_ids
        self.admit(exchange.prompt_ids)

    async def generate_streaming(self, exchange: Exchange, writer, stream):
        """The generations, and what of the reply the stream sent: with a stream of one choice, the
        reply's visible reasoning and text are written as they are sampled."""
        req = exchange.req
        visible = ContentStream(
            self.renderer, req.sampling.stop, req.parse_tools, exchange.forced, exchange.opened
        )
        if stream is None or req.n > 1:
            return await self.generate(exchange), visible
        sampled: asyncio.Queue = asyncio.Queue()

        async def generate():
            try:
                return await self.generate(exchange, on_token=sampled.put_nowait)
            finally:
                # after every id (the backend hands them to this loop in order)
                sampled.put_nowait(None)

        task = asyncio.ensure_future(generate())
        ids = []
        try:
            while (token := await sampled.get()) is not None:
                ids.append(token)
                reasoning, content = visible.feed(ids)
                if reasoning:
                    await stream.write(writer.reasoning(reasoning))
                if content:
                    await stream.write(writer.text(content))
        finally:
            # a no-op when it is done; the client went away otherwise
            task.cancel()
        return await task, visible

    def answer(self, exchange: Exchange, gen, choice: int, reply_id: str) -> tuple[Call, dict]:
        """One generation parsed into its reply, recorded, and kept as the session's latest turn."""
        req = exchange.req
        turns = exchange.session.turns
        text = exchange.forced + self.renderer.sampled_text(gen.response_ids, req.sampling.stop)
        reply = self.renderer.parse_reply(text, req.parse_tools, exchange.opened)
        call = self.record(exchange, gen, choice, reply, reply_id)
        # the turn: its request, its reply and ids, how its prompt was built (on the turn it
        # extends)
        parent = next((t for t in reversed(turns) if t.index == exchange.parent), None)
        turn = Turn(
            index=call.index,
            messages=req.messages,
            tools=req.tools,
            reply=reply,
            prompt_ids=call.prompt_ids,
            response_ids=call.response_ids,
            fps=exchange.fps,
            forced=exchange.forced,
            parent=parent,
        )
        # the turn before forgets its request: fingerprints() reuses only the latest turn's
        if turns:
            turns[-1].messages = turns[-1].tools = turns[-1].fps = None
        turns.append(turn)
        return call, reply

    # ------------------------------------------------------------------ steps the extras share

    async def read(self, request: web.Request, reward: bool = False) -> tuple[str, Any]:
        """The rollout the request is for (admitted by extras/isolation.py under rollout_tokens),
        its body."""
        rollout_id = request.match_info.get("rid", "default")
        message = f"invalid rollout id {rollout_id[:64]!r}: use 1-128 characters of [A-Za-z0-9._-]"
        apis.expect(ROLLOUT_ID.match(rollout_id), message, None, "invalid_rollout_id")
        rollout_id = self.isolation.admit(request, rollout_id, reward)
        try:
            return rollout_id, json.loads(await request.read())
        # RecursionError: nested too deeply
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            message = f"the request body is not valid JSON ({e})"
            raise BadRequest(message, None, "invalid_json") from None

    def cap(self, req: Request) -> bool:
        """Apply the per-call cap; True when it lowered (or set) what the request asked for."""
        cap = self.max_new_tokens
        asked = req.sampling.max_tokens
        capped = bool(cap and (asked is None or asked > cap))
        if capped:
            req.sampling.max_tokens = cap
        return capped

    def admit(self, prompt_ids: list[int]):
        """May this prompt be served now? Not during a weight sync when calls are told to come back
        later (429), never when it does not fit the model's context (400)."""
        if self.pause_retry_after is not None and self.backend.paused:
            message = "the policy's weights are being updated; retry shortly"
            raise BackendError(message, 429, self.pause_retry_after)
        limit = self.backend.max_model_len
        if len(prompt_ids) >= limit:
            message = f"this model's maximum context length is {limit} tokens, but the prompt has "
            message += f"{len(prompt_ids)}; shorten the conversation"
            raise BadRequest(message, "messages", "context_length_exceeded")

    async def generate(self, exchange: Exchange, on_token=None) -> list:
        """``req.n`` generations for one prompt (choice i samples with seed + i when a seed is set,
        by the request or by ``seeds``). A backend that fails or passes ``call_timeout`` gets the
        client a 502 or 504; the call is recorded as ``error``."""
        req = exchange.req
        rollout_id = exchange.rollout_id
        seed = req.sampling.seed
        if seed is None and rollout_id in self.seeds:
            # the index this call will be recorded under: a rollout's calls are numbered in order
            seed = self.seeds[rollout_id] + exchange.session.out.next.get(rollout_id, 0)
        samplings = [
            req.sampling if seed is None else replace(req.sampling, seed=seed + i)
            for i in range(req.n)
        ]
        generations = [
            self.backend.generate(exchange.prompt_ids, s, on_token=on_token, rollout_id=rollout_id)
            for s in samplings
        ]
        gathered = asyncio.gather(*generations)
        try:
            return await asyncio.wait_for(gathered, self.call_timeout)
        except (asyncio.CancelledError, Exception) as e:
            # Python 3.11's gather, once cancelled, ends with a CancelledError as its exception: it
            # is taken here, or the loop logs "exception was never retrieved" for every such call.
            if gathered.done() and not gathered.cancelled():
                gathered.exception()
            # No answer: the client went away (its generation is cancelled with it) or the backend
            # failed. The calls are recorded as "cancelled" or "error", with an empty response:
            # never trained on.
            cancelled = isinstance(e, asyncio.CancelledError)
            finish = "cancelled" if cancelled else "error"
            empty = SimpleNamespace(response_ids=[], logprobs=[], finish_reason=finish)
            empty.version = self.backend.version
            unanswered = replace(exchange, parent=None, split=None, capped=False)
            for i in range(req.n):
                self.record(unanswered, empty, i)
            if cancelled:
                raise
            # the backend failed: report it loudly, answer 502/504
            timeout = isinstance(e, TimeoutError)
            message = f"backend error: {type(e).__name__}: {e}"
            if timeout:
                message = f"the backend did not answer within {self.call_timeout:g} s"
            log.error(message, exc_info=not timeout)
            self.n_failures += 1
            self.failures.append({"time": time.time(), "rollout_id": rollout_id, "error": message})
            raise BackendError(message, 504 if timeout else 502) from e

    def record(self, exchange: Exchange, gen, choice: int, reply=None, reply_id=None) -> Call:
        """Append the call to its session's calls file, numbered on after the rollout's calls
        already there."""
        session = exchange.session
        rollout_id = exchange.rollout_id
        sampling = exchange.req.sampling
        # "length" stays "length" even when the cut reply parses as a tool call: the trainer must
        # see the truncation
        finish_reason = gen.finish_reason
        if reply is not None and reply.get("tool_calls") and gen.finish_reason == "stop":
            finish_reason = "tool_calls"
        with self._lock:
            out = session.out
            call = Call(
                rollout_id=rollout_id,
                index=out.next.get(rollout_id, 0),
                choice=choice,
                api=exchange.api,
                prompt_ids=exchange.prompt_ids,
                parent=exchange.parent,
                split=exchange.split,
                model_version=gen.version,
                response=reply,
                reply_id=reply_id,
                response_ids=gen.response_ids,
                response_logprobs=gen.logprobs,
                finish_reason=finish_reason,
                created=exchange.created,
                capped=exchange.capped and gen.finish_reason == "length",
                latency_s=round(time.time() - exchange.created, 4),
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                grammar=sampling.grammar,
            )
            out.next[rollout_id] = call.index + 1
            if reply_id:
                session.replies.setdefault(reply_id, []).append(call.index)
            if out.path:
                # a call extending its parent is written as the ids after the parent's (read_calls)
                parent = next((t for t in session.turns if t.index == exchange.parent), None)
                tail = {}
                if parent:
                    tail = dict(prompt_ids=None, prompt_tail=call.prompt_ids[parent.size :])
                # opened per call: a call in flight when its session's file was switched goes there
                with open(out.path, "a") as f:
                    f.write(to_json(call, **tail) + "\n")
        hooks.progress("call_end", call=call)
        return call

    # ------------------------------------------------------------------ the other routes

    async def post_reward(self, request: web.Request):
        """``{"reward": x}``: the rollout's reward, or with ``"call"`` one call's (its index or its
        reply's id); ``"task"`` groups rollouts under train.py --from-calls. A bare number is
        ``{"reward": x}``."""
        rollout_id, body = await self.read(request, reward=True)
        body = body if isinstance(body, dict) else {"reward": body}
        reward = body.get("reward")
        call = body.get("call")
        task = body.get("task")
        is_number = isinstance(reward, (int, float)) and not isinstance(reward, bool)
        message = 'send {"reward": <number>} (and "call": a call\'s index or reply id, to reward '
        message += "one call)"
        apis.expect(is_number and math.isfinite(reward), message, "reward", "invalid_type")
        task_ok = task is None or isinstance(task, str)
        message = (
            "a reward has the keys reward, call (a call's index or reply id) and task (a string: "
            "rollouts of one task form one advantage group under train.py --from-calls)"
        )
        # its code: "invalid_value"
        apis.expect(task_ok and set(body) <= {"reward", "call", "task"}, message, None)
        line = {"rollout_id": rollout_id, "reward": float(reward)}
        session = self.session(rollout_id)
        if call is None:
            session.reward = line["reward"]
        else:
            line["call"] = self._rewarded_call(session, rollout_id, call)
            session.call_rewards[line["call"]] = line["reward"]
        if task:
            line["task"] = task
        # proxy.py: the rewards land next to the calls (train.py --from-calls reads both)
        if self.rewards_path:
            with self._lock, open(self.rewards_path, "a") as f:
                f.write(json.dumps({**line, "time": time.time()}) + "\n")
        return web.json_response(line)

    def _rewarded_call(self, session: Session, rollout_id: str, call: Any) -> int:
        """A call of this rollout, named by its index (in its calls file) or by the id its reply
        had."""
        n = session.out.next.get(rollout_id, 0)
        if isinstance(call, int) and not isinstance(call, bool) and 0 <= call < n:
            return call
        by_id = isinstance(call, str)
        # a reply of n choices is n calls: one of them is named by its index
        if by_id and len(session.replies.get(call, [])) == 1:
            return session.replies[call][0]
        restart = ""
        if by_id:
            restart = ", ids of replies before a proxy restart by index"
        message = f"rollout {rollout_id!r} has no call {call!r}: name it by its index (0..{n - 1}) "
        message += f"or by the id of its reply (a reply of n choices: by index){restart}"
        raise BadRequest(message, "call", "not_found", 404)

    async def models(self, request: web.Request):
        model = dict(id=self.model_name, object="model", created=0, owned_by="lightning-lite")
        model["max_model_len"] = self.backend.max_model_len
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request):
        status = {"status": "ok", "model": self.model_name, "version": self.backend.version}
        status["backend_failures"] = self.n_failures
        return web.json_response({**status, **self.backend.stats})

    # ------------------------------------------------------------------ app

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        """Every route: the API key when one is set, the bound on requests at once; every 4xx/5xx
        carries an error body in the API's own format, and the server keeps serving."""
        auth = request.headers.get("Authorization", "")
        bearer = auth[:7].lower() == "bearer "
        key = auth[7:].strip() if bearer else request.headers.get("x-api-key", "")
        if self.api_key and not hmac.compare_digest(key.encode(), self.api_key.encode()):
            message = "missing or wrong API key: send it as 'Authorization: Bearer KEY' or "
            message += "'x-api-key: KEY'"
            return _error(request.path, 401, message, code="invalid_api_key")
        if self.active >= self.max_requests:
            message = f"the proxy is handling {self.active} requests (its limit); retry shortly"
            return _error(request.path, 429, message, code="too_many_requests", retry_after=1)
        self.active += 1
        try:
            return await handler(request)
        except BadRequest as e:
            return _error(request.path, e.status, e.message, e.param, e.code)
        except BackendError as e:
            return _error(request.path, e.status, str(e), retry_after=e.retry_after)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            where = f"{request.method} {request.path}"
            messages = {
                404: f"no route {where}; see GET /v1/models and docs/serving.md for the routes"
            }
            for route, extra in EXTRA_ROUTES.items():
                if request.path.endswith(route) and route not in hooks.ROUTES:
                    # an API whose extra this copy does not have
                    messages[404] = hooks.missing(f"{where} (its API)", extra)
            messages[405] = f"method {request.method} is not allowed on {request.path}"
            messages[413] = f"request body too large (limit {self.max_body} bytes)"
            codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
            message = messages.get(e.status, e.reason)
            return _error(request.path, e.status, message, code=codes.get(e.status))
        finally:
            self.active -= 1

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[self._guard])
        for prefix in ("", "/rollout/{rid}"):
            for path, handler in hooks.ROUTES.items():
                app.router.add_post(prefix + path, functools.partial(handler, self))
            # GET and HEAD: harnesses probe their base URL (Claude Code)
            app.router.add_get(prefix or "/", self.health)
            app.router.add_get(prefix + "/v1/models", self.models)
            app.router.add_get(prefix + "/health", self.health)
        app.router.add_post("/rollout/{rid}/reward", self.post_reward)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app):
        # the last calls file is fsync'd
        self.set_output(None)


# ---------------------------------------------------------------------- helpers


class BackendError(Exception):
    """The backend failed a call (502), timed out (504) or is paused for a weight sync (429, before
    any stream begins): an error body, or an error event in a begun stream."""

    def __init__(self, message: str, status: int = 502, retry_after: Optional[float] = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def _error(path: str, status: int, message: str, param=None, code=None, retry_after=None):
    """An error response to a request for ``path``, in its API's own shape: an entry of
    hooks.ERROR_SHAPES whose fragment the path holds (Anthropic's), else OpenAI's."""
    shapes = [shape for fragment, shape in hooks.ERROR_SHAPES.items() if fragment in path]
    error_body = shapes[0] if shapes else apis.error_body
    body = error_body(status, message, param, code)
    headers = None
    if retry_after is not None:
        headers = {"Retry-After": f"{retry_after:g}"}
    return web.json_response(body, status=status, headers=headers)


async def sse_start(request: web.Request, first: bytes) -> web.StreamResponse:
    """A begun stream of server-sent events, ``first`` sent."""
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(request)
    await resp.write(first)
    return resp


class ProxyServer:
    """Runs a :class:`Proxy` on its own event loop in a background thread (for train.py and tests).

    >>> srv = ProxyServer(proxy, port=0).start(); srv.url   # 'http://127.0.0.1:40123'
    >>> srv.stop()
    """

    def __init__(self, proxy: Proxy, host: str = "127.0.0.1", port: int = 0):
        self.proxy = proxy
        self.host = host
        self.port = port
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="proxy", daemon=True)
        self.runner = None
        # "http://HOST:PORT" once started (port 0: the port bound)
        self.url: Optional[str] = None

    def run(self, coroutine):
        """Run ``coroutine`` on the proxy's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close_sockets(self, rollout_ids):
        """Close these rollouts' own Unix sockets (extras/isolation.py), once they are done."""
        self.proxy.isolation.close_sockets(rollout_ids)

    def base_url(self, rollout_id: str) -> str:
        return f"{self.url}/rollout/{rollout_id}/v1"

    def endpoint(self, rollout_id: str, model: str, socket=False, api_key="sk-lightning-lite"):
        """A new rollout's endpoint. With ``rollout_tokens`` (extras/isolation.py) its base URL
        carries a token only it knows and its harness gets the reward key; ``socket``: a Unix socket
        of its own too, for a sandbox to bridge."""
        url = self.base_url(rollout_id)
        plain = Endpoint(url, api_key, model, rollout_id, self.url, route=rollout_id)
        return self.proxy.isolation.endpoint(self, plain, socket)

    def start(self) -> "ProxyServer":
        self._thread.start()
        self.run(self._start())
        return self

    async def _start(self):
        # handler_cancellation: a client that leaves cancels its call
        self.runner = web.AppRunner(self.proxy.app(), access_log=None, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, self.port).start()
        # the port bound (port 0: a free one); the TCP site is the runner's only one yet
        self.port = self.runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"

    def stop(self):
        self.proxy.isolation.close_sockets()
        if self.runner is not None:
            self.run(self.runner.cleanup())
            self.runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
