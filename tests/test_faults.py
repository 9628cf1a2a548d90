"""Faults, load and hostile input: the proxy answers in the API's own format, records every call once
(answered, failed or cancelled), never trains on what was not answered, and keeps serving."""

import asyncio
import concurrent.futures
import gc
import json
import os
import re
import resource
import time
import tracemalloc

import aiohttp
import pytest
import requests

from test_proxy import TOOLS

from lightning_lite.backends import Generation
from lightning_lite.harness import RolloutResult, fail_rollouts_the_backend_failed
from lightning_lite.proxy import Proxy, ProxyServer
from lightning_lite.records import full_prompt, read_calls, read_jsonl
from lightning_lite.samples import build_batch_samples

# ---------------------------------------------------------------------------- bad input

CHAT, MSG, RSP, CMPL = "/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions"
GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
AGOOD = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
LONG = "hello " * 9000  # over the embedded model's 8,192 tokens
BAD = [  # name, path, body (dict or raw bytes), status, code (OpenAI routes) or error type (Anthropic routes)
    ("invalid json", CHAT, b"{not json", 400, "invalid_json"),
    (
        "invalid utf-8",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
        "invalid_json",
    ),
    ("body not an object", CHAT, b"[1, 2]", 400, "invalid_request"),
    ("empty body", CHAT, b"", 400, "invalid_json"),
    ("messages not a list", CHAT, {"messages": "hi"}, 400, "invalid_type"),
    ("empty messages", CHAT, {"messages": []}, 400, "invalid_value"),
    ("message not an object", CHAT, {"messages": ["hi"]}, 400, "invalid_type"),
    (
        "content wrong type",
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "invalid_type",
    ),
    (
        "unknown role",
        CHAT,
        {"messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "invalid_value",
    ),
    (
        "image part",
        CHAT,
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        400,
        "unsupported_content",
    ),
    ("temperature wrong type", CHAT, dict(GOOD, temperature="hot"), 400, "invalid_type"),
    ("temperature out of range", CHAT, dict(GOOD, temperature=7), 400, "invalid_value"),
    (
        "temperature NaN",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
        "invalid_value",
    ),
    ("top_p out of range", CHAT, dict(GOOD, top_p=1.5), 400, "invalid_value"),
    ("max_tokens zero", CHAT, dict(GOOD, max_tokens=0), 400, "invalid_value"),
    ("max_tokens negative", CHAT, dict(GOOD, max_tokens=-5), 400, "invalid_value"),
    ("max_tokens wrong type", CHAT, dict(GOOD, max_tokens="10"), 400, "invalid_type"),
    (
        "max_tokens infinite",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}',
        400,
        "invalid_type",
    ),
    ("n too large", CHAT, dict(GOOD, n=1000), 400, "invalid_value"),
    ("n zero", CHAT, dict(GOOD, n=0), 400, "invalid_value"),
    ("stop wrong type", CHAT, dict(GOOD, stop=5), 400, "invalid_type"),
    ("tools not a list", CHAT, dict(GOOD, tools={"type": "function"}), 400, "invalid_type"),
    (
        "unknown tool_choice",
        CHAT,
        dict(GOOD, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        400,
        "invalid_value",
    ),
    ("deeply nested json", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
    (
        "prompt too long",
        CHAT,
        {"messages": [{"role": "user", "content": LONG}]},
        400,
        "context_length_exceeded",
    ),
    (
        "oversized body",
        CHAT,
        {"messages": [{"role": "user", "content": "x" * (2 * 2**20)}]},
        413,
        "request_too_large",
    ),
    ("completion prompt ids out of vocab", CMPL, {"prompt": [1, 2, 10**9]}, 400, "invalid_value"),
    ("completion prompt missing", CMPL, {"max_tokens": 3}, 400, "invalid_type"),
    ("completion prompt wrong type", CMPL, {"prompt": 5}, 400, "invalid_type"),
    ("completion n wrong type", CMPL, {"prompt": "hi", "n": "2"}, 400, "invalid_type"),
    ("completion prompt too long", CMPL, {"prompt": LONG}, 400, "context_length_exceeded"),
    ("anthropic invalid json", MSG, b"{", 400, "invalid_request_error"),
    (
        "anthropic messages not a list",
        MSG,
        dict(AGOOD, messages="hi"),
        400,
        "invalid_request_error",
    ),
    (
        "anthropic unknown role",
        MSG,
        dict(AGOOD, messages=[{"role": "tool", "content": "hi"}]),
        400,
        "invalid_request_error",
    ),
    (
        "anthropic image block",
        MSG,
        dict(AGOOD, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
        400,
        "invalid_request_error",
    ),
    ("anthropic system wrong type", MSG, dict(AGOOD, system=5), 400, "invalid_request_error"),
    (
        "anthropic max_tokens wrong type",
        MSG,
        dict(AGOOD, max_tokens="many"),
        400,
        "invalid_request_error",
    ),
    (
        "anthropic prompt too long",
        MSG,
        dict(AGOOD, messages=[{"role": "user", "content": LONG}]),
        400,
        "invalid_request_error",
    ),
    (
        "anthropic count_tokens bad body",
        MSG + "/count_tokens",
        {"messages": 5},
        400,
        "invalid_request_error",
    ),
    (
        "anthropic oversized body",
        MSG,
        dict(AGOOD, system="x" * (2 * 2**20)),
        413,
        "request_too_large",
    ),
    ("responses input wrong type", RSP, {"input": 5}, 400, "invalid_type"),
    ("responses unknown item type", RSP, {"input": [{"type": "hologram"}]}, 400, "invalid_value"),
    (
        "responses unknown previous_response_id",
        RSP,
        {"input": "hi", "previous_response_id": "resp_nope"},
        404,
        "invalid_value",
    ),
    (
        "responses max_output_tokens zero",
        RSP,
        {"input": "hi", "max_output_tokens": 0},
        400,
        "invalid_value",
    ),
    (
        "responses instructions wrong type",
        RSP,
        {"input": "hi", "instructions": 5},
        400,
        "invalid_type",
    ),
    ("unsafe rollout id", "/rollout/..%2F..%2Fetc" + CHAT, GOOD, 400, "invalid_rollout_id"),
    ("rollout id with a slash", "/rollout/a%2Fb" + CHAT, GOOD, 400, "invalid_rollout_id"),
    ("rollout id too long", "/rollout/" + "a" * 200 + CHAT, GOOD, 400, "invalid_rollout_id"),
    ("reward not a number", "/rollout/r/reward", {"reward": "high"}, 400, "invalid_type"),
    ("reward infinite", "/rollout/r/reward", b'{"reward": Infinity}', 400, "invalid_type"),
    ("unknown route", "/v1/embeddings", GOOD, 404, "not_found"),
    ("unknown anthropic route", "/v1/messages/batches", AGOOD, 404, "not_found_error"),
]


def _post(server, path, data, method="POST"):
    return requests.request(
        method, server.url + path, data=data, headers={"Content-Type": "application/json"}
    )


def _error_of(r, path):
    """The error's code (OpenAI shape) or type (Anthropic shape); fails if the body is in neither shape."""
    body = r.json()
    if "/v1/messages" in path:
        assert (
            body["type"] == "error"
            and set(body["error"]) == {"type", "message"}
            and body["error"]["message"]
        )
        return body["error"]["type"]
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    return body["error"]["code"]


@pytest.mark.parametrize("name,path,payload,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_4xx_in_its_apis_format_and_the_proxy_keeps_serving(
    server, name, path, payload, status, code
):
    r = _post(server, path, payload if isinstance(payload, bytes) else json.dumps(payload).encode())
    assert (r.status_code, _error_of(r, path)) == (status, code), r.text
    ok = _post(server, CHAT, json.dumps(GOOD).encode())
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    "method,path", [("GET", CHAT), ("PUT", MSG), ("DELETE", RSP), ("PATCH", "/rollout/r/reward")]
)
def test_wrong_method_is_405_in_its_apis_format(server, method, path):
    r = _post(server, path, b"{}", method)
    assert r.status_code == 405 and _error_of(r, path) == (
        "invalid_request_error" if "/v1/messages" in path else "method_not_allowed"
    )


def test_every_post_route_the_proxy_serves_gets_bad_input_above(server):
    """Each POST route of the proxy's app (the APIs of the loaded extras and the reward route, each
    also under /rollout/ID) is the path of some bad input in BAD: a route the proxy gains has no
    hostile input until one is written for it."""
    rollout = re.compile(r"^/rollout/[^/]+")
    app = server.proxy.app()
    posted = {
        rollout.sub("", r.resource.canonical) for r in app.router.routes() if r.method == "POST"
    }
    assert posted >= {CHAT, MSG, MSG + "/count_tokens", RSP, CMPL, "/reward"}, posted
    assert posted <= {rollout.sub("", path) for _, path, *_ in BAD}, posted


# ---------------------------------------------------------------------------- backend faults


class FakeBackend:
    """Answers "ok" at once, unless told to fail (raise) or hang (never answer)."""

    eos_ids, max_model_len, version, paused = set(), 8192, 0, False

    def __init__(self, tok, delay=0.0):
        self.ids, self.delay, self.mode, self.stats = (
            tok.encode("ok", add_special_tokens=False),
            delay,
            "up",
            {"cancelled": 0},
        )
        self.prompts = None  # a list: every prompt it is given is appended

    async def generate(self, prompt_ids, sampling, on_token=None, rollout_id=""):
        if self.prompts is not None:
            self.prompts.append(prompt_ids)
        if self.mode == "down":
            raise RuntimeError("the engine died")
        await asyncio.sleep(3600 if self.mode == "hang" else self.delay)
        for t in self.ids:
            if on_token:
                on_token(t)
        return Generation(list(self.ids), [-0.1] * len(self.ids), "stop", "ok", self.version)


@pytest.fixture
def fake(tok, tmp_path):
    backend = FakeBackend(tok)
    srv = ProxyServer(Proxy(backend, tok, out_dir=str(tmp_path), call_timeout=1.0)).start()
    srv.backend, srv.calls = backend, lambda: read_calls(str(tmp_path / "calls.jsonl"))
    yield srv
    srv.stop()


def test_a_failed_or_hung_backend_gets_502_or_504_the_call_is_recorded_failed_and_a_restarted_one_serves(
    fake,
):
    chat = lambda rid, **kw: requests.post(f"{fake.url}/rollout/{rid}{CHAT}", json=dict(GOOD, **kw))  # noqa: E731
    assert chat("a").status_code == 200
    fake.backend.mode = "down"
    r = chat("b")
    assert (
        r.status_code == 502
        and r.json()["error"]["type"] == "server_error"
        and "the engine died" in r.json()["error"]["message"]
    )
    r = requests.post(f"{fake.url}/rollout/b{MSG}", json=AGOOD)
    assert r.status_code == 502 and r.json()["error"]["type"] == "api_error"
    with requests.post(
        f"{fake.url}/rollout/b{CHAT}", json=dict(GOOD, stream=True), stream=True
    ) as s:  # the stream has begun: an error event
        events = [line for line in s.iter_lines() if line.startswith(b"data: {")]
    assert (
        s.status_code == 200 and "the engine died" in json.loads(events[-1][6:])["error"]["message"]
    )
    fake.backend.mode = "hang"
    t0 = time.time()
    r = chat("c")
    assert (
        r.status_code == 504
        and "did not answer within 1 s" in r.json()["error"]["message"]
        and time.time() - t0 < 5
    )
    fake.backend.mode = "up"  # restarted: used again
    assert chat("c").status_code == 200
    assert requests.get(fake.url + "/health").json()["backend_failures"] == 4
    calls = fake.calls()
    assert [(c.rollout_id, c.finish_reason) for c in calls] == [
        ("a", "stop"),
        ("b", "error"),
        ("b", "error"),
        ("b", "error"),
        ("c", "error"),
        ("c", "stop"),
    ]
    samples, stats = build_batch_samples(calls)
    assert stats["unanswered"] == 4 and sorted(s.rollout_id for s in samples) == [
        "a",
        "c",
    ]  # never trained on
    # the trainer fails a rollout whose call the backend failed, even if the harness went on and got a reward
    results = [RolloutResult(rid, "t", 1.0, None, 1.0) for rid in "abc"]
    fail_rollouts_the_backend_failed(results, calls)
    assert [r.reward for r in results] == [1.0, None, None] and "backend failed" in results[1].error


def test_other_rollouts_are_served_while_one_call_hangs(fake, tok):
    async def main():
        async with aiohttp.ClientSession() as s:

            async def call(rid):
                async with s.post(f"{fake.url}/rollout/{rid}{CHAT}", json=GOOD) as r:
                    return r.status

            hung = asyncio.ensure_future(call("slow"))
            await asyncio.sleep(0.1)
            fake.backend.mode = "up"
            return await asyncio.gather(*(call(f"quick-{i}") for i in range(20))), await hung

    fake.backend.mode = "hang"
    quick, slow = asyncio.run(main())
    assert quick == [200] * 20 and slow == 504


def test_a_client_that_leaves_is_recorded_cancelled_and_nothing_is_left_unretrieved(fake, caplog):
    """A client that leaves mid-call (a rollout past its timeout) cancels its generation: the call is
    recorded "cancelled", and the proxy's loop logs no "exception was never retrieved" (Python 3.11's
    gather, once cancelled, holds a CancelledError for whoever awaited it)."""

    async def leave():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
            with pytest.raises(asyncio.TimeoutError):
                await s.post(f"{fake.url}/rollout/gone{CHAT}", json=GOOD)

    fake.backend.mode = "hang"
    asyncio.run(leave())
    deadline = time.time() + 10
    while not fake.calls() and time.time() < deadline:
        time.sleep(0.05)
    gc.collect()
    assert [c.finish_reason for c in fake.calls()] == ["cancelled"]
    assert "never retrieved" not in caplog.text


def test_requests_over_the_limit_get_429_with_retry_after(tok, tmp_path):
    srv = ProxyServer(
        Proxy(FakeBackend(tok, delay=0.5), tok, out_dir=str(tmp_path), max_requests=2)
    ).start()

    async def main():
        async with aiohttp.ClientSession() as s:

            async def call(i):
                async with s.post(f"{srv.url}/rollout/r{i}{CHAT}", json=GOOD) as r:
                    return r.status, r.headers.get("Retry-After")

            return await asyncio.gather(*(call(i) for i in range(3)))

    try:
        got = sorted(asyncio.run(main()))
    finally:
        srv.stop()
    assert got == [(200, None), (200, None), (429, "1")]


@pytest.mark.parametrize("retry_after,header", [(2.5, "2.5"), (0, "0")])
def test_during_a_weight_sync_new_calls_get_429_with_retry_after_when_asked(
    tok, tmp_path, retry_after, header
):
    """pause_retry_after=S (train.py's --pause-retry-after, tests/test_cli_flags.py): every API's
    call during a pause is answered 429 with Retry-After: S, 0 included (come back at once)."""
    backend = FakeBackend(tok)
    proxy = Proxy(backend, tok, out_dir=str(tmp_path), pause_retry_after=retry_after)
    srv = ProxyServer(proxy).start()
    try:
        backend.paused = True
        for path, body in [
            (CHAT, GOOD),
            (MSG, AGOOD),
            (CMPL, {"prompt": "hi", "max_tokens": 2}),
            (CHAT, dict(GOOD, stream=True)),
        ]:
            r = requests.post(srv.url + path, json=body)
            assert r.status_code == 429 and r.headers.get("Retry-After") == header, (path, r.text)
            assert r.json()["error"]["type"] == "rate_limit_error"
        backend.paused = False
        assert requests.post(srv.url + CHAT, json=GOOD).status_code == 200
    finally:
        srv.stop()
    assert len(read_calls(str(tmp_path / "calls.jsonl"))) == 1  # the refused calls were never made


def test_an_api_key_guards_every_route(tok, tmp_path):
    srv = ProxyServer(Proxy(FakeBackend(tok), tok, out_dir=str(tmp_path), api_key="s3cret")).start()
    try:
        for method, path, body in [
            ("POST", CHAT, GOOD),
            ("POST", MSG, AGOOD),
            ("POST", RSP, {"input": "hi"}),
            ("POST", CMPL, {"prompt": "hi"}),
            ("GET", "/v1/models", None),
            ("GET", "/health", None),
            ("POST", "/rollout/r/reward", {"reward": 1}),
        ]:
            r = requests.request(method, srv.url + path, json=body)
            assert r.status_code == 401 and "API key" in r.text, (path, r.text)
            r = requests.request(
                method, srv.url + path, json=body, headers={"Authorization": "Bearer wrong"}
            )
            assert r.status_code == 401
            assert (
                requests.request(
                    method, srv.url + path, json=body, headers={"Authorization": "Bearer s3cret"}
                ).status_code
                == 200
            )
        assert (
            requests.post(srv.url + MSG, json=AGOOD, headers={"x-api-key": "s3cret"}).status_code
            == 200
        )  # Anthropic clients
    finally:
        srv.stop()


def test_proxy_cli_will_not_expose_the_model_without_a_key():
    import subprocess
    import sys

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "LL_API_KEY"}
    p = subprocess.run(
        [sys.executable, "proxy.py", "--host", "0.0.0.0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert p.returncode == 2 and "set --api-key" in p.stderr


# ---------------------------------------------------------------------------- load


@pytest.mark.slow  # ~25-35 s: make test-slow
def test_512_concurrent_multi_turn_sessions_every_call_recorded_once(fake, tok):
    """512 rollouts of 3 turns each, at once, half streaming: no error answers, every answered call on disk exactly
    once with what the client received, and nothing kept in memory after the sessions are forgotten."""
    n, turns = 512, 3

    async def rollout(s, i):
        msgs, got = [{"role": "user", "content": f"task {i}"}], []
        for t in range(turns):
            body = {"messages": msgs, "max_tokens": 4, "stream": i % 2 == 1}
            async with s.post(f"{fake.url}/rollout/load-{i}{CHAT}", json=body) as r:
                assert r.status == 200, await r.text()
                if body["stream"]:
                    chunks = [
                        json.loads(line[6:])
                        async for line in r.content
                        if line.startswith(b"data: {")
                    ]
                    text = "".join(
                        c["choices"][0]["delta"].get("content") or ""
                        for c in chunks
                        if c["choices"]
                    )
                else:
                    text = (await r.json())["choices"][0]["message"]["content"]
            got.append(text)
            msgs = msgs + [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"turn {t + 1}"},
            ]
        return got

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n)) as s:
            return await asyncio.gather(*(rollout(s, i) for i in range(n)))

    t0 = time.time()
    answers = asyncio.run(main())
    secs = time.time() - t0
    calls = fake.calls()
    assert len(calls) == n * turns and len({(c.rollout_id, c.index) for c in calls}) == n * turns
    assert all(a == ["ok"] * turns for a in answers) and all(
        c.response["content"] == "ok" and c.finish_reason == "stop" for c in calls
    )
    samples, stats = build_batch_samples(calls)
    assert (
        len(samples) == n and stats["calls"] == n * turns
    )  # each rollout's 3 calls merge into one sample
    # memory: a second round after reset() (what train.py does between steps) leaves nothing behind; keeping
    # the calls alone would hold ~3 MB (1,536 calls of ~40 prompt ids)
    fake.proxy.reset()
    time.sleep(1)  # the server closes the first round's connections
    gc.collect()
    tracemalloc.start()
    asyncio.run(main())
    fake.proxy.reset()
    time.sleep(1)
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    print(
        f"512 sessions x 3 turns: {secs:.1f}s, {n * turns / secs:.0f} calls/s, kept after reset {kept / 1e3:.0f} kB, "
        f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB"
    )
    assert kept < 1e6 and len(fake.calls()) == 2 * n * turns


