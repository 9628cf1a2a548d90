"""report.py: a run folder -> one self-contained report.html, checked in a real headless browser.

The run folder is written here by hand, in train.py's layout, with real SmolLM2 token ids so
that the page decodes them. The browser is Debian's chromium driven by playwright (playwright's
own browser download needs the internet); without them the browser test skips: `make setup-browser`.
"""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from conftest import ROOT
from lightning_lite.extras.audit import scan
from lightning_lite.records import Call, write_jsonl
from lightning_lite.extras.report import batch_label
from lightning_lite.samples import build_samples

NO_BROWSER = "chromium or playwright missing: run `make setup-browser`"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ERROR = "RuntimeError: the harness crashed (exit 3)"


def call(rid, index, prompt, response, parent=None, hint=None):
    return Call(
        rollout_id=rid,
        index=index,
        api="chat",
        model_version=1,
        prompt_ids=prompt,
        response_ids=response,
        response_logprobs=[-0.5] * len(response),
        finish_reason="stop",
        parent=parent,
        split=hint,
        latency_s=0.25,
    )


def report(run_dir):
    return subprocess.run(
        [sys.executable, "-m", "lightning_lite.extras.report", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def run(tok, tmp_path_factory):
    """A 2-step run of two harnesses (calc, search): evals at steps 0 and 2; calls/step_1 (trained as metrics
    step 2) holds a calc rollout whose calls 0 and 1 merge and whose call 2 rewrote the history, a failed search
    rollout, and a flagged search rollout with a per-call advantage; calls/eval_2 has a long prompt and, like an
    older run, no rollouts/ file."""
    d = tmp_path_factory.mktemp("run")

    def ids(text):
        return tok.encode(text, add_special_tokens=False)

    (d / "config.json").write_text(
        json.dumps(
            {
                "harness": ["calc", "search"],
                "model": "smollm2",
                "steps": 2,
                "batch_size": 1,
                "group_size": 2,
                "lr": 1e-5,
                "max_seq_len": 4096,
                "world_size": 1,
                "start_step": 0,
            }
        )
    )
    rows = [
        {
            "step": 0,
            "eval_reward": 0.25,
            "eval_success": 0.25,
            "eval_tasks": 4,
            "eval_failed": 0,
            "eval_s": 3.0,
        },
        {
            "step": 1,
            "reward": 0.5,
            "success": 0.5,
            "rollouts": 2,
            "failed": 0,
            "loss": -0.01,
            "grad_norm": 0.3,
            "clip_frac": 0.0,
            "prob_corr": 0.99,
            "dlogp_mean": 0.01,
            "dlogp_max": 0.2,
            "ratio_out_frac": 0.0,
            "t_rollout": 5.0,
            "t_train": 2.0,
            "t_sync": 0.1,
        },
        {
            "step": 2,
            "reward": 0.625,
            "success": 0.5,
            "rollouts": 2,
            "failed": 1,
            "loss": 0.02,
            "grad_norm": 0.25,
            "clip_frac": 0.01,
            "prob_corr": float("nan"),
            "dlogp_mean": 0.02,
            "dlogp_max": 0.3,
            "ratio_out_frac": 0.0,
            "t_rollout": 6.0,
            "t_train": 2.5,
            "t_sync": 0.1,
            "splits": {"rewrote_history": 1},
            # filled in below: what train.py counted of calls/step_1
            "trainable_tokens": None,
            "samples": None,
            "skipped": None,
            "fwd_tokens": 140,
        },
        {
            "step": 2,
            "eval_reward": 0.5,
            "eval_success": 0.5,
            "eval_tasks": 4,
            "eval_failed": 0,
            "eval_s": 3.0,
        },
    ]
    rows[1]["splits"] = {"new_thread": 1}
    per_harness = [
        {
            "eval_reward/calc": 0.5,
            "eval_success/calc": 0.5,
            "eval_reward/search": 0.0,
            "eval_success/search": 0.0,
        },
        {
            "reward/calc": 0.5,
            "success/calc": 0.5,
            "calls_per_rollout/calc": 2.0,
            "merge_ratio/calc": 1.5,
            "splits/calc": {},
            "reward/search": 0.5,
            "success/search": 0.5,
            "calls_per_rollout/search": 1.0,
            "merge_ratio/search": None,
            "splits/search": {"new_thread": 1},
        },
        {
            "reward/calc": 1.0,
            "success/calc": 1.0,
            "calls_per_rollout/calc": 3.0,
            "merge_ratio/calc": 1.8,
            "splits/calc": {"rewrote_history": 1},
            "reward/search": 0.0,
            "success/search": 0.0,
            "calls_per_rollout/search": 1.5,
            "merge_ratio/search": 1.2,
            "splits/search": {},
        },
        {
            "eval_reward/calc": 0.75,
            "eval_success/calc": 0.75,
            "eval_reward/search": 0.25,
            "eval_success/search": 0.25,
        },
    ]
    rows = [{**r, **h} for r, h in zip(rows, per_harness)]

    def write_metrics():
        (d / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows)
        )  # NaN as train.py writes it

    p0, r0 = (
        ids("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
        ids("It is 4.<|im_end|>"),
    )
    p1, r1 = (
        p0 + r0 + ids("\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n"),
        ids("Yes, 4.<|im_end|>"),
    )
    p2, r2 = (
        p0 + ids("Earlier you said four.<|im_end|>\n<|im_start|>assistant\n"),
        ids("Sure.<|im_end|>"),
    )
    good = [
        call("s1-g0", 0, p0, r0),
        call("s1-g0", 1, p1, r1, parent=0),
        call("s1-g0", 2, p2, r2, hint="rewrote_history"),
    ]
    failed = [call("s1-g1", 0, p0, ids("I do not know"))]
    # a rollout the audit flagged (its tool call read the hidden tests), and whose next request the proxy refused
    cheat = call("s1-g2", 0, p0, ids("<tool_call>cat tests/hidden.py</tool_call>"))
    cheat.response = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "name": "bash", "arguments": {"cmd": "cat tests/hidden.py"}}],
    }
    flags = scan([cheat], {"read_hidden_tests": r"tests/hidden"}, {}, tok.decode)
    flags.append(
        {
            "kind": "route",
            "what": "refused a request to /v1/files",
            "call": None,
            "where": None,
            "match": None,
        }
    )
    p3 = (
        p0
        + cheat.response_ids
        + ids("\n<|im_start|>tool\nassert add(2, 2) == 4<|im_end|>\n<|im_start|>assistant\n")
    )
    after = call("s1-g2", 1, p3, ids("Done.<|im_end|>"), parent=0)
    write_jsonl(str(d / "calls" / "step_1.jsonl"), good + failed + [cheat, after])
    # call rewards as train.py writes them (JSON: string keys); --adv grpo-step gives s1-g2 one advantage per call
    write_jsonl(
        str(d / "rollouts" / "step_1.jsonl"),
        [
            {
                "rollout_id": "s1-g0",
                "task_id": "t7",
                "harness": "calc",
                "reward": 1.0,
                "call_rewards": {"1": 0.25},
                "error": None,
                "seconds": 1.5,
                "advantage": 0.7071,
                "flags": [],
            },
            {
                "rollout_id": "s1-g1",
                "task_id": "t7",
                "harness": "search",
                "reward": None,
                "call_rewards": {},
                "error": ERROR,
                "seconds": 0.5,
                "advantage": None,
                "flags": [],
            },
            {
                "rollout_id": "s1-g2",
                "task_id": "t7",
                "harness": "search",
                "reward": 0.0,
                "call_rewards": {"0": 0.5},
                "error": None,
                "seconds": 0.5,
                "advantage": {"0": 0.45, "1": -1.284},
                "flags": flags,
            },
        ],
    )
    # train.py's count: the samples of the rollouts that finished and got an advantage (s1-g0, s1-g2;
    # not the failed s1-g1, whose call was recorded all the same)
    trained = build_samples(good)[0] + build_samples([cheat, after])[0]
    rows[2]["trainable_tokens"] = sum(sum(s.loss_mask) for s in trained)
    rows[2]["samples"] = len(trained)
    write_metrics()
    long_prompt = ids(
        "<|im_start|>user\n" + "count the words " * 300 + "<|im_end|>\n<|im_start|>assistant\n"
    )
    write_jsonl(
        str(d / "calls" / "eval_2.jsonl"),
        [call("eval2-r0-0", 0, long_prompt, ids("Nine hundred."))],
    )

    result = report(d)
    assert result.returncode == 0, result.stderr
    samples, _ = build_samples(good)
    return {
        "dir": d,
        "stdout": result.stdout,
        "trainable": [sum(s.loss_mask) for s in samples],
        "trainable_tokens": rows[2]["trainable_tokens"],
        "samples": rows[2]["samples"],
        "rows": rows,
        "long_prompt": len(long_prompt),
    }


