"""examples/search and examples/instruct: rewards on known-good and known-bad answers, BM25, the
task generators, the agent loops against a scripted stub (no model), and one train.py step of
each on the embedded model."""

import asyncio
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from openai_stub import StubServer, tool_call

from lightning_lite.harness import Task, load_harness, parse_kwargs, run_rollouts

search = load_harness("search")  # the example modules, loaded the way train.py loads them
S = sys.modules[type(search).__module__]
instruct = load_harness("instruct")
IFE = sys.modules[type(instruct).__module__]


# ---------------------------------------------------------------------------- search: reward


def test_search_f1_is_squad_style():
    assert (
        S.normalize("The  Pexo-X7!") == "pexox7" and S.normalize("An apple, a pear") == "apple pear"
    )
    assert S.f1("Mara Okafor", "Mara Okafor") == 1.0
    assert (
        S.f1("the mara okafor.", "Mara Okafor") == 1.0
    )  # case, articles and punctuation do not count
    assert S.f1("Okafor", "Mara Okafor") == pytest.approx(2 / 3)  # precision 1, recall 1/2
    assert S.f1("Mara Okafor of Skiton", "Mara Okafor") == pytest.approx(
        2 / 3
    )  # precision 2/4, recall 1
    assert (
        S.f1("Leo Park", "Mara Okafor") == 0.0
        and S.f1("", "Mara Okafor") == 0.0
        and S.f1(None, "Skiton") == 0.0
    )
    assert S.f1("okafor okafor", "Mara Okafor") == pytest.approx(
        0.5
    )  # a repeated token matches once


def test_search_answer_extraction():
    assert S.extract_answer("I searched. ANSWER: Mara Okafor") == "Mara Okafor"
    assert (
        S.extract_answer("answer: Leo\nANSWER: Skiton\nthanks") == "Skiton"
    )  # the last one, its line only
    assert S.extract_answer("It is Skiton.") == "It is Skiton." and S.extract_answer(None) == ""
    # known-good and known-bad final replies, end to end
    assert S.f1(S.extract_answer("ANSWER: Skiton"), "Skiton") == 1.0
    assert S.f1(S.extract_answer("ANSWER: Fenton"), "Skiton") == 0.0
    assert (
        0 < S.f1(S.extract_answer("The founder was born in Skiton"), "Skiton") < 0.5
    )  # right name, no format


# ---------------------------------------------------------------------------- search: BM25 and the corpus


def test_bm25_matches_the_formula():
    bm = S.BM25(["red apple", "green pear", "red car", "red red apple pie"])
    n, avgdl, k1, b = 4, (2 + 2 + 2 + 4) / 4, 1.5, 0.75  # "red" twice in doc 3: tf 2, length 4

    def term(df, tf, dl):
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        return idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl))

    scores = bm.scores("red apple")
    assert scores[0] == pytest.approx(term(3, 1, 2) + term(2, 1, 2))
    assert scores[3] == pytest.approx(term(3, 2, 4) + term(2, 1, 4))
    assert scores[2] == pytest.approx(term(3, 1, 2)) and 1 not in scores  # no shared term, no score
    assert [i for i, _ in bm.search("red apple", k=2)] == [
        0,
        3,
    ]  # length normalization beats the second "red"
    assert bm.search("pear")[0][0] == 1 and bm.search("the of") == [] and bm.search("") == []
    assert bm.scores("red red apple") == scores  # a repeated query word counts once
    assert bm.search("RED, Apple?") == bm.search("red apple")  # case and punctuation do not matter


def test_every_hop_is_retrievable():
    """The query a careful agent would write for each hop finds the right document first."""
    w, docs = search.world, search.world["docs"]
    top = lambda q: docs[search.index.search(q, 1)[0][0]]  # noqa: E731
    for product, company in w["products"].items():
        assert f"made by {company}." in top(product)["text"]
    for company, info in w["companies"].items():
        assert info["founder"] in top(f"{company} founder")["text"]
        assert info["city"] in top(f"{company} offices")["text"]
    for person, info in w["people"].items():
        assert top(person)["text"].startswith(f"{person} was born in {info['born']} ")