def test_calls_jsonl_holds_each_prompt_id_once_on_disk_and_in_memory(fake, tmp_path):
    """A call that extends its parent is written as the ids after the parent's prompt + response ids
    (``prompt_tail``): a rollout of n turns writes each id once, not O(n^2) ids. read_calls keeps them so
    (samples.py merges along the parents); whole=True and full_prompt join them back into exactly the
    prompts the backend consumed."""
    msgs, fake.backend.prompts = (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "task"}],
        [],
    )
    for t in range(4):
        reply = requests.post(
            f"{fake.url}/rollout/tail{CHAT}", json={"messages": msgs, "max_tokens": 4}
        ).json()["choices"][0]["message"]
        msgs = msgs + [reply, {"role": "user", "content": f"turn {t}"}]
    requests.post(
        f"{fake.url}/rollout/tail{CHAT}",
        json={"messages": msgs[:2] + [{"role": "user", "content": "new"}], "max_tokens": 4},
    )
    path = str(tmp_path / "calls.jsonl")
    lines = [json.loads(line) for line in open(path)]
    assert [line["parent"] for line in lines] == [
        None,
        0,
        1,
        2,
        None,
    ]  # the last one rewrote history: written whole
    assert [line["prompt_ids"] is None for line in lines] == [
        False,
        True,
        True,
        True,
        False,
    ] and lines[0]["prompt_tail"] is None
    calls = read_calls(path)
    assert [c.prompt_ids is None for c in calls] == [False, True, True, True, False]
    assert [c.prompt_tail for c in calls] == [
        line["prompt_tail"] for line in lines
    ]  # each id held once in memory too
    by_index = {c.index: c for c in calls}
    assert (
        [full_prompt(c, by_index) for c in calls]
        == fake.backend.prompts
        == [c.prompt_ids for c in read_calls(path, whole=True)]
    )
    assert build_batch_samples(calls)[0] == build_batch_samples(read_calls(path, whole=True))[0]
    written = sum(
        len(line.get("prompt_tail") or [])
        + len(line["prompt_ids"] or [])
        + len(line["response_ids"])
        for line in lines[:4]
    )
    assert written == len(fake.backend.prompts[3]) + len(
        calls[3].response_ids
    )  # every id of the conversation written once
    (tmp_path / "cut.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in lines[2:])
    )  # a parent's line is missing
    with pytest.raises(ValueError, match="extends call 1, which no earlier line holds"):
        read_calls(str(tmp_path / "cut.jsonl"))
    # a field this reader does not know (a newer writer's) is left out; the call reads as written
    newer = {**lines[4], "added_later": 1}
    (tmp_path / "newer.jsonl").write_text(json.dumps(newer) + "\n")
    assert read_calls(str(tmp_path / "newer.jsonl"))[0].split == "rewrote_history"