def test_report_is_one_page_that_needs_no_network(run):
    page = run["dir"] / "report.html"
    assert (
        run["stdout"].startswith(f"wrote {page} (")
        and "trajectories of 2 of 2 steps/evals" in run["stdout"]
    )
    html = page.read_text()
    assert not re.search(
        r"""(src|href)\s*=\s*["']?(https?:)?//""", html
    )  # no script, style or image from elsewhere
    assert "/*DATA*/" not in html and page.stat().st_size < 1_000_000


def test_a_folder_that_is_no_run_says_what_is_expected(tmp_path):
    missing = report(tmp_path / "nope")
    assert (
        missing.returncode == 2
        and "no such folder" in missing.stderr
        and "metrics.jsonl" in missing.stderr
    )
    empty = report(tmp_path)
    assert empty.returncode == 2 and f"{tmp_path} has no metrics.jsonl" in empty.stderr


def test_train_py_writes_the_report_and_the_loggers_through_the_hooks(run, tmp_path, capsys):
    """After training, train.py's rank 0 runs hooks.AFTER_RUN (the report, saying where it is);
    each metrics row goes to the sinks hooks.METRIC_SINKS opens: none without their flags."""
    from types import SimpleNamespace

    from lightning_lite import hooks
    from lightning_lite.extras import loggers
    from lightning_lite.extras import report as report_extra

    run_dir = tmp_path / "run"
    shutil.copytree(run["dir"], run_dir)
    assert report_extra.after_run in hooks.AFTER_RUN
    report_extra.after_run(str(run_dir))
    page = run_dir / "report.html"
    said = f"wrote {page}: plots and trajectories, open it in a browser"
    assert capsys.readouterr().out.strip() == said
    assert page.read_text() == (run["dir"] / "report.html").read_text().replace(
        str(run["dir"]), str(run_dir)
    )
    assert loggers.open_loggers in hooks.METRIC_SINKS
    flags = SimpleNamespace(tensorboard=False, wandb=None, out=str(tmp_path))
    assert loggers.open_loggers(flags, {}) is None
    flags.tensorboard = True
    sink = loggers.open_loggers(flags, {})
    sink.log({"step": 1, "reward": 0.5, "not measured": None})
    sink.close()
    assert os.listdir(tmp_path / "tensorboard")