def test_search_tasks_are_deterministic_and_answers_follow_the_facts():
    h = load_harness("search", seed=3)
    train, test = h.tasks("train"), h.tasks("test")
    assert (
        len(test) == 100
        and len(train) == 500
        and not {t.prompt for t in train} & {t.prompt for t in test}
    )
    again = load_harness("search", seed=3)
    assert [(t.prompt, t.answer) for t in again.tasks("train")] == [
        (t.prompt, t.answer) for t in train
    ]
    assert [t.prompt for t in load_harness("search", seed=4).tasks("train")] != [
        t.prompt for t in train
    ]
    w = h.world
    for t in train + test:
        assert t.meta["hops"] >= 2
        if t.meta["kind"] == "founder_of_maker":
            product = t.prompt.split("makes the ")[1].rstrip("?")
            assert t.answer == w["companies"][w["products"][product]]["founder"]
    # min_hops=1 adds the one-hop questions: a product's maker (180), a company's founder and city
    # (60 each), a person's birthplace (120); max_hops=1 keeps only those
    easy = load_harness("search", seed=3, min_hops=1).tasks("train")
    assert len(easy) == 500 + 420 and sum(t.meta["hops"] == 1 for t in easy) > 300
    one = load_harness("search", seed=3, min_hops=1, max_hops=1)
    one_hop = one.tasks("train") + one.tasks("test")
    assert len(one_hop) == 420 and {t.meta["hops"] for t in one_hop} == {1}
    for t in one_hop:
        if t.meta["kind"] == "founder":
            assert t.answer == w["companies"][t.prompt[len("Who founded ") : -1]]["founder"]
        if t.meta["kind"] == "birthplace":
            person = t.prompt[len("In which city was ") : -len(" born?")]
            assert t.answer == w["people"][person]["born"]
    with pytest.raises(ValueError, match="fewer companies"):
        load_harness("search", n_companies=145)  # more than the name lists can make distinct
    with pytest.raises(ValueError, match="splits"):
        h.tasks("dev")


def test_search_tool_never_raises():
    assert "made by" in search.search(json.dumps({"query": next(iter(search.world["products"]))}))
    assert search.search('{"q": "Skiton"}') != search.search(
        '{"query": ""}'
    )  # lenient about the key
    assert search.search("{query: x").startswith("error: arguments must be JSON")
    assert search.search('{"query": 3}').startswith("error") and search.search("").startswith(
        "error"
    )
    assert search.search('{"query": "zzzz qqqq"}') == "no documents found"


def test_count_tokens_uses_cl100k():
    assert S.count_tokens([{"role": "user", "content": "hello world"}]) == 2 + 4
    call = {"role": "assistant", "content": "", "tool_calls": [tool_call("search", {"query": "x"})]}
    assert S.count_tokens([call]) > 4 and S.count_tokens([], [S.SEARCH_TOOL]) > 30


# ---------------------------------------------------------------------------- search: the agent loop


def run_search(reply, task, **kwargs):
    async def main():
        async with StubServer(reply) as stub:
            h = load_harness("search", **kwargs)
            (result,) = await run_rollouts(
                [("r1", task, h)], stub.endpoint, timeout=10, progress=False
            )
            return result, [body for _, _, body in stub.requests]

    return asyncio.run(main())


def test_search_agent_compacts_its_history_and_is_rewarded():
    w = search.world
    product, company = next(iter(w["products"].items()))
    founder = w["companies"][company]["founder"]
    task = Task("search-x", f"Who founded the company that makes the {product}?", founder)
    script = [
        {"tool_calls": [tool_call("search", {"query": product}, "call_0")]},
        {"tool_calls": [tool_call("search", {"query": f"{company} founder"}, "call_1")]},
        {"content": f"{product} is made by {company}."},  # the summary (side call)
        {"content": f"ANSWER: {founder}"},
    ]
    result, bodies = run_search(lambda rid, body, n: script[n], task, context_budget=1, max_turns=3)
    assert (result.reward, result.error, result.call_rewards) == (1.0, None, {})
    # call_rewards: each search call on its own, 1 when its results hold the answer: the product's
    # document names the maker, not the founder; the maker's founder document does
    again, _ = run_search(
        lambda rid, body, n: script[n], task, context_budget=1, max_turns=3, call_rewards=True
    )
    assert again.reward == 1.0 and again.call_rewards == {"chatcmpl-1": 0.0, "chatcmpl-2": 1.0}
    forced = {"type": "function", "function": {"name": "search"}}
    assert [b["tool_choice"] for b in bodies] == [forced, forced, "none", "none"]
    summary_call, after = bodies[2], bodies[3]
    # the side call is the whole conversation plus a request to summarize (it extends the last call)
    n = len(bodies[1]["messages"])
    assert (
        summary_call["messages"][:n] == bodies[1]["messages"]
        and len(summary_call["messages"]) == n + 3
    )
    assert (
        summary_call["messages"][-1]["content"] == S.SUMMARY_PROMPT
        and summary_call["tools"] == bodies[1]["tools"]
    )
    # the compacted history: system, question, summary, and the last turn verbatim
    roles = [m["role"] for m in after["messages"]]
    assert (
        roles == ["system", "user", "user", "assistant", "tool", "user"]
        and after["messages"][-1]["content"] == S.FINAL_PROMPT
    )
    assert after["messages"][1]["content"].startswith(
        task.prompt + "\n\nSearch results for the question:\n["
    )
    assert (
        after["messages"][2]["content"]
        == f"Summary of your earlier searches: {product} is made by {company}."
    )
    assert (
        after["messages"][3]["tool_calls"][0]["id"] == "call_1"
        and founder in after["messages"][4]["content"]
    )


