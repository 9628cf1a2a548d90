"""Small harnesses for the train.py tests: a guaranteed learning signal, and failures on purpose."""

import asyncio
import sys
import zlib

import aiohttp
import openai

from lightning_lite.extras.programs import SubprocessHarness
from lightning_lite.extras.sandbox import Sandbox
from lightning_lite.harness import Harness, Task

TOPICS = ["cats", "rain", "bread", "trains", "the sea", "music", "snow", "books"]


class LengthHarness(Harness):
    """One short call; reward = reply length / 80 characters. Sampled replies differ in length,
    so groups mostly have variance and steps update the weights. ``seeded``: each call sends a
    seed made from its rollout id, so a rerun samples the same replies (with --max-concurrency 1).
    ``ranked``: a training rollout's index in its group (its id "s{step}-r{rank}-t{i}-g{g}") adds
    g / 1000 to its reward, so every group has a signal whatever was sampled (two replies of one
    length make none): a test that needs an update at every step takes it."""

    name = "length"

    def __init__(self, max_tokens: int = 8, seeded: bool = False, ranked: bool = False):
        self.max_tokens = max_tokens
        self.seeded = seeded
        self.ranked = ranked

    def tasks(self, split):
        return [Task(f"{split}-{i}", f"Say something about {t}.") for i, t in enumerate(TOPICS)]

    async def run(self, task, endpoint):
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
        ) as c:
            r = await c.chat.completions.create(
                model=endpoint.model,
                messages=[{"role": "user", "content": task.prompt}],
                max_tokens=self.max_tokens,
                temperature=1.0,
                **({"seed": zlib.crc32(endpoint.rollout_id.encode())} if self.seeded else {}),
            )
        reward = min(1.0, len(r.choices[0].message.content or "") / 80)
        # Evaluation ids ("eval{step}-r{rank}-{i}") have no group index.
        if self.ranked and "-g" in endpoint.rollout_id:
            reward += int(endpoint.rollout_id.rsplit("-g", 1)[1]) / 1000
        return reward


class BranchingHarness(LengthHarness):
    """Three seeded calls that make a prefix tree of two leaves: call 2 rewrites call 1's reply in the history (a
    split, rewrote_history), call 3 extends call 2. Every leaf starts with the task prompt, as does every rollout
    of the group; reward = the replies' length."""

    name = "branching"

    async def run(self, task, endpoint):
        msgs, text = [{"role": "user", "content": task.prompt}], ""
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
        ) as c:
            for i, follow_up in enumerate(("Say it shorter.", "And one more.", None)):
                r = await c.chat.completions.create(
                    model=endpoint.model,
                    messages=msgs,
                    max_tokens=self.max_tokens,
                    temperature=1.0,
                    seed=zlib.crc32(f"{endpoint.rollout_id}/{i}".encode()),
                )
                reply = r.choices[0].message.content or ""
                text += reply
                msgs += [
                    {
                        "role": "assistant",
                        "content": f"(in short) {reply[:12]}" if i == 0 else reply,
                    },
                    {"role": "user", "content": follow_up},
                ]
        return min(1.0, len(text) / 120)


class PerCallHarness(LengthHarness):
    """Two calls, the second extending the first, each rewarded: call 0 by a POST (by index, with the harness's key),
    call 1 in what run() returns (by the id of its reply); the rollout: the replies' length."""

    name = "percall"

    async def run(self, task, endpoint):
        msgs, replies = [{"role": "user", "content": task.prompt}], []
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
        ) as c:
            for follow_up in ("Say more.", None):
                r = await c.chat.completions.create(
                    model=endpoint.model, messages=msgs, max_tokens=self.max_tokens, temperature=1.0
                )
                replies.append(r.choices[0].message.content or "")
                msgs += [
                    {"role": "assistant", "content": replies[-1]},
                    {"role": "user", "content": follow_up},
                ]
        async with aiohttp.ClientSession() as s:
            async with s.post(
                endpoint.reward_url,
                json={"reward": len(replies[0]) / 40, "call": 0},
                headers={"X-Reward-Key": endpoint.reward_key},
            ) as p:
                p.raise_for_status()
        return {
            "reward": min(1.0, len("".join(replies)) / 80),
            "calls": {r.id: -len(replies[1]) / 40},
        }


class ConstantHarness(LengthHarness):
    """LengthHarness's call, a reward of 0.5 whatever the reply: every group has zero advantage."""

    name = "constant"

    async def run(self, task, endpoint):
        await super().run(task, endpoint)
        return 0.5


class FlakyHarness(LengthHarness):
    """Task 0 raises, task 1 hangs past the timeout, task 2 gives no reward, the rest work."""

    name = "flaky"

    async def run(self, task, endpoint):
        i = int(task.id.split("-")[1])
        if i == 0:
            raise RuntimeError("the harness crashed on purpose")
        if i == 1:
            await asyncio.sleep(3600)
        if i == 2:
            return None
        return await super().run(task, endpoint)