@contextlib.contextmanager
def chromium_page():
    """A page in headless Chromium, and the list of the errors its scripts raise (skips without
    Chromium or playwright)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(NO_BROWSER)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip(NO_BROWSER)
    errors = []
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            profile, executable_path=chromium, headless=True, args=CHROMIUM_ARGS
        )
        page = browser.new_page()
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(str(e)))
        yield page, errors
        browser.close()


def show_rollout(page, run_dir, label, rollout_id):
    """Open run_dir's report at the batch ``label`` and draw rollout ``rollout_id``."""
    page.goto((run_dir / "report.html").as_uri())
    page.wait_for_selector("#rollout-detail[data-rollout]")
    page.select_option("#batch", label=label)
    page.wait_for_selector(f'#rollouts tr[data-rollout="{rollout_id}"]')
    page.click(f'#rollouts tr[data-rollout="{rollout_id}"]')
    page.wait_for_selector(f'#rollout-detail[data-rollout="{rollout_id}"]')


def test_page_in_headless_chromium(run, tmp_path):
    with chromium_page() as (page, errors):
        page.goto((run["dir"] / "report.html").as_uri())
        page.wait_for_selector("#rollout-detail[data-rollout]")

        # the numbers: config, the last training row (NaN shown as no value), seven plots
        assert "smollm2" in page.inner_text("#config")
        assert page.inner_text('#latest [data-key="reward"]') == "reward 0.625"
        assert page.inner_text('#latest [data-key="prob_corr"]') == "prob_corr —"
        assert page.inner_text('#latest [data-key="eval_success"]') == "eval_success 0.500"
        assert page.locator("#plots svg").count() == 7
        assert page.inner_text('#latest [data-key="fwd_tokens"]') == "fwd_tokens 140"

        # two harnesses: one plot per quantity with a line each, and their split counts summed over the run
        assert page.locator("#harness-plots svg").count() == 4
        assert [
            plot.locator(".legend > span").all_inner_texts()
            for plot in page.locator("#harness-plots .plot").all()
        ] == [["calc", "search"]] * 4
        assert [r.split("\t") for r in page.locator("#harness-splits tr").all_inner_texts()] == [
            ["harness", "new_thread", "rewrote_history"],
            ["calc", "0", "1"],
            ["search", "1", "0"],
        ]

        # calls/step_1 is metrics step 2; its failed rollout says why
        page.select_option("#batch", label=batch_label("step", 1))
        page.wait_for_selector('#rollouts tr[data-rollout="s1-g1"]')
        assert ERROR in page.inner_text('#rollouts tr[data-rollout="s1-g1"]')
        assert "harness" in page.locator("#rollouts th").all_inner_texts()
        assert page.inner_text('#rollouts tr[data-rollout="s1-g1"] td.harness') == "search"
        assert "reward 0.625" in page.inner_text("#batch-summary")
        page.click('#rollouts tr[data-rollout="s1-g1"]')
        page.wait_for_selector('#rollout-detail[data-rollout="s1-g1"]')
        assert f"failed: {ERROR}" in page.inner_text("#rollout-detail")

        # the good rollout: calls 0+1 merged into sample 1, call 2 split off (rewrote_history) into sample 2
        page.select_option("#rollout", label="s1-g0  reward 1")
        page.wait_for_selector('#rollout-detail[data-rollout="s1-g0"]')
        detail = page.inner_text("#rollout-detail")
        assert (
            "trained yes, advantage 0.707" in detail
            and "It is 4." in detail
            and "Are you sure?" in detail
        )
        assert "harness calc" in detail
        calls = page.locator(
            "#rollout-detail table.calls tr"
        ).all_inner_texts()  # its call 1's reward; one advantage
        assert (
            calls[0].split("\t")[-1] == "reward"
            and calls[2].split("\t")[-1] == "0.250"
            and calls[1].split("\t")[-1] == "—"
        )
        first, second = (
            page.locator(f'#rollout-detail .sample[data-sample="{i}"]') for i in (0, 1)
        )
        assert [first.locator(".tok.train").count(), second.locator(".tok.train").count()] == run[
            "trainable"
        ]
        assert first.locator(".call-mark").all_inner_texts() == ["call 0", "call 1"]
        assert first.locator(".split-mark").count() == 0
        assert second.locator(".split-mark").inner_text() == "split: rewrote_history"

        # the flagged rollout: marked in the list, counted per batch, each flag with its call and match
        assert (
            page.inner_text("#flagged-count") == "1 of 3 rollouts flagged (flags: 1 audit, 1 route)"
        )
        assert page.inner_text('#rollouts tr[data-rollout="s1-g2"] .flag-mark') == "⚑ 2"
        assert page.locator('#rollouts tr[data-rollout="s1-g0"] .flag-mark').count() == 0
        page.click('#rollouts tr[data-rollout="s1-g2"]')
        page.wait_for_selector('#rollout-detail[data-rollout="s1-g2"]')
        rows = page.locator("#rollout-detail table.flags tr").all_inner_texts()
        assert [r.split("\t") for r in rows[1:]] == [
            ["audit", "read_hidden_tests", "0", "action", 'bash {"cmd": "cat tests/hidden.py"}'],
            ["route", "refused a request to /v1/files", "—", "—", ""],
        ]

        # its per-call advantage: a range in the list, each call's own (and its reward) in the detail
        assert (
            page.inner_text('#rollouts tr[data-rollout="s1-g2"] td:nth-child(5)') == "-1.28..0.450"
        )
        assert "trained yes, advantage per call: 0: 0.450, 1: -1.28" in page.inner_text(
            "#rollout-detail"
        )
        calls = page.locator("#rollout-detail table.calls tr").all_inner_texts()
        assert [r.split("\t")[-2:] for r in calls] == [
            ["reward", "advantage"],
            ["0.500", "0.450"],
            ["—", "-1.28"],
        ]

        # an eval without a rollouts/ file: rewards unknown; its long prompt drawn collapsed until expanded
        page.select_option("#batch", label=batch_label("eval", 2))
        page.wait_for_selector('#rollout-detail[data-rollout="eval2-r0-0"]')
        assert "No rollouts/ file" in page.inner_text("#batch-summary")
        assert "harness" not in page.locator("#rollouts th").all_inner_texts()
        assert page.locator("#flagged-count").count() == 0 and "flagged" not in page.inner_text(
            "#rollout-detail"
        )
        prompt = page.locator('#rollout-detail .sample[data-sample="0"] .tok.ctx')
        assert prompt.count() == 400
        page.click("#rollout-detail .expand")
        assert prompt.count() == run["long_prompt"]

        # a run of one harness (no /NAME keys): as before, no harness section
        rows = [
            json.loads(line) for line in (run["dir"] / "metrics.jsonl").read_text().splitlines()
        ]
        (tmp_path / "metrics.jsonl").write_text(
            "".join(json.dumps({k: v for k, v in r.items() if "/" not in k}) + "\n" for r in rows)
        )
        assert report(tmp_path).returncode == 0
        page.goto((tmp_path / "report.html").as_uri())
        page.wait_for_selector("#plots svg")
        assert page.locator("#plots svg").count() == 7 and page.locator("#by-harness").is_hidden()
    assert errors == []


