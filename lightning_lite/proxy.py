"""The proxy: an OpenAI-compatible HTTP endpoint that serves the policy and records every call.

Harnesses talk to ``http://HOST:PORT/rollout/<rollout_id>/v1`` (or plain
``/v1``, recorded under rollout id ``default``). For each request the proxy

1. validates and normalizes it (chat.py), 4xx with an OpenAI error body if bad;
2. builds the prompt ids itself, reusing the tokens sampled in an earlier call
   of the same rollout when the conversation extends it (chat.Renderer);
3. asks the backend for response ids + logprobs (token ids in, token ids out);
4. appends a :class:`Call` to ``calls.jsonl`` *before* the answer is sent, so
   every answered call is on disk even if the process dies right after;
5. answers as JSON or as a server-sent-event stream.

The trainer drives it in-process (``ProxyServer``), pausing the backend around
weight updates; ``python proxy.py`` serves it on its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from aiohttp import web

from .chat import BadRequest, Renderer, Request, Turn, parse_chat_request, parse_completions_request
from .records import Call, to_json

log = logging.getLogger("lightning_lite.proxy")
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


@dataclass
class Session:
    """What the proxy knows about one rollout."""

    turns: list[Turn] = field(default_factory=list)
    n_calls: int = 0
    reward: Optional[float] = None


class Proxy:
    def __init__(self, backend, tokenizer, model_name: str = "smollm2", out_dir: Optional[str] = None, reuse_tokens: bool = True, max_body_mb: float = 32.0):
        self.backend, self.tok = backend, tokenizer
        self.renderer = Renderer(tokenizer)
        self.model_name = model_name
        self.reuse_tokens = reuse_tokens
        self.max_body = int(max_body_mb * 2**20)
        self.sessions: dict[str, Session] = {}
        self.calls: list[Call] = []  # answered since the last take_calls()
        self.failures: list[dict] = []  # backend errors: reported, never trained on
        self._file = None
        self.set_output(os.path.join(out_dir, "calls.jsonl") if out_dir else None)

    # ------------------------------------------------------------------ used by the trainer

    def set_output(self, path: Optional[str]):
        """Append calls to ``path`` from now on (train.py switches files every step)."""
        if self._file:
            self._file.close()
        self._file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a")

    def take_calls(self) -> list[Call]:
        calls, self.calls = self.calls, []
        return calls

    def reward(self, rollout_id: str) -> Optional[float]:
        s = self.sessions.get(rollout_id)
        return s.reward if s else None

    def reset(self):
        """Forget the sessions (between training steps; rollout ids are not reused)."""
        self.sessions.clear()

    def close(self):
        self.set_output(None)

    # ------------------------------------------------------------------ recording

    def _record(self, rid: str, api: str, prompt_ids, gen, parent, hint, sampling, t0, reply=None) -> Call:
        s = self.sessions.setdefault(rid, Session())
        call = Call(
            rollout_id=rid, index=s.n_calls, api=api, model_version=gen.version, prompt_ids=list(prompt_ids),
            response_ids=gen.response_ids, response_logprobs=gen.logprobs,
            finish_reason="tool_calls" if reply and reply.get("tool_calls") else gen.finish_reason,
            parent=parent, split_hint=hint, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            created=t0, latency_s=round(time.time() - t0, 4), response=reply,
        )
        s.n_calls += 1
        if self._file:
            self._file.write(to_json(call) + "\n")
            self._file.flush()
        self.calls.append(call)
        return call

    # ------------------------------------------------------------------ handlers

    async def _json(self, request: web.Request):
        raw = await request.read()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON ({e})", None, "invalid_json") from None

    def _rollout(self, request: web.Request) -> str:
        rid = request.match_info.get("rid", "default")
        if not ROLLOUT_ID.match(rid):
            raise BadRequest(f"invalid rollout id {rid[:64]!r}: use 1-128 characters of [A-Za-z0-9._-]", None, "invalid_rollout_id")
        return rid

    async def _generate(self, prompt_ids: list[int], req: Request):
        limit = self.backend.max_model_len
        if len(prompt_ids) >= limit:
            raise BadRequest(
                f"this model's maximum context length is {limit} tokens, but the prompt has {len(prompt_ids)}; shorten the conversation",
                "messages", "context_length_exceeded",
            )
        try:
            return await self.backend.generate(prompt_ids, req.sampling)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the backend failed: report it loudly, answer 500, record nothing
            log.exception("backend failed")
            self.failures.append({"time": time.time(), "error": f"{type(e).__name__}: {e}"})
            raise web.HTTPInternalServerError(reason="backend error", text=json.dumps(_error(f"backend error: {type(e).__name__}: {e}", "server_error")), content_type="application/json")

    async def chat(self, request: web.Request):
        rid = self._rollout(request)
        req = parse_chat_request(await self._json(request))
        t0 = time.time()
        turns = self.sessions.setdefault(rid, Session()).turns
        prompt_ids, parent, hint = self.renderer.build_prompt(req.messages, req.tools, turns, self.reuse_tokens)
        forced = self.renderer.forced_prefix(req.force_tool)
        prompt_ids = prompt_ids + self.renderer.encode(forced) if forced else prompt_ids
        gen = await self._generate(prompt_ids, req)
        reply = self.renderer.parse_reply(forced + gen.text, req.parse_tools)
        call = self._record(rid, "chat", prompt_ids, gen, parent, hint, req.sampling, t0, reply)
        turns.append(Turn(call.index, req.messages, req.tools, reply, call.prompt_ids, call.response_ids))
        return await self._respond_chat(request, req, call, reply)

    async def completions(self, request: web.Request):
        rid = self._rollout(request)
        req = parse_completions_request(await self._json(request))
        prompt_ids = req.prompt_ids if req.prompt_ids is not None else self.tok.encode(req.prompt_text)
        vocab = len(self.tok)
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt", "invalid_value")
        t0 = time.time()
        gen = await self._generate(prompt_ids, req)
        call = self._record(rid, "completions", prompt_ids, gen, None, None, req.sampling, t0)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(t0), "model": req.model or self.model_name}
        usage = _usage(call)
        choice = {"index": 0, "text": gen.text, "finish_reason": call.finish_reason, "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = {"tokens": [self.tok.decode([t]) for t in call.response_ids], "token_logprobs": call.response_logprobs}
        if not req.stream:
            return web.json_response({**head, "choices": [choice], "usage": usage})
        resp = await _sse_start(request)
        for piece in _pieces(gen.text):
            await _sse(resp, {**head, "choices": [{"index": 0, "text": piece, "finish_reason": None, "logprobs": None}]})
        await _sse(resp, {**head, "choices": [{"index": 0, "text": "", "finish_reason": call.finish_reason, "logprobs": None}]})
        if req.include_usage:
            await _sse(resp, {**head, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _respond_chat(self, request, req: Request, call: Call, reply: dict):
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(call.created), "model": req.model or self.model_name}
        tool_calls = [{"id": t["id"], "type": "function", "function": {"name": t["name"], "arguments": t["arguments"]}} for t in reply.get("tool_calls", [])]
        usage = _usage(call)
        if not req.stream:
            msg = {"role": "assistant", "content": reply["content"] if (reply["content"] or not tool_calls) else None}
            if tool_calls:
                msg["tool_calls"] = tool_calls
            choice = {"index": 0, "message": msg, "finish_reason": call.finish_reason, "logprobs": None}
            if req.logprobs:
                choice["logprobs"] = {"content": [_token_logprob(self.tok, t, lp) for t, lp in zip(call.response_ids, call.response_logprobs)]}
            return web.json_response({**head, "object": "chat.completion", "choices": [choice], "usage": usage})
        head["object"] = "chat.completion.chunk"
        resp = await _sse_start(request)
        await _sse(resp, {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        for piece in _pieces(reply["content"]):
            await _sse(resp, {**head, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
        for i, tc in enumerate(tool_calls):
            await _sse(resp, {**head, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": i, **tc}]}, "finish_reason": None}]})
        await _sse(resp, {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": call.finish_reason}]})
        if req.include_usage:
            await _sse(resp, {**head, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def post_reward(self, request: web.Request):
        rid = self._rollout(request)
        body = await self._json(request)
        r = body.get("reward") if isinstance(body, dict) else body
        if not isinstance(r, (int, float)) or isinstance(r, bool) or r != r:
            raise BadRequest("send {\"reward\": <number>}", "reward", "invalid_type")
        self.sessions.setdefault(rid, Session()).reward = float(r)
        return web.json_response({"rollout_id": rid, "reward": float(r)})

    async def models(self, request: web.Request):
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "lightning-lite", "max_model_len": self.backend.max_model_len}]})

    async def root(self, request: web.Request):
        return web.json_response({"status": "ok", "model": self.model_name})

    async def health(self, request: web.Request):
        return web.json_response({"status": "ok", "model": self.model_name, "version": self.backend.version,
                                  "backend_failures": len(self.failures), **self.backend.stats})

    # ------------------------------------------------------------------ app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[_errors])
        for prefix in ("", "/rollout/{rid}"):
            app.router.add_post(prefix + "/v1/chat/completions", self.chat)
            app.router.add_post(prefix + "/v1/completions", self.completions)
            app.router.add_get(prefix + "/v1/models", self.models)
            app.router.add_get(prefix + "/health", self.health)
        app.router.add_post("/rollout/{rid}/reward", self.post_reward)
        app.router.add_get("/", self.root)  # GET and HEAD: harnesses probe the root (Claude Code)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app):
        self.close()


# ---------------------------------------------------------------------- helpers


def _error(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@web.middleware
async def _errors(request: web.Request, handler):
    """Every 4xx carries an OpenAI-style error body; the server keeps serving."""
    try:
        return await handler(request)
    except BadRequest as e:
        return web.json_response(_error(e.message, "invalid_request_error", e.param, e.code), status=e.status)
    except web.HTTPException as e:
        if e.status < 400 or e.content_type == "application/json":
            raise
        msg = {404: f"no route {request.method} {request.path}; see GET /v1/models and the README for the routes",
               405: f"method {request.method} is not allowed on {request.path}",
               413: f"request body too large (limit {request.app._client_max_size} bytes)"}.get(e.status, e.reason)
        return web.json_response(_error(msg, "invalid_request_error", None, {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)), status=e.status)


def _usage(call: Call) -> dict:
    p, c = len(call.prompt_ids), len(call.response_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _token_logprob(tok, t: int, lp: float) -> dict:
    s = tok.decode([t])
    return {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}


def _pieces(text: str) -> list[str]:
    """Split text into word-sized stream deltas (generation finishes before streaming starts)."""
    return re.findall(r"\s*\S+|\s+", text or "")


async def _sse_start(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _sse(resp: web.StreamResponse, obj: dict):
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


class ProxyServer:
    """Runs a :class:`Proxy` on its own event loop in a background thread (for train.py and tests).

    >>> srv = ProxyServer(proxy, port=0).start(); srv.url   # 'http://127.0.0.1:40123'
    >>> srv.stop()
    """

    def __init__(self, proxy: Proxy, host: str = "127.0.0.1", port: int = 0):
        self.proxy, self.host, self.port = proxy, host, port
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="proxy", daemon=True)
        self._runner = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, rollout_id: str) -> str:
        return f"{self.url}/rollout/{rollout_id}/v1"

    def start(self) -> "ProxyServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()
        return self

    async def _start(self):
        self._runner = web.AppRunner(self.proxy.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def stop(self):
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result()
            self._runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
