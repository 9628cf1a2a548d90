"""The proxy: an OpenAI- and Anthropic-compatible HTTP endpoint that serves the policy and records every call
(its routes and records: README "Serving and recording"). Each request is validated and normalized (apis.py;
bad input: a 4xx in the API's format), its prompt ids built reusing the tokens an earlier call of the rollout
sampled (chat.Renderer), its response ids + logprobs generated, its :class:`Call` appended to ``calls.jsonl``
*before* the answer is sent (JSON, or server-sent events streamed as the tokens are sampled).

The trainer drives it in-process (``ProxyServer``); ``python proxy.py`` serves it on its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import math
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from aiohttp import web

from . import apis
from .extras import grammar
from .chat import BadRequest, ContentStream, Renderer, Request, Turn, fingerprints
from .harness import Endpoint
from .models import eos_ids
from .records import Call, prepare_append, to_json

log = logging.getLogger("lightning_lite.proxy")
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def _valid(rid: str) -> str:
    if not ROLLOUT_ID.match(rid):
        raise BadRequest(
            f"invalid rollout id {rid[:64]!r}: use 1-128 characters of [A-Za-z0-9._-]",
            None,
            "invalid_rollout_id",
        )
    return rid


@dataclass
class CallsFile:
    """A calls file the proxy records into (path None: none), and each rollout's next call index in it."""

    path: Optional[str]
    next: dict[str, int] = field(default_factory=dict)