def test_search_agent_without_compaction_and_with_broken_calls():
    w = search.world
    product, company = next(iter(w["products"].items()))
    task = Task("search-x", f"Which company makes the {product}?", company)
    # a big budget never compacts; an unparsed forced call with a query in its text still searches
    script = [
        {
            "content": '<tool_call>\n{"name": "search", "arguments": {"query": "'
            + product
            + '"}, "type"'
        },
        {"content": "no idea"},  # forced, no query: a format error comes back
        {"tool_calls": [tool_call("search", {"query": product})]},
        {"content": f"It is {company}."},
    ]
    result, bodies = run_search(
        lambda rid, body, n: script[n], task, context_budget=10**6, max_turns=5
    )
    assert len(bodies) == 4 and result.reward == pytest.approx(S.f1(f"It is {company}.", company))
    msgs = bodies[3]["messages"]
    assert f"made by {company}" in msgs[3]["content"] and msgs[5]["content"] == S.FORMAT_ERROR
    assert all(m.get("content") != S.SUMMARY_PROMPT for b in bodies for m in b["messages"])
    assert bodies[3]["tool_choice"] == "auto"  # two searches done: the model may answer
    # a model that only ever calls tools is made to answer on the last turn, then scored on it
    result, bodies = run_search(
        lambda rid, body, n: (
            {"tool_calls": [tool_call("search", {"query": "x"})]}
            if body["tool_choice"] != "none"
            else {"content": ""}
        ),
        task,
        max_turns=3,
        context_budget=10**6,
    )
    assert len(bodies) == 3 and bodies[-1]["tool_choice"] == "none" and result.reward == 0.0


def test_search_agent_answers_with_the_answer_tool():
    w = search.world
    company, info = next(iter(w["companies"].items()))
    task = Task("search-x", f"Who founded {company}?", info["founder"])
    script = [
        {"tool_calls": [tool_call("search", {"query": company}, "call_0")]},
        {"tool_calls": [tool_call("search", {"query": f"{company} founder"}, "call_1")]},
        {"content": f"{company} was founded by {info['founder']}."},  # the summary
        {"tool_calls": [tool_call("answer", {"answer": info["founder"]}, "call_2")]},
    ]
    kw = dict(context_budget=1, max_turns=3, answer_tool=True, prefetch=False)
    result, bodies = run_search(lambda rid, body, n: script[n], task, **kw)
    assert result.reward == 1.0 and len(bodies) == 4
    assert [t["function"]["name"] for t in bodies[0]["tools"]] == ["search", "answer"]
    assert "call answer with it" in bodies[0]["messages"][0]["content"]
    # the last turn forces the answer tool and asks the question again; the summary side call
    # still may not call a tool
    assert bodies[3]["tool_choice"] == {"type": "function", "function": {"name": "answer"}}
    assert bodies[3]["messages"][-1]["content"] == S.FINAL_PROMPT_TOOL.format(question=task.prompt)
    assert bodies[2]["tool_choice"] == "none"
    # an answer the model calls by itself ends the rollout (the argument scored, not the text);
    # one that is not JSON scores 0
    for answer, reward in [({"answer": info["founder"].split()[1]}, 2 / 3), ("{oops", 0.0)]:
        script = [
            {"tool_calls": [tool_call("search", {"query": company})]},
            {"content": "x", "tool_calls": [tool_call("answer", answer)]},
        ]
        result, bodies = run_search(
            lambda rid, body, n: script[n], task, min_searches=1, max_turns=5, answer_tool=True
        )
        assert len(bodies) == 2 and result.reward == pytest.approx(reward)