# ---------------------------------------------------------------------------- torn files


def test_a_torn_last_line_is_skipped_with_a_warning_a_torn_middle_is_an_error(tmp_path):
    p = tmp_path / "calls.jsonl"
    p.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b": [1, 2')
    with pytest.warns(UserWarning, match="torn last line"):
        assert list(read_jsonl(str(p))) == [{"a": 1}, {"a": 2}]
    p.write_text('{"a": 1}\n{"a": 2, "b\n{"a": 3}\n')
    with pytest.raises(ValueError, match=":2: not valid JSON"):
        list(read_jsonl(str(p)))


def test_a_torn_last_line_is_cut_off_before_the_proxy_appends(tok, tmp_path, caplog):
    """A proxy killed mid-write leaves a torn last line; the next run cuts it off (with a warning that says how
    many bytes) instead of gluing its first record onto it, which would make the whole file unreadable."""
    path = tmp_path / "calls.jsonl"
    chat = lambda srv: requests.post(f"{srv.url}/rollout/r1{CHAT}", json=GOOD).status_code  # noqa: E731
    srv = ProxyServer(Proxy(FakeBackend(tok), tok, out_dir=str(tmp_path))).start()
    try:
        assert chat(srv) == 200
    finally:
        srv.stop()
    torn = '{"rollout_id":"r1","index":1,"api":"chat","model_version":0,"prompt_ids":[1,2'
    with open(path, "a") as f:
        f.write(torn)
    srv = ProxyServer(Proxy(FakeBackend(tok), tok, out_dir=str(tmp_path))).start()
    try:
        assert chat(srv) == 200
    finally:
        srv.stop()
    assert f"cut off a torn last line ({len(torn)} bytes" in caplog.text
    assert [(c.rollout_id, c.index) for c in read_calls(str(path))] == [
        ("r1", 0),
        ("r1", 1),
    ]  # no warning: nothing torn now