@dataclass
class Session:
    turns: list[Turn] = field(default_factory=list)
    responses: dict[str, list[dict]] = field(
        default_factory=dict
    )  # Responses API id -> its conversation
    reward: Optional[float] = None
    call_rewards: dict[int, float] = field(
        default_factory=dict
    )  # call index -> reward (POSTed with "call")
    replies: dict[str, list[int]] = field(
        default_factory=dict
    )  # reply id -> its calls (n choices: several)
    memo: dict[str, dict] = field(
        default_factory=dict
    )  # per API: the last request's messages (apis._convert)
    out: Optional[CallsFile] = (
        None  # where its calls go: the file current when it began (set by its first call or a switch)
    )
    flags: list[dict] = field(
        default_factory=list
    )  # what it tried that was refused (README "Sandboxes")


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
        """Options as proxy.py's flags of the same names (``pause_retry_after``: train.py's); see their help.
        ``rollout_tokens`` (train.py): only rollouts opened with :meth:`open_rollout` are served, each under its
        token, and rewards only with :attr:`reward_key`."""
        self.backend, self.tok = backend, tokenizer
        self.max_new_tokens, self.call_timeout, self.api_key = max_new_tokens, call_timeout, api_key
        self.max_requests, self.active, self.pause_retry_after = max_requests, 0, pause_retry_after
        # the EOS set generation stops on: the backend's (HFBackend), or generation_config's and the tokenizer's
        self.renderer = Renderer(
            tokenizer,
            getattr(backend, "eos_ids", None) or eos_ids(tokenizer),
            tool_format,
            keep_history_tokens,
        )
        self.model_name, self.reuse_tokens = model_name, reuse_tokens
        self._compiled: set[str] = (
            set()
        )  # grammars llguidance compiled (_grammar): a harness sends the same ones again
        self.max_body = int(max_body_mb * 2**20)
        self.sessions: dict[str, Session] = {}
        # rollout id -> its URL token; None: any id is served (proxy.py). The reward key never reaches an agent.
        self.tokens: Optional[dict[str, str]] = {} if rollout_tokens else None
        self.reward_key = secrets.token_urlsafe(24) if rollout_tokens else None
        self.sockets: dict[
            str, str
        ] = {}  # a rollout's own Unix socket (its sandbox's only way out) -> its id
        self.failures, self.n_failures = (
            deque(maxlen=100),
            0,
        )  # backend errors (the last 100; all counted): reported, never trained on
        self._out, self._lock = (
            CallsFile(None),
            threading.Lock(),
        )  # set_output runs on the trainer's thread, _record on the loop's
        self._retired: weakref.WeakValueDictionary[str, Session] = (
            weakref.WeakValueDictionary()
        )  # reset()'s sessions a request still holds
        self.set_output(os.path.join(out_dir, "calls.jsonl") if out_dir else None)
        self.rewards_path = (
            os.path.join(out_dir, "rewards.jsonl") if out_dir else None
        )  # rewards POSTed while serving

    # ------------------------------------------------------------------ used by the trainer

    def set_output(self, path: Optional[str]):
        """Append calls to ``path`` from now on (train.py switches files every step). A session's calls, also one
        in flight after the switch, go to the file current when it began; in a file with calls they number on."""
        with self._lock:
            old = self._out
            for s in list(self.sessions.values()) + list(self._retired.values()):
                s.out = s.out or old
            if old.path:  # each call was written (closed) as recorded; a crashed machine loses none of them now
                with open(old.path, "a") as f:
                    os.fsync(f.fileno())
            self._out = CallsFile(path)
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                self._out.next, cut = prepare_append(path)
                if cut:
                    log.warning(
                        f"{path}: cut off a torn last line ({cut} bytes; its writer was killed mid-line) before appending"
                    )
                open(path, "a").close()  # the file exists from now on, even if no call comes

    def open_rollout(self, rollout_id: str) -> str:
        """A new rollout's route, ``<id>.<token>``: its base URL is ``/rollout/<id>.<token>/v1``."""
        self.tokens[rollout_id] = secrets.token_urlsafe(16)
        return f"{rollout_id}.{self.tokens[rollout_id]}"

    def flags(self, rollout_id: str) -> list[dict]:
        return getattr(self.sessions.get(rollout_id) or self._retired.get(rollout_id), "flags", [])

    def reward(self, rollout_id: str) -> Optional[float]:
        return getattr(
            self.sessions.get(rollout_id), "reward", None
        )  # None: no such session, or no reward posted

    def call_rewards(self, rollout_id: str) -> dict[int, float]:
        return getattr(self.sessions.get(rollout_id), "call_rewards", {})

    def reset(self):
        """Forget the sessions (between training steps; rollout ids are not reused). A call still in flight
        keeps its session (its request holds it; _retired finds it, weakly) and is recorded with it."""
        old, self.sessions = self.sessions, {}
        self._retired.update(dict(old))
        self.tokens = (
            None if self.tokens is None else {}
        )  # a straggler of a finished rollout gets a 403

    # ------------------------------------------------------------------ recording

    def _cap(self, req: Request) -> bool:
        """Apply the per-call cap; True when it lowered (or set) what the request asked for."""
        if self.max_new_tokens and (
            req.sampling.max_tokens is None or req.sampling.max_tokens > self.max_new_tokens
        ):
            req.sampling.max_tokens = self.max_new_tokens
            return True
        return False

    def _record(
        self,
        rid: str,
        api: str,
        prompt_ids,
        gen,
        parent,
        split,
        sampling,
        t0,
        reply=None,
        choice=0,
        capped=False,
        reply_id=None,
    ) -> Call:
        s = (
            self.sessions.get(rid)
            or self._retired.get(rid)
            or self.sessions.setdefault(rid, Session())
        )
        # "length" stays "length" even when the cut reply parses as a tool call: the trainer must see truncation
        tool = reply is not None and reply.get("tool_calls") and gen.finish_reason == "stop"
        with self._lock:
            out = s.out = s.out or self._out
            call = Call(  # numbered on after the rollout's calls already in the file
                rollout_id=rid,
                index=out.next.get(rid, 0),
                api=api,
                model_version=gen.version,
                prompt_ids=prompt_ids,
                response_ids=gen.response_ids,
                response_logprobs=gen.logprobs,
                finish_reason="tool_calls" if tool else gen.finish_reason,
                choice=choice,
                capped=capped and gen.finish_reason == "length",
                parent=parent,
                split=split,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                grammar=sampling.grammar,
                created=t0,
                latency_s=round(time.time() - t0, 4),
                response=reply,
                reply_id=reply_id,
            )
            out.next[rid] = call.index + 1
            if reply_id:
                s.replies.setdefault(reply_id, []).append(call.index)
            if out.path:  # a call that extends its parent is written as the ids after the parent's (records.read_calls)
                n = (
                    next(t.size for t in reversed(s.turns) if t.index == parent)
                    if parent is not None
                    else 0
                )
                line = (
                    to_json(call, prompt_ids=None, prompt_tail=call.prompt_ids[n:])
                    if n
                    else to_json(call)
                ) + "\n"
                # Opened per call, so a call still in flight when its session's file was switched goes there too.
                with open(out.path, "a") as f:
                    f.write(line)
        return call

    # ------------------------------------------------------------------ handlers

    def _owner(self, request: web.Request) -> Optional[str]:
        """The rollout whose own Unix socket the request came through, if any: a sandboxed rollout's only way out."""
        return self.sockets.get(
            request.transport.get_extra_info("sockname") if request.transport else None
        )

    def _refuse(self, request: web.Request, what: str):
        """403, and a flag on the rollout that sent it, when its socket tells."""
        if owner := self._owner(request):
            self.sessions.setdefault(owner, Session()).flags.append(
                {
                    "kind": "route",
                    "what": f"{what}: {request.method} {request.path}",
                    "call": None,
                    "where": None,
                    "match": None,
                }
            )
        raise BadRequest(f"{what}: use the base URL this rollout was given", None, "forbidden", 403)

    def _rollout(self, request: web.Request) -> str:
        """The rollout a request is for: its id, checked against its token when the proxy has tokens."""
        rid = _valid(request.match_info.get("rid", "default"))
        if self.tokens is None:
            return rid
        rid, _, token = rid.rpartition(".")
        want = self.tokens.get(rid)
        if want is None or not hmac.compare_digest(token.encode(), want.encode()):
            self._refuse(request, "not a rollout of this run, or a wrong token")
        if (owner := self._owner(request)) not in (None, rid):
            self._refuse(request, f"rollout {owner} used the route of rollout {rid}")
        return rid

    async def _read(self, request: web.Request) -> tuple[str, Any]:
        return self._rollout(request), await self._body(request)

    async def _body(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (
            json.JSONDecodeError,
            UnicodeDecodeError,
            RecursionError,
        ) as e:  # RecursionError: nested too deeply
            raise BadRequest(
                f"the request body is not valid JSON ({e})", None, "invalid_json"
            ) from None

    async def _generate(
        self, rid: str, api: str, prompt_ids: list[int], req: Request, t0: float, on_token=None
    ) -> list:
        """``req.n`` generations for one prompt (choice i samples with seed + i when a seed is set). A backend
        that fails or passes ``call_timeout`` gets the client a 502 or 504; the call is recorded as ``error``."""
        seeded = lambda i: (
            req.sampling
            if req.sampling.seed is None
            else dataclasses.replace(req.sampling, seed=req.sampling.seed + i)
        )  # noqa: E731
        try:
            return await asyncio.wait_for(
                asyncio.gather(
                    *(
                        self.backend.generate(
                            prompt_ids, seeded(i), on_token=on_token, rollout_id=rid
                        )
                        for i in range(req.n)
                    )
                ),
                self.call_timeout,
            )
        except (asyncio.CancelledError, Exception) as e:
            # No answer: the client went away (its generation is cancelled with it) or the backend failed. The
            # calls are recorded as "cancelled" or "error", with an empty response: never trained on.
            cancelled = isinstance(e, asyncio.CancelledError)
            gone = SimpleNamespace(
                response_ids=[],
                logprobs=[],
                finish_reason="cancelled" if cancelled else "error",
                version=self.backend.version,
            )
            for i in range(req.n):
                self._record(rid, api, prompt_ids, gone, None, None, req.sampling, t0, choice=i)
            if cancelled:
                raise
            # the backend failed: report it loudly, answer 502/504
            timeout = isinstance(e, TimeoutError)
            msg = (
                f"the backend did not answer within {self.call_timeout:g} s"
                if timeout
                else f"backend error: {type(e).__name__}: {e}"
            )
            log.error(msg, exc_info=not timeout)
            self.n_failures += 1
            self.failures.append({"time": time.time(), "rollout_id": rid, "error": msg})
            raise BackendError(msg, 504 if timeout else 502) from e

    def _admit(self, prompt_ids: list[int]):
        """May this prompt be served now? Not during a weight sync when calls are told to come back later (429),
        never when it does not fit the model's context (400)."""
        if self.pause_retry_after is not None and self.backend.paused:
            raise BackendError(
                "the policy's weights are being updated; retry shortly", 429, self.pause_retry_after
            )
        limit = self.backend.max_model_len
        if len(prompt_ids) >= limit:
            raise BadRequest(
                f"this model's maximum context length is {limit} tokens, but the prompt has {len(prompt_ids)}; "
                "shorten the conversation",
                "messages",
                "context_length_exceeded",
            )

    def _grammar(self, req) -> Optional[str]:
        """What the reply must follow (grammar.py): the forced call's arguments their tool's schema, a response_format's
        JSON its schema; a schema llguidance cannot compile is a 400 with its message."""
        if req.force_tool is not None:
            g, param = (
                grammar.tool_grammar(self.renderer.format, req.tools, req.force_tool, self.tok),
                "tools",
            )
        elif req.response_schema is not None:
            g, param = grammar.json_grammar(req.response_schema), "response_format"
        else:
            return None
        if g not in self._compiled:
            if err := grammar.check(g, self.tok):
                # llguidance's first line says what (the rest points into the grammar text, which the client never wrote)
                raise BadRequest(
                    f"the {param} JSON schema cannot be enforced: {err.strip().splitlines()[0]}",
                    param,
                    "invalid_schema",
                )
            self._compiled = (self._compiled if len(self._compiled) < 256 else set()) | {g}
        return g

    def _previous(self, session: Session, response_id: str) -> list[dict]:
        if response_id not in session.responses:
            raise BadRequest(
                f"previous_response_id {response_id[:80]!r} is not a response of this rollout",
                "previous_response_id",
                "invalid_value",
                404,
            )
        return session.responses[response_id]

    async def converse(self, request: web.Request, api: str):
        """chat completions, Anthropic messages and Responses: one conversation, one path."""
        rid, body = await self._read(request)
        session = self.sessions.setdefault(rid, Session())
        memo = session.memo.setdefault(api, {})  # converts only the messages a request appends
        if api == "chat":  # the request, and the writer of its answer
            req, writer = (
                apis.parse_chat_request(body, memo),
                functools.partial(apis.ChatReply, tok=self.tok),
            )
        elif api == "anthropic":
            req, writer = apis.parse_anthropic_request(body, memo), apis.AnthropicReply
        else:
            req = apis.parse_responses_request(body, lambda rsp: self._previous(session, rsp), memo)
            writer = functools.partial(
                apis.ResponsesReply, previous_id=body.get("previous_response_id")
            )
        t0, capped = time.time(), self._cap(req)
        fps = fingerprints(
            req.messages, req.tools, session.turns[-1] if session.turns else None
        )  # hashes the new messages only
        prompt_ids, parent, hint = self.renderer.build_prompt(
            req.messages, req.tools, session.turns, self.reuse_tokens, fps, req.template_kwargs
        )
        opened = self.renderer.opens_reasoning(
            prompt_ids
        )  # the generation prompt opened a reasoning block
        forced = self.renderer.forced_prefix(
            req.force_tool, opened, req.response_schema is not None
        )
        req.sampling.grammar = self._grammar(req)
        prompt_ids = prompt_ids + self.renderer.encode(forced) if forced else prompt_ids
        self._admit(prompt_ids)
        out = writer(req, self.model_name, len(prompt_ids))
        resp, stream = (
            None,
            ContentStream(self.renderer, req.sampling.stop, req.parse_tools, forced, opened),
        )
        if req.stream:
            resp = await _sse_start(request, out.start())
        try:
            queue: asyncio.Queue = asyncio.Queue()
            on_token = (
                queue.put_nowait if req.stream and req.n == 1 else None
            )  # one choice streams live
            task = asyncio.ensure_future(
                self._generate(rid, api, prompt_ids, req, t0, on_token=on_token)
            )
            task.add_done_callback(
                lambda _: queue.put_nowait(None)
            )  # after every id: same loop, in order
            ids = []
            try:
                while (t := await queue.get()) is not None:
                    ids.append(t)
                    reasoning, content = stream.feed(ids)
                    if reasoning:
                        await resp.write(out.reasoning(reasoning))
                    if content:
                        await resp.write(out.text(content))
            finally:
                task.cancel()  # a no-op when it is done; the client went away otherwise
            gens = await task
        except BackendError as e:
            if resp is None:
                raise
            await resp.write(out.error(str(e)))  # the stream has begun: the error goes in it
            return resp
        except (
            ConnectionResetError
        ):  # the client left mid-stream; its generation was cancelled above
            return resp
        answers = []
        for i, gen in enumerate(gens):
            reply = self.renderer.parse_reply(
                forced + self.renderer.sampled_text(gen.response_ids, req.sampling.stop),
                req.parse_tools,
                opened,
            )
            call = self._record(
                rid,
                api,
                prompt_ids,
                gen,
                parent,
                hint,
                req.sampling,
                t0,
                reply,
                choice=i,
                capped=capped,
                reply_id=out.id,
            )
            session.turns.append(
                Turn(
                    call.index,
                    req.messages,
                    req.tools,
                    reply,
                    call.prompt_ids,
                    call.response_ids,
                    fps,
                    forced,
                    session.turns,
                    parent,
                )
            )
            answers.append((call, reply))
        if (
            api == "responses"
        ):  # for previous_response_id; a new request's instructions replace these
            session.responses[out.id] = req.messages[req.n_instructions :] + [answers[0][1]]
        if resp is None:
            return web.json_response(out.body(answers))
        await resp.write(
            out.end(answers, stream.sent, stream.reasoning)
        )  # what was not streamed live
        return resp

    async def count_tokens(self, request: web.Request):
        req = apis.parse_anthropic_request((await self._read(request))[1])
        return web.json_response(
            {"input_tokens": len(self.renderer.build_prompt(req.messages, req.tools, [])[0])}
        )

    async def completions(self, request: web.Request):
        rid, body = await self._read(request)
        req = apis.parse_completions_request(body)
        prompt_ids = (
            req.prompt_ids if req.prompt_ids is not None else self.tok.encode(req.prompt_text)
        )
        vocab = len(self.tok)
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt", "invalid_value")
        self._admit(prompt_ids)
        t0, capped = time.time(), self._cap(req)
        session = self.sessions.setdefault(
            rid, Session()
        )  # held while in flight: a reset leaves it to this call (_record)
        gens = await self._generate(rid, "completions", prompt_ids, req, t0)
        out = apis.CompletionsReply(req, self.model_name, len(prompt_ids), self.tok)
        answers = [
            (
                self._record(
                    rid,
                    "completions",
                    prompt_ids,
                    gen,
                    None,
                    None,
                    req.sampling,
                    t0,
                    choice=i,
                    capped=capped,
                    reply_id=out.id,
                ),
                gen.text,
            )
            for i, gen in enumerate(gens)
        ]
        del session  # recorded with it
        if not req.stream:
            return web.json_response(out.body(answers))
        return await _sse_start(request, out.end(answers))

    async def post_reward(self, request: web.Request):
        rid = _valid(request.match_info["rid"])
        if self.reward_key is not None and not hmac.compare_digest(
            request.headers.get("X-Reward-Key", "").encode(), self.reward_key.encode()
        ):
            self._refuse(
                request, "rewards come from the harness (header X-Reward-Key), never from the agent"
            )
        if self.tokens is not None and rid not in self.tokens:
            raise BadRequest(f"no rollout {rid[:64]!r} in this run", None, "not_found", 404)
        body = await self._body(request)
        body = body if isinstance(body, dict) else {"reward": body}
        r, k, task = body.get("reward"), body.get("call"), body.get("task")
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r):
            raise BadRequest(
                'send {"reward": <number>} (and "call": a call\'s index or reply id, to reward one call)',
                "reward",
                "invalid_type",
            )
        if task is not None and not isinstance(task, str) or set(body) - {"reward", "call", "task"}:
            raise BadRequest(
                "a reward has the keys reward, call (a call's index or reply id) and task (a string: rollouts of one task "
                "form one advantage group under train.py --from-calls)",
                None,
                "invalid_value",
            )
        s = self.sessions.setdefault(rid, Session())
        if (
            k is not None
        ):  # a call of this rollout: by index (in its calls file) or by the id its reply had
            n = (s.out or self._out).next.get(rid, 0)
            ids = (
                [k]
                if isinstance(k, int) and not isinstance(k, bool) and 0 <= k < n
                else s.replies.get(k)
                if isinstance(k, str)
                else None
            )
            if not ids or len(ids) > 1:
                raise BadRequest(
                    f"rollout {rid!r} has no call {k!r}: name it by its index (0..{n - 1}) or by the id of its reply "
                    "(a reply of n choices: by index)"
                    + (
                        ", ids of replies before a proxy restart by index"
                        if isinstance(k, str)
                        else ""
                    ),
                    "call",
                    "not_found",
                    404,
                )
            k = ids[0]
            s.call_rewards[k] = float(r)
        else:
            s.reward = float(r)
        line = {
            "rollout_id": rid,
            "reward": float(r),
            **({"call": k} if k is not None else {}),
            **({"task": task} if task else {}),
            "time": time.time(),
        }
        if (
            self.rewards_path
        ):  # proxy.py: the rewards land next to the calls (train.py --from-calls reads both)
            with self._lock, open(self.rewards_path, "a") as f:
                f.write(json.dumps(line) + "\n")
        return web.json_response({k: v for k, v in line.items() if k != "time"})

    async def models(self, request: web.Request):
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "lightning-lite",
                        "max_model_len": self.backend.max_model_len,
                    }
                ],
            }
        )

    async def health(self, request: web.Request):
        return web.json_response(
            {
                "status": "ok",
                "model": self.model_name,
                "version": self.backend.version,
                "backend_failures": self.n_failures,
                **self.backend.stats,
            }
        )

    # ------------------------------------------------------------------ app

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        """Every route: the API key when one is set, the bound on requests at once; every 4xx/5xx carries an
        error body in the API's own format, and the server keeps serving."""
        api = "anthropic" if "/v1/messages" in request.path else "openai"
        auth = request.headers.get("Authorization", "")
        key = (
            auth[7:].strip()
            if auth[:7].lower() == "bearer "
            else request.headers.get("x-api-key", "")
        )
        if self.api_key and not hmac.compare_digest(key.encode(), self.api_key.encode()):
            msg = "missing or wrong API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
            return _error(api, 401, msg, code="invalid_api_key")
        if self.active >= self.max_requests:
            msg = f"the proxy is handling {self.active} requests (its limit); retry shortly"
            return _error(api, 429, msg, code="too_many_requests", retry_after=1)
        self.active += 1
        try:
            return await handler(request)
        except BadRequest as e:
            return _error(api, e.status, e.message, e.param, e.code)
        except BackendError as e:
            return _error(api, e.status, str(e), retry_after=e.retry_after)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            where = f"{request.method} {request.path}"
            msg, code = {
                404: (
                    f"no route {where}; see GET /v1/models and the README for the routes",
                    "not_found",
                ),
                405: (
                    f"method {request.method} is not allowed on {request.path}",
                    "method_not_allowed",
                ),
                413: (f"request body too large (limit {self.max_body} bytes)", "request_too_large"),
            }.get(e.status, (e.reason, None))
            return _error(api, e.status, msg, code=code)
        finally:
            self.active -= 1

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[self._guard])
        for prefix in ("", "/rollout/{rid}"):
            app.router.add_post(
                prefix + "/v1/chat/completions", functools.partial(self.converse, api="chat")
            )
            app.router.add_post(
                prefix + "/v1/messages", functools.partial(self.converse, api="anthropic")
            )  # ?beta=true too
            app.router.add_post(prefix + "/v1/messages/count_tokens", self.count_tokens)
            app.router.add_post(
                prefix + "/v1/responses", functools.partial(self.converse, api="responses")
            )
            app.router.add_post(prefix + "/v1/completions", self.completions)
            app.router.add_get(
                prefix or "/", self.health
            )  # GET and HEAD: harnesses probe their base URL (Claude Code)
            app.router.add_get(prefix + "/v1/models", self.models)
            app.router.add_get(prefix + "/health", self.health)
        app.router.add_post("/rollout/{rid}/reward", self.post_reward)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app):
        self.set_output(None)  # the last calls file is fsync'd