def test_search_demo_settings_build_the_harness_the_readme_describes():
    # make demo-search's SEARCH_DEMO_ARGS: one-hop questions only, both tools, compaction after the
    # two forced searches (the two results and both schemas are over the budget)
    line = next(
        x for x in open(os.path.join(ROOT, "Makefile")) if x.startswith("SEARCH_DEMO_ARGS ?=")
    )
    h = load_harness("search", **parse_kwargs(line.split("?=")[1].split()))
    tasks = h.tasks("train") + h.tasks("test")
    assert len(tasks) == 420 and {t.meta["hops"] for t in tasks} == {1}
    assert [t["function"]["name"] for t in h.tools] == ["search", "answer"]
    assert (h.max_turns, h.min_searches, h.prefetch, h.call_rewards) == (3, 2, False, True)
    product = next(iter(search.world["products"]))
    result = json.dumps({"query": product})
    turns = [
        {"role": "system", "content": S.SYSTEM_PROMPT.format(**S.BY_TOOL)},
        {"role": "user", "content": f"Which company makes the {product}?"},
    ] + 2 * [
        {"role": "assistant", "content": result},
        {"role": "tool", "content": h.search(result)},
    ]
    assert S.count_tokens(turns, h.tools) > h.context_budget


# ---------------------------------------------------------------------------- instruct


def c(kind, arg=None):
    return {"kind": kind, "arg": arg}


@pytest.mark.parametrize(
    "constraint, good, bad",
    [
        (c("max_words", 5), "A cup of hot coffee.", "Coffee is a hot drink made from beans."),
        (c("min_words", 4), "Coffee is a drink.", "Coffee, please."),
        (c("max_sentences", 2), "Rain falls. It is wet!", "Rain falls. It is wet. I like it?"),
        (c("include", "cup"), "A Cup of tea.", "Two cups of tea."),
        (c("forbid", "snow"), "It is cold and white.", "Snow is cold. SNOW!"),
        (c("json"), '{"topic": "coffee", "facts": ["hot"]}', "topic: coffee"),
        (c("json"), '```json\n["a", "b"]\n```', '{"a": 1'),
        (c("bullets", 3), "Facts:\n- one\n- two\n* three", "- one\n- two"),
        (c("lowercase"), "all small, 3 words.", "All small."),
        (c("uppercase"), "ALL CAPS, 100%!", "ALL CAPS, nearly aLL."),
        (
            c("ends_with", "That is all."),
            "Cats sleep a lot. That is all.  ",
            "That is all. Cats sleep.",
        ),
    ],
)
def test_instruct_checks(constraint, good, bad):
    assert IFE.check(constraint, good) and not IFE.check(constraint, bad)
    assert IFE.score(good, [constraint]) == 1.0 and IFE.score(bad, [constraint]) == 0.0


def test_instruct_score_is_the_fraction_satisfied():
    cs = [c("max_words", 10), c("include", "cup"), c("lowercase")]
    assert IFE.score("a cup of coffee.", cs) == 1.0
    assert IFE.score("A cup of coffee.", cs) == pytest.approx(2 / 3)
    assert IFE.score("A mug of coffee is a lovely way to start any long morning.", cs) == 0.0
    assert (
        IFE.score("", [c("max_words", 10), c("forbid", "cup")]) == 0.0
    )  # saying nothing earns nothing
    assert IFE.score("   \n", [c("lowercase")]) == 0.0


def test_instruct_tasks_are_deterministic_disjoint_and_consistent():
    h = load_harness("instruct", n_train=300, n_test=200, seed=5)
    train, test = h.tasks("train"), h.tasks("test")
    assert (
        len(train) == 300
        and len(test) == 200
        and not {t.prompt for t in train} & {t.prompt for t in test}
    )
    again = load_harness("instruct", n_train=300, n_test=200, seed=5)
    assert [(t.prompt, t.answer) for t in again.tasks("train")] == [
        (t.prompt, t.answer) for t in train
    ]
    assert [t.prompt for t in load_harness("instruct", n_train=300, seed=6).tasks("train")] != [
        t.prompt for t in train
    ]
    kinds = set()
    for t in train + test:
        ks = [x["kind"] for x in t.answer]
        kinds |= set(ks)
        assert 1 <= len(ks) <= 3 and len({IFE.GROUP[k] for k in ks}) == len(ks)  # one per group
        assert not any(frozenset((a, b)) in IFE.CONFLICTS for a in ks for b in ks)
        assert all(IFE.instruction(x) in t.prompt for x in t.answer)
        words = {x["kind"]: x["arg"] for x in t.answer}
        assert words.get("include") != words.get("forbid", "")
    assert kinds == set(IFE.CHECKS)
    with pytest.raises(ValueError, match="splits"):
        h.tasks("dev")