SCRIPT = """
import os, openai
c = openai.OpenAI(max_retries=0)  # reads OPENAI_BASE_URL and OPENAI_API_KEY
r = c.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
print(len(r.choices[0].message.content or "") / 10)
"""


class ScriptHarness(SubprocessHarness):
    """A harness that is a separate program talking to the proxy through the environment."""

    name = "script"
    sandbox = (
        Sandbox()
    )  # the host: make test needs no bubblewrap (tests/test_sandbox.py runs programs in it)

    def tasks(self, split):
        return [Task(f"{split}-{i}", "Hi") for i in range(4)]

    def command(self, task, endpoint):
        return [sys.executable, "-c", SCRIPT], {}, None


class AuditedScript(ScriptHarness):
    """ScriptHarness in train.py's --sandbox, with an audit that flags every rollout (the task's "Hi" is the first
    call's new prompt text) and zeroes its reward; its agent also tries to POST a reward of its own."""

    name = "audited"
    sandbox = None
    audit_results = {"greeting": r"\bHi\b"}
    zero_flagged = True

    def command(self, task, endpoint):
        poster = (
            "\nimport urllib.request\ntry: urllib.request.urlopen(urllib.request.Request(os.environ['OPENAI_BASE_URL']"
            ".split('/rollout/')[0] + '/rollout/' + os.environ['LL_ROLLOUT_ID'] + '/reward', b'{\"reward\": 1}'))\n"
            "except Exception: pass\n"
        )
        return [sys.executable, "-c", SCRIPT + poster], {}, None


class SamplingHarness(Harness):
    """Replies sampled under one of the settings that real harnesses send; reward = length, so every
    group has variance and the step trains. ``setting``:

        plain   one call at temperature 1.0 (the baseline: no truncation)
        top_p   one call at temperature 1.0, top_p 0.6
        top_k   one call at temperature 1.0, top_k 5
        mixed   a two-turn conversation: turn 1 at temperature 0.5, turn 2 at 1.0 (one merged sample)
        all     three tasks: one top_p, one top_k, one mixed
        constrained  a forced calculator call (its schema's grammar) at temperature 0.7, top_p 0.8, the result,
                then a reply in JSON (response_format) at temperature 1.0: two grammars, one under top_p, in one
                merged sample
    """

    name = "sampling"

    def __init__(self, setting="mixed", max_tokens=12):
        self.setting, self.max_tokens = setting, max_tokens

    def tasks(self, split):
        return [
            Task(f"{split}-{i}", f"Write one sentence about {t}.")
            for i, t in enumerate(TOPICS[:3] if self.setting == "all" else TOPICS)
        ]

    async def run(self, task, endpoint):
        msgs = [{"role": "user", "content": task.prompt}]
        setting = (
            ("top_p", "top_k", "mixed")[int(task.id.split("-")[1]) % 3]
            if self.setting == "all"
            else self.setting
        )
        if setting == "constrained":
            return await self.constrained(endpoint)
        turns = {
            "plain": [dict(temperature=1.0)],
            "top_p": [dict(temperature=1.0, top_p=0.6)],
            "top_k": [dict(temperature=1.0, extra_body={"top_k": 5})],
            "mixed": [dict(temperature=0.5), dict(temperature=1.0)],
        }[setting]
        text = ""
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
        ) as c:
            for i, kw in enumerate(turns):
                if i:
                    msgs.append({"role": "user", "content": "And one more."})
                r = await c.chat.completions.create(
                    model=endpoint.model, messages=msgs, max_tokens=self.max_tokens, **kw
                )
                reply = r.choices[0].message.content or ""
                msgs.append({"role": "assistant", "content": reply})
                text += reply
        return min(1.0, len(text) / (60 * len(turns)))

    async def constrained(self, endpoint):
        msgs = [{"role": "user", "content": "What is 3 + 4? Use the calculator."}]
        async with openai.AsyncOpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0
        ) as c:
            r = await c.chat.completions.create(
                model=endpoint.model,
                messages=msgs,
                tools=[CALC],
                max_tokens=self.max_tokens,
                tool_choice={"type": "function", "function": {"name": "calculator"}},
                temperature=0.7,
                top_p=0.8,
            )
            calls = (
                r.choices[0].message.tool_calls or []
            )  # the grammar's call parses, unless max_tokens cut it
            msgs += [
                r.choices[0].message.model_dump(
                    exclude_none=True, include={"role", "content", "tool_calls"}
                ),
                *({"role": "tool", "tool_call_id": t.id, "content": "7"} for t in calls),
            ]
            r = await c.chat.completions.create(
                model=endpoint.model,
                messages=msgs,
                max_tokens=self.max_tokens,
                temperature=1.0,
                tools=[CALC],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "answer", "schema": ANSWER},
                },
            )
        # both calls' lengths: a group whose calls were all cut by max_tokens still varies by its replies
        return min(
            1.0,
            (len(calls[0].function.arguments) if calls else 0) / 80
            + len(r.choices[0].message.content or "") / 80,
        )


CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "why": {"type": "string"}},
    "required": ["answer"],
}
