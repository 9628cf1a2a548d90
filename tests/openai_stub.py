"""A scripted OpenAI-compatible chat server for tests: no model, no GPU, ~1 ms a call.

    async with StubServer(lambda rollout_id, body, n: {"content": "ANSWER: 7"}) as stub:
        endpoint = stub.endpoint("r1")   # base_url http://127.0.0.1:PORT/rollout/r1/v1
        ...
        stub.requests   # [(rollout_id, authorization header, request body), ...]
        stub.rewards    # {rollout_id: reward} from POST /rollout/<id>/reward

``reply(rollout_id, body, n)`` gets the n-th (0-based) request of that rollout and
returns the assistant message (``content`` and/or ``tool_calls``).
"""

from __future__ import annotations

import json
from collections import Counter

from aiohttp import web

from lightning_lite.harness import Endpoint


def tool_call(name: str, arguments, call_id: str = "call_0") -> dict:
    """An OpenAI tool call; ``arguments`` may be a dict or a raw (even malformed) string."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


class StubServer:
    def __init__(self, reply):
        self.reply = reply
        self.requests: list[tuple[str, str, dict]] = []
        self.rewards: dict[str, float] = {}
        self._count: Counter = Counter()

    async def _chat(self, request: web.Request) -> web.Response:
        rollout_id = request.match_info.get("rid", "default")
        body = await request.json()
        self.requests.append((rollout_id, request.headers.get("Authorization", ""), body))
        message = {
            "role": "assistant",
            "content": None,
            **self.reply(rollout_id, body, self._count[rollout_id]),
        }
        self._count[rollout_id] += 1
        return web.json_response(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": body.get("model", "stub"),
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def _reward(self, request: web.Request) -> web.Response:
        self.rewards[request.match_info["rid"]] = float((await request.json())["reward"])
        return web.json_response({"ok": True})

    async def __aenter__(self) -> "StubServer":
        app = web.Application()
        app.router.add_post("/rollout/{rid}/v1/chat/completions", self._chat)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/rollout/{rid}/reward", self._reward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)  # port 0: the OS picks a free one
        await site.start()
        self.url = "http://127.0.0.1:%d" % self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()

    def endpoint(
        self, rollout_id: str, api_key: str = "sk-test", model: str = "stub-model"
    ) -> Endpoint:
        return Endpoint(
            base_url=f"{self.url}/rollout/{rollout_id}/v1",
            api_key=api_key,
            model=model,
            rollout_id=rollout_id,
            server_url=self.url,
        )