# ---------------------------------------------------------------------------- restarts and resets


def _converse(srv, rid, msgs, turns):
    """``turns`` chat turns on rollout ``rid`` continuing ``msgs``; returns the conversation after them."""
    for t in range(turns):
        r = requests.post(
            f"{srv.url}/rollout/{rid}{CHAT}", json={"messages": msgs, "max_tokens": 4}
        )
        assert r.status_code == 200, r.text
        msgs = msgs + [r.json()["choices"][0]["message"], {"role": "user", "content": f"go on {t}"}]
    return msgs


def test_a_proxy_restarted_on_the_same_out_continues_each_rollouts_call_indices(tok, tmp_path):
    """Two proxy runs on one --out, two turns of rollout r1 each (the harness carries on across the restart): the
    second run numbers its calls after the first run's, so none overwrites another, and every sampled token of
    both runs is trained exactly once (the second run's first call, rendered fresh, extends the first run's)."""
    msgs = [{"role": "user", "content": "task"}]
    for run in range(2):
        srv = ProxyServer(Proxy(FakeBackend(tok), tok, out_dir=str(tmp_path))).start()
        try:
            msgs = _converse(srv, "r1", msgs, 2)
            _converse(srv, f"other-{run}", [{"role": "user", "content": "hi"}], 1)
        finally:
            srv.stop()
    calls = read_calls(str(tmp_path / "calls.jsonl"))
    assert [(c.rollout_id, c.index, c.parent) for c in calls] == [
        ("r1", 0, None),
        ("r1", 1, 0),
        ("other-0", 0, None),
        ("r1", 2, None),
        ("r1", 3, 2),
        ("other-1", 0, None),
    ]
    samples, stats = build_batch_samples([c for c in calls if c.rollout_id == "r1"])
    assert len(samples) == 1 and samples[0].calls == [0, 1, 2, 3]
    assert (
        stats["trainable_tokens"]
        == stats["sampled_tokens"]
        == sum(len(c.response_ids) for c in calls[:2] + calls[3:5])
        > 0
    )