def test_failed_rollouts_are_not_trained_and_the_step_counts_what_metrics_counts(run):
    """calls/step_1 holds the failed rollout s1-g1's call (a rollout that timed out or crashed keeps
    what it recorded): none of its tokens is drawn trained, the list counts none of them, and the
    step's count equals metrics.jsonl's trainable_tokens and samples (issue 49: 452 against 324)."""
    with chromium_page() as (page, errors):
        show_rollout(page, run["dir"], batch_label("step", 1), "s1-g1")
        detail = page.locator("#rollout-detail")
        assert "trained no (it failed)" in detail.inner_text()
        assert detail.locator(".tokens .tok.train").count() == 0
        assert detail.locator(".tokens .tok.other").count() > 0
        cells = page.locator("#rollouts td.trained").all_inner_texts()
        n, samples = run["trainable_tokens"], run["samples"]
        assert cells[1] == "0" and sum(int(c) for c in cells) == n
        counts = page.inner_text("#token-counts")
        assert f"{n} trainable tokens in {samples} samples" in counts
        assert f"metrics.jsonl: trainable_tokens {n}, samples {samples}." in counts
        assert page.get_attribute("#token-counts", "class") == "note"
    assert errors == []


def test_a_skipped_update_or_adapter_shows_nothing_trained(run, tmp_path):
    """--lora-per-harness: the search adapter's update was skipped (skipped/search), so its rollout
    s1-g2 is not drawn trained while calc's s1-g0 is; then the whole step's update was skipped
    (skipped: no_signal), and nothing is. metrics.jsonl's trainable_tokens still counts them all."""
    from lightning_lite.extras.report import write_report

    run_dir = tmp_path / "run"
    shutil.copytree(run["dir"], run_dir)
    rows = [dict(r) for r in run["rows"]]
    rows[2]["skipped/calc"] = None
    rows[2]["skipped/search"] = "nonfinite_grad"

    def rewrite():
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        write_report(str(run_dir))

    rewrite()
    with chromium_page() as (page, errors):
        show_rollout(page, run_dir, batch_label("step", 1), "s1-g2")
        detail = page.locator("#rollout-detail")
        why = "adapter search's update was skipped (nonfinite_grad)"
        assert f"trained no ({why})" in detail.inner_text()
        assert detail.locator(".tokens .tok.train").count() == 0
        trained = page.locator("#rollouts td.trained").all_inner_texts()
        assert trained == [str(sum(run["trainable"])), "0", "0"]
        counts = page.inner_text("#token-counts")
        assert (
            f"Trained: {sum(run['trainable'])} tokens" in counts
            and "search: nonfinite_grad" in counts
        )

        rows[2]["skipped"] = "no_signal"
        rewrite()
        show_rollout(page, run_dir, batch_label("step", 1), "s1-g0")
        assert page.locator("#rollout-detail .tokens .tok.train").count() == 0
        assert "the step's update was skipped (no_signal)" in page.inner_text("#rollout-detail")
        assert page.locator("#rollouts td.trained").all_inner_texts() == ["0", "0", "0"]
        counts = page.inner_text("#token-counts")
        assert f"trainable_tokens {run['trainable_tokens']}," in counts
        assert "Trained: 0 tokens (the update was skipped: no_signal)" in counts
    assert errors == []