def test_instruct_agent_is_one_call():
    task = Task("instruct-x", 'Describe cats. Include the word "purr".', [c("include", "purr")])

    async def main():
        async with StubServer(lambda rid, body, n: {"content": "Cats purr."}) as stub:
            (r,) = await run_rollouts(
                [("r1", task, instruct)], stub.endpoint, timeout=10, progress=False
            )
            return r, stub.requests

    result, requests = asyncio.run(main())
    assert result.reward == 1.0 and len(requests) == 1
    assert (
        requests[0][2]["messages"][1]["content"] == task.prompt
        and requests[0][2]["max_tokens"] == 96
    )


# ---------------------------------------------------------------------------- one train.py step each


def train_step(tmp_path, harness, *args):
    out = str(tmp_path / harness)
    p = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--harness",
            harness,
            "--steps",
            "1",
            "--batch-size",
            "1",
            "--group-size",
            "2",
            "--eval-tasks",
            "0",
            "--out",
            out,
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    calls = [json.loads(line) for line in open(os.path.join(out, "calls", "step_0.jsonl"))]
    (row,) = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rollouts = [json.loads(line) for line in open(os.path.join(out, "rollouts", "step_0.jsonl"))]
    assert row["rollouts"] == len(rollouts) == 2 and row["failed"] == 0
    assert row["calls"] == len(calls)
    # the step's reward is the mean of its rollouts' (each checked against the harness by a test)
    assert row["reward"] == pytest.approx(sum(r["reward"] for r in rollouts) / 2)
    return calls, row, rollouts


@pytest.mark.slow  # ~40-160 s: make test-slow
def test_search_trains_one_step_and_compaction_splits_the_sample(tmp_path):
    """Budget 1 token: the agent compacts before its third (last) turn, so each rollout makes 4 calls
    (2 forced searches, the summary side call, the answer) and gives 2 samples: the first three calls
    merged (the summary call extends the conversation), and the answer after the rewritten history."""
    calls, row, _ = train_step(
        tmp_path,
        "search",
        "--harness-arg",
        "context_budget=1",
        "--harness-arg",
        "max_turns=3",
        "--harness-arg",
        "max_tokens=12",
        "--harness-arg",
        "summary_tokens=12",
    )
    by_rollout = {}
    for call in calls:
        by_rollout.setdefault(call["rollout_id"], []).append(call)
    assert len(by_rollout) == 2
    for rollout in by_rollout.values():
        assert [x["parent"] for x in rollout] == [None, 0, 1, None]
        assert [x["split"] for x in rollout] == [None, None, None, "rewrote_history"]
    assert row["samples"] == 4 and row["splits"] == {"rewrote_history": 2}


@pytest.mark.slow  # ~45 s (27 s before it made an update: the backward, AdamW's state saved)
def test_instruct_trains_one_step(tmp_path):
    """One train.py step on examples/instruct: two rollouts of one task, one call each, whose
    recorded reward is instruct's score of the recorded reply (recomputed here), each call one
    sample, and an update that changes the weights. --loss sft imitates both replies, so the step
    always has something to learn: under grpo two 16-token replies mostly score alike (measured:
    both 0.0), and the step skips its update (no_signal)."""
    from safetensors.torch import load_file

    from lightning_lite.models import load_model

    flags = ["--harness-arg", "max_tokens=16", "--loss", "sft"]
    calls, row, rollouts = train_step(tmp_path, "instruct", *flags)
    assert len(calls) == 2 and len({x["rollout_id"] for x in calls}) == 2
    assert (
        row["samples"] == 2
        and row["splits"] == {}
        and row["trainable_tokens"] == sum(len(x["response_ids"]) for x in calls)
    )
    tasks = {t.id: t for t in instruct.tasks("train")}
    reply = {x["rollout_id"]: x["response"]["content"] for x in calls}
    for r in rollouts:
        assert r["reward"] == IFE.score(reply[r["rollout_id"]], tasks[r["task_id"]].answer), r
    # an update: a gradient, a loss (sft: the replies' mean negative logprob), new weights
    assert row["skipped"] is None and row["grad_norm"] > 0 and row["loss"] > 0, row
    trained = load_file(
        os.path.join(tmp_path, "instruct", "checkpoints", "step_1", "model.safetensors")
    )
    initial = load_model("smollm2").state_dict()
    changed = [k for k, v in trained.items() if not torch.equal(v, initial[k])]
    assert len(changed) > 10, changed