def test_a_call_in_flight_across_a_reset_is_recorded_with_its_session_in_its_own_file(
    tok, tmp_path
):
    """train.py switches files and resets between steps; a call still in flight then (a harness past its
    timeout, --async) is answered 200 and recorded with its own session (its parent's size, its indices),
    in the file of the step it began in, never in the next step's."""
    backend = FakeBackend(tok)
    proxy = Proxy(backend, tok)
    first, second = str(tmp_path / "step_0.jsonl"), str(tmp_path / "step_1.jsonl")
    proxy.set_output(first)
    srv = ProxyServer(proxy).start()
    try:
        msgs = _converse(srv, "s0", [{"role": "user", "content": "task"}], 1)
        backend.delay = 1.0
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            straggler = pool.submit(_converse, srv, "s0", msgs, 1)
            first_call = pool.submit(
                _converse, srv, "s0-new", [{"role": "user", "content": "hi"}], 1
            )  # its first call
            time.sleep(0.3)  # both are being generated
            proxy.set_output(None)  # what train.py does after a step's rollouts
            proxy.reset()
            proxy.set_output(second)
            backend.delay = 0.0
            _converse(srv, "s1", [{"role": "user", "content": "task"}], 1)
            for f in (straggler, first_call):
                f.result(timeout=10)  # raises unless answered 200 (_converse asserts it)
    finally:
        srv.stop()
    got = read_calls(first)
    assert sorted((c.rollout_id, c.index, c.parent) for c in got) == [
        ("s0", 0, None),
        ("s0", 1, 0),
        ("s0-new", 0, None),
    ]
    assert [(c.rollout_id, c.index) for c in read_calls(second)] == [("s1", 0)]
    samples, stats = build_batch_samples(got)
    assert len(samples) == 2 and stats["trainable_tokens"] == stats["sampled_tokens"]
    # the sessions of finished calls are not kept: only the new step's
    assert set(proxy.sessions) == {"s1"}


def test_backend_failures_are_counted_and_only_the_last_hundred_kept(fake):
    fake.backend.mode = "down"
    with requests.Session() as http:
        for i in range(120):
            assert (
                http.post(
                    f"{fake.url}/rollout/f{i}{CMPL}", json={"prompt": "hi", "max_tokens": 2}
                ).status_code
                == 502
            )
    assert requests.get(fake.url + "/health").json()["backend_failures"] == 120
    assert len(fake.proxy.failures) == 100 and fake.proxy.failures[-1]["rollout_id"] == "f119"
