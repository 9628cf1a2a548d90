"""examples/calc: scoring, the calculator tool, the task generator, and the agent loop
against a scripted stub server."""

import asyncio
import re

import pytest

from lightning_lite.harness import Task, load_harness, run_rollouts
from openai_stub import StubServer, tool_call

calc = load_harness("calc")  # the example module, loaded the way train.py loads it
mod = __import__(type(calc).__module__)


def test_score():
    score = mod.score
    assert score("3 + 4 = 7. ANSWER: 7", 7) == 1.0
    assert score("Answer: 7.0", 7) == 1.0
    assert score("answer:**7**", 7) == 1.0
    assert score("ANSWER: 5\nwait, no. ANSWER: 7", 7) == 1.0  # the last one counts
    assert score("ANSWER: 7 ... ANSWER: 8", 7) == 0.1
    assert score("ANSWER: 8", 7) == 0.1 and score("ANSWER: 8", 7, format_reward=0.0) == 0.0
    assert score("ANSWER: 1,234", 1234) == 1.0
    assert score("ANSWER: -3", -3) == 1.0
    assert score("The answer is 7", 7) == 1.0  # lenient: the last number counts
    assert score("The answer is 7", 7, strict=True) == 0.0  # strict: only the ANSWER line
    assert score("7 apples, then 8 more", 7) == 0.0 and score("no number at all", 7) == 0.0
    assert (
        score("7", 7) == 1.0
        and score("7", 7, strict=True) == 0.0
        and score("", 7) == 0.0
        and score(None, 7) == 0.0
    )


def test_calculator_is_safe_and_never_raises():
    c = mod.calculator
    assert c('{"expression": "3+4"}') == "7"
    assert c('{"expression": "6 x 7"}') == "42" and c('{"expression": "2^3"}') == "8"
    assert c('{"expression": "7/2"}') == "3.5" and c('{"expression": "8/2"}') == "4"
    assert c('{"expression": 12}') == "12" and c('"3*3"') == "9"
    assert c('{"expression": "1/0"}').startswith("error")
    assert c('{"expression": "9**9**9"}').startswith("error")  # would take forever
    assert c("{\"expression\": \"__import__('os').system('true')\"}").startswith("error")
    assert c('{"expression": "(1).__class__"}').startswith("error")
    assert c("{expression: 3+4").startswith("error: arguments must be JSON")
    assert c('{"expr": "3+4"}').startswith("error") and c("").startswith("error")


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_tasks_are_deterministic_disjoint_and_correct(difficulty):
    h = load_harness("calc", difficulty=difficulty, n_train=500, n_test=100, seed=3)
    train, test = h.tasks("train"), h.tasks("test")
    assert len(train) == 500 and len(test) == 100
    again = load_harness("calc", difficulty=difficulty, n_train=500, n_test=100, seed=3)
    assert [(t.id, t.prompt, t.answer) for t in again.tasks("train")] == [
        (t.id, t.prompt, t.answer) for t in train
    ]
    other = load_harness("calc", difficulty=difficulty, n_train=500, n_test=100, seed=4)
    assert [t.prompt for t in other.tasks("train")] != [t.prompt for t in train]
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    assert len({t.id for t in train + test}) == 600
    for t in train + test:
        assert t.answer == mod.evaluate(t.meta["expression"]) and t.answer >= 1
        numbers = [
            int(w) for w in t.prompt.replace(",", " ").replace(".", " ").split() if w.isdigit()
        ]
        assert sorted(numbers) == sorted(int(n) for n in re.findall(r"\d+", t.meta["expression"]))
        if difficulty == 1:
            assert t.answer < 20 and len(numbers) == 2
        elif difficulty == 2:
            assert max(numbers + [t.answer]) <= 50 and len(numbers) == 2
        else:
            assert len(numbers) == 3
    with pytest.raises(ValueError, match="splits"):
        h.tasks("validation")
    with pytest.raises(ValueError, match="difficulty"):
        load_harness("calc", difficulty=4)


def test_difficulty_one_is_easy():
    prompts = [t.prompt for t in load_harness("calc", n_train=50).tasks("train")]
    assert all(len(p) < 90 for p in prompts)
    assert any(" buys " in p for p in prompts) and any(" gives " in p for p in prompts)


