"""/v1/completions: a prompt (text or token ids) in, its continuation out, no chat template. Its
hook, filled at the bottom: the route ``"/v1/completions"`` in hooks.ROUTES. Each choice is recorded
as its own call."""

import re
from typing import Any

from aiohttp import web

from .. import hooks
from ..apis import client_finish, expect, json_object, openai_head, openai_settings, sse, usage
from ..chat import BadRequest, Request
from ..proxy import Exchange, sse_start


def parse_completions_request(body: Any) -> Request:
    """Validate a /v1/completions body: the prompt is a string or a list of token ids."""
    body = json_object(body)
    prompt = body.get("prompt")
    # a batch of one
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    req = Request(**openai_settings(body), logprobs=body.get("logprobs") is not None)
    expect(not body.get("echo"), "'echo' is not supported", "echo")
    # type(t) is int: a JSON true is no token id
    is_ids = isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
    message = "'prompt' must be a non-empty string or a non-empty list of token ids (one prompt per request)"
    expect(isinstance(prompt, str) or is_ids, message, "prompt")
    text = isinstance(prompt, str)
    req.prompt_text, req.prompt_ids = (prompt, None) if text else (None, list(prompt))
    return req


async def complete(proxy, request: web.Request):
    """The route: parse -> the prompt's ids -> generate -> record -> reply (a stream is sent once
    generated)."""
    rollout_id, body = await proxy.read(request)
    req = parse_completions_request(body)
    prompt_ids = req.prompt_ids if req.prompt_ids is not None else proxy.tok.encode(req.prompt_text)
    vocab = len(proxy.tok)
    if any(t < 0 or t >= vocab for t in prompt_ids):
        raise BadRequest(f"prompt token ids must be in [0, {vocab})", "prompt", "invalid_value")
    proxy.admit(prompt_ids)
    session = proxy.session(rollout_id)
    exchange = Exchange(rollout_id, session, "completions", req, proxy.cap(req), prompt_ids)
    generations = await proxy.generate(exchange)
    writer = CompletionsReply(req, proxy.model_name, len(prompt_ids), proxy.tok)
    answers = [
        (proxy.record(exchange, gen, i, reply_id=writer.id), gen.text)
        for i, gen in enumerate(generations)
    ]
    if not req.stream:
        return web.json_response(writer.body(answers))
    return await sse_start(request, writer.end(answers))


class CompletionsReply:
    """/v1/completions: ``answers`` are (call, text) pairs; a stream is sent once generated, in
    word-sized pieces."""

    def __init__(self, req: Request, model: str, n_prompt: int, tok=None):
        self.req, self.n_prompt, self.tok = req, n_prompt, tok
        self.head = openai_head("text_completion", "cmpl", req, model)
        self.id = self.head["id"]

    def body(self, answers) -> dict:
        choices = []
        for call, text in answers:
            logprobs = None
            if self.req.logprobs:
                tokens = [self.tok.decode([t]) for t in call.response_ids]
                logprobs = {"tokens": tokens, "token_logprobs": call.response_logprobs}
            choice = {"index": call.choice, "text": text, "finish_reason": client_finish(call, {})}
            choices.append({**choice, "logprobs": logprobs})
        return {**self.head, "choices": choices, "usage": usage(self.n_prompt, answers)}

    def _chunk(self, index: int, text: str, finish=None) -> bytes:
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        return sse({**self.head, "choices": [choice]})

    def end(self, answers) -> bytes:
        out = []
        for call, text in answers:
            pieces = re.findall(r"\s*\S+|\s+", text or "")
            out += [self._chunk(call.choice, piece) for piece in pieces]
            out.append(self._chunk(call.choice, "", client_finish(call, {})))
        if self.req.include_usage:
            out.append(sse({**self.head, "choices": [], "usage": usage(self.n_prompt, answers)}))
        return b"".join(out) + b"data: [DONE]\n\n"


hooks.ROUTES["/v1/completions"] = complete