# ---------------------------------------------------------------------- helpers


class BackendError(Exception):
    """The backend failed a call (502), timed out (504) or is paused for a weight sync (429, before any stream
    begins): an error body, or an error event in a begun stream."""

    def __init__(self, message: str, status: int = 502, retry_after: Optional[float] = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


def _error(
    api: str, status: int, message: str, param=None, code=None, retry_after=None
) -> web.Response:
    if api == "anthropic":
        kind = {
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            413: "request_too_large",
            429: "rate_limit_error",
            504: "timeout_error",
        }.get(status, "api_error" if status >= 500 else "invalid_request_error")
    else:
        kind = (
            "rate_limit_error"
            if status == 429
            else "server_error"
            if status >= 500
            else "invalid_request_error"
        )
    return web.json_response(
        apis.error_body(api, message, kind, param, code),
        status=status,
        headers={"Retry-After": f"{retry_after:g}"} if retry_after else None,
    )


async def _sse_start(request: web.Request, first: bytes) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    await resp.write(first)
    return resp


class ProxyServer:
    """Runs a :class:`Proxy` on its own event loop in a background thread (for train.py and tests).

    >>> srv = ProxyServer(proxy, port=0).start(); srv.url   # 'http://127.0.0.1:40123'
    >>> srv.stop()
    """

    def __init__(self, proxy: Proxy, host: str = "127.0.0.1", port: int = 0):
        self.proxy, self.host, self.port = proxy, host, port
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="proxy", daemon=True)
        self._runner, self._sites, self._socket_dir, self._n_sockets = None, {}, None, 0

    def open_socket(self, rollout_id: str) -> str:
        """A Unix socket of the proxy that only ``rollout_id`` uses (its sandbox's bridge connects to it), so that
        whatever comes through it is that rollout's doing. Short paths: a socket path has at most 107 bytes."""
        self._socket_dir = self._socket_dir or tempfile.mkdtemp(prefix="ll-proxy-")
        path, self._n_sockets = (
            os.path.join(self._socket_dir, f"{self._n_sockets}.sock"),
            self._n_sockets + 1,
        )
        site = web.UnixSite(self._runner, path)
        asyncio.run_coroutine_threadsafe(site.start(), self.loop).result()
        self._sites[rollout_id], self.proxy.sockets[path] = (site, path), rollout_id
        return path

    def close_sockets(self, rollout_ids):
        for rid in rollout_ids:
            if rid in self._sites:
                site, path = self._sites.pop(rid)
                asyncio.run_coroutine_threadsafe(site.stop(), self.loop).result()
                del self.proxy.sockets[path]
                os.unlink(path)

    def base_url(self, rollout_id: str) -> str:
        return f"{self.url}/rollout/{rollout_id}/v1"

    def endpoint(
        self, rollout_id: str, model: str, socket: bool = False, api_key: str = "sk-lightning-lite"
    ) -> Endpoint:
        """A new rollout's endpoint: its base URL carries a token only it knows (with ``rollout_tokens``); ``socket``:
        a Unix socket of its own too, for a sandbox to bridge."""
        route = self.proxy.open_rollout(rollout_id) if self.proxy.tokens is not None else rollout_id
        return Endpoint(
            self.base_url(route),
            api_key,
            model,
            rollout_id,
            self.url,
            route,
            self.proxy.reward_key or "",
            self.open_socket(rollout_id) if socket else None,
        )

    def start(self) -> "ProxyServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()
        return self

    async def _start(self):
        self._runner = web.AppRunner(
            self.proxy.app(), access_log=None, handler_cancellation=True
        )  # a client that leaves cancels its call
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"

    def stop(self):
        self.close_sockets(list(self._sites))
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result()
            self._runner = None
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