def test_a_forced_calls_opening_and_its_grammars_tokens_are_drawn_as_what_they_are(
    server, tok, tmp_path
):
    """A calculator call forced through the proxy (tool_choice, its schema's grammar): the opening
    the proxy wrote at the end of the prompt is drawn as that, not as prompt; every sampled token
    as constrained, and those the grammar allowed alone (as many as the trainer's Replay counts)
    as forced by it."""
    import openai

    from harnesses import CALC
    from lightning_lite.extras.grammar import Replay
    from lightning_lite.extras.report import write_report
    from lightning_lite.records import read_calls

    rid = "report-forced-0"
    client = openai.OpenAI(base_url=f"{server.url}/rollout/{rid}/v1", api_key="x", max_retries=0)
    client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "What is 3 + 4? Use the calculator."}],
        tools=[CALC],
        tool_choice={"type": "function", "function": {"name": "calculator"}},
        max_tokens=16,
        temperature=1.0,
        seed=1,
    )
    (recorded,) = [
        c for c in read_calls(str(server.out / "calls.jsonl"), whole=True) if c.rollout_id == rid
    ]
    # Hermes's forced opening (toolcalls.forced), which SmolLM2's template uses
    opening = tok.encode(
        '<tool_call>\n{"name": "calculator", "arguments":', add_special_tokens=False
    )
    assert recorded.grammar and recorded.prompt_ids[-len(opening) :] == opening
    (sample,), _ = build_samples([recorded])
    grammar_forced = Replay([sample], tok, len(tok)).forced
    assert 0 < grammar_forced < len(recorded.response_ids)

    (tmp_path / "config.json").write_text(json.dumps({"model": "smollm2", "max_seq_len": 4096}))
    row = {"step": 1, "reward": 1.0, "trainable_tokens": sum(sample.loss_mask), "samples": 1}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    write_jsonl(str(tmp_path / "calls" / "step_0.jsonl"), [recorded])
    result = {"rollout_id": rid, "task_id": "t0", "harness": "calc", "reward": 1.0}
    result |= {"call_rewards": {}, "error": None, "seconds": 1.0, "advantage": 0.5, "flags": []}
    write_jsonl(str(tmp_path / "rollouts" / "step_0.jsonl"), [result])
    write_report(str(tmp_path))
    with chromium_page() as (page, errors):
        show_rollout(page, tmp_path, batch_label("step", 0), rid)
        tokens = page.locator('#rollout-detail .sample[data-sample="0"]')
        forced = tokens.locator(".tok.forced")
        assert forced.count() == len(opening)
        assert "".join(forced.all_inner_texts()).replace("↵\n", "\n") == tok.decode(opening)
        assert tokens.locator(".tok.ctx").count() == len(recorded.prompt_ids) - len(opening)
        assert tokens.locator(".tok.train.constrained").count() == len(recorded.response_ids)
        assert tokens.locator(".tok.gforced").count() == grammar_forced
    assert errors == []


def test_axes_are_readable_at_a_thousand_steps(tmp_path):
    """1,000 steps: the x axis labels round steps between the first and the last, and each y axis
    round values that share their decimals (0.0002 ... 0.0010, not 8.53e-4)."""
    from lightning_lite.extras.report import write_report

    rows = []
    for step in range(1, 1001):
        rows.append(
            {"step": step, "reward": 0.9 * step / 1000, "dlogp_mean": 8.53e-4 * step / 1000}
        )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_report(str(tmp_path))
    with chromium_page() as (page, errors):
        page.goto((tmp_path / "report.html").as_uri())
        page.wait_for_selector("#plots svg")
        reward = page.locator("#plots .plot").nth(0)
        assert reward.locator(".xtick").all_text_contents() == ["200", "400", "600", "800", "1000"]
        assert reward.locator(".ytick").all_text_contents() == [
            "0.0",
            "0.2",
            "0.4",
            "0.6",
            "0.8",
            "1.0",
        ]
        dlogp = page.locator("#plots .plot").nth(3).locator(".ytick").all_text_contents()
        assert dlogp == ["0.0000", "0.0002", "0.0004", "0.0006", "0.0008", "0.0010"]
    assert errors == []