def run_agent(
    reply,
    task=Task("calc-x", "Tom has 3 apples and buys 4 more. How many apples does Tom have now?", 7),
    **kwargs,
):
    async def main():
        async with StubServer(reply) as stub:
            results = await run_rollouts(
                [("r1", task, load_harness("calc", **kwargs))],
                stub.endpoint,
                timeout=10,
                progress=False,
            )
            return results[0], stub.requests

    return asyncio.run(main())


def test_agent_uses_the_calculator_and_is_rewarded():
    script = [
        {"tool_calls": [tool_call("calculator", {"expression": "3+4"})]},
        {"content": "3 + 4 = 7. ANSWER: 7"},
    ]
    result, requests = run_agent(lambda rid, body, n: script[n])
    assert (result.reward, result.error) == (1.0, None)
    assert [rid for rid, _, _ in requests] == ["r1", "r1"]
    first, second = requests[0][2], requests[1][2]
    assert first["model"] == "stub-model" and first["max_tokens"] == 64
    # the first call must use the calculator, later ones may
    assert (
        first["tool_choice"] == {"type": "function", "function": {"name": "calculator"}}
        and second["tool_choice"] == "auto"
    )
    assert first["tools"][0]["function"]["name"] == "calculator"
    assert "ANSWER:" in first["messages"][0]["content"] and first["messages"][1]["role"] == "user"
    assistant, tool = second["messages"][2], second["messages"][3]
    assert assistant["role"] == "assistant" and assistant["tool_calls"][0]["id"] == "call_0"
    assert tool == {"role": "tool", "tool_call_id": "call_0", "content": "7"}


def test_agent_survives_malformed_tool_calls():
    script = [
        {
            "tool_calls": [
                tool_call("calculator", "{expression: 3+4"),
                tool_call("search", {"q": "3+4"}, call_id="call_1"),
            ]
        },
        {"content": "ANSWER: 8"},
    ]
    result, requests = run_agent(lambda rid, body, n: script[n])
    assert result.reward == pytest.approx(
        0.8 * 0.1
    )  # no valid first call; right format, wrong number
    tool_results = [m["content"] for m in requests[1][2]["messages"] if m["role"] == "tool"]
    assert (
        tool_results[0].startswith("error: arguments must be JSON")
        and "unknown tool" in tool_results[1]
    )


def test_agent_stops_after_max_turns():
    result, requests = run_agent(
        lambda rid, body, n: {"tool_calls": [tool_call("calculator", {"expression": "3+4"})]}
    )
    assert len(requests) == 3 and result.reward == pytest.approx(
        0.2
    )  # a valid first call, no answer
    # arithmetic that is not the problem's (other numbers, the answer plus nothing) earns no tool reward
    for expression in ("1+6", "7+0", "3*4"):
        result, _ = run_agent(
            lambda rid, body, n: [
                {"tool_calls": [tool_call("calculator", {"expression": expression})]},
                {"content": "ANSWER: 7"},
            ][n]
        )
        assert result.reward == pytest.approx(0.8), expression
    # a bare number is not a computation: no tool reward (the trained model learned to pass one, often the answer)
    result, _ = run_agent(
        lambda rid, body, n: [
            {"tool_calls": [tool_call("calculator", {"expression": "7"})]},
            {"content": "ANSWER: 7"},
        ][n]
    )
    assert result.reward == pytest.approx(0.8)
    # the forced first call did not parse (the model wrote text): told so, it answers on the next turn
    result, requests = run_agent(lambda rid, body, n: {"content": "seven"}, format_reward=0.0)
    assert len(requests) == 2 and (result.reward, result.error) == (0.0, None)
    assert requests[1][2]["messages"][-1]["content"].startswith(
        "That was not a valid calculator call"
    )
    # call_rewards=True: the calculator call is rewarded on its own (by the id of its reply), the rollout by the answer
    result, _ = run_agent(
        lambda rid, body, n: [
            {"tool_calls": [tool_call("calculator", {"expression": "3+4"})]},
            {"content": "ANSWER: 8"},
        ][n],
        call_rewards=True,
    )
    assert (result.reward, result.call_rewards) == (
        pytest.approx(0.1),
        {"chatcmpl-1": 1.0},
    )  # the stub numbers its replies from 1
    # tool_first=False: the single-turn agent of before, reward = the answer's score
    result, requests = run_agent(lambda rid, body, n: {"content": "3 + 4 = 7."}, tool_first=False)
    assert len(requests) == 1 and result.reward == 1.0 and requests[0][2]["tool_choice"] == "auto"
