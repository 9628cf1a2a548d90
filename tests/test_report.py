"""report.py: a run folder -> one self-contained report.html, checked in a real headless browser.

The run folder is written here by hand, in train.py's layout, with real SmolLM2 token ids so
that the page decodes them. The browser is Debian's chromium driven by playwright (playwright's
own browser download needs the internet); without them the browser tests skip, and fail under CI
(conftest.require): `make setup-browser`.
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

from conftest import ROOT, require
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
            "entropy_mean": 0.9,
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
            "entropy_mean": 0.8,
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
    # The step's count, by hand (tests/test_report_run.py compares the report with train.py's own):
    # each response token of the rollouts that finished and got an advantage is trained once, in
    # three samples: s1-g0's calls 0 and 1 merged, its call 2 (which rewrote the history) alone, and
    # s1-g2's two calls merged. The failed s1-g1's recorded call counts for nothing.
    trainable = [len(r0) + len(r1), len(r2), len(cheat.response_ids) + len(after.response_ids)]
    rows[2]["trainable_tokens"] = sum(trainable)
    rows[2]["samples"] = 3
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
    return {
        "dir": d,
        "stdout": result.stdout,
        # s1-g0's two samples
        "trainable": trainable[:2],
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


def test_a_folder_that_is_no_run_says_what_is_expected(tmp_path, capsys):
    """A missing folder, or one without metrics.jsonl: exit code 2 and what a run folder holds
    (main in this process: each `python -m` of the report took ~20 s on 2 busy cores)."""
    from lightning_lite.extras.report import main

    with pytest.raises(SystemExit) as missing:
        main([str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert missing.value.code == 2 and "no such folder" in err and "metrics.jsonl" in err
    with pytest.raises(SystemExit) as empty:
        main([str(tmp_path)])
    assert empty.value.code == 2 and f"{tmp_path} has no metrics.jsonl" in capsys.readouterr().err


def page_data(path) -> dict:
    """The DATA object report.py wrote into a report.html."""
    html = open(path).read()
    start = html.index("const DATA = ") + len("const DATA = ")
    return json.loads(html[start : html.index(";</script>", start)])


def test_max_batches_keeps_that_many_spread_over_the_run(tmp_path, capsys):
    """docs/training.md: the page keeps the trajectories of 20 steps/evals spread over the run;
    report --help: --max-batches N keeps at most N, evenly spaced, and 0 keeps all (report.spread:
    the first and the last always in). A run of 25 batches, in the run's order: eval_0, step_0 ...
    step_22, eval_23."""
    from lightning_lite.extras.report import main

    bench_module().write_run(str(tmp_path), 23, 4)
    for k in (0, 23):
        shutil.copy(tmp_path / "calls" / "step_0.jsonl", tmp_path / "calls" / f"eval_{k}.jsonl")
    every = ["eval_0"] + [f"step_{k}" for k in range(23)] + ["eval_23"]

    def kept(*flags):
        """The batches report.html holds (as their calls/ files) and what the report said."""
        main([str(tmp_path), *flags])
        data = page_data(tmp_path / "report.html")
        assert data["batches_found"] == 25
        names = []
        for b in data["batches"]:
            # a step's metrics row is the update it fed: step_K is metrics step K + 1
            k = b["metrics_step"] - (b["kind"] == "step")
            names.append(f"{b['kind']}_{k}")
        return names, capsys.readouterr().out

    # 20 of 25, evenly: positions round(j * 24 / 19), j = 0..19, which leave out every fifth from
    # position 2 (2, 7, 12, 17, 22: step_1, step_6, step_11, step_16, step_21)
    names, said = kept()
    assert names == [
        n for n in every if n not in ("step_1", "step_6", "step_11", "step_16", "step_21")
    ]
    assert "trajectories of 20 of 25 steps/evals (--max-batches 0 keeps all)" in said
    # 4 of 25: positions 0, 8, 16 and 24
    names, said = kept("--max-batches", "4")
    assert names == ["eval_0", "step_7", "step_15", "eval_23"]
    assert "trajectories of 4 of 25 steps/evals (--max-batches 0 keeps all)" in said
    names, said = kept("--max-batches", "0")
    assert names == every and said.rstrip().endswith("trajectories of 25 of 25 steps/evals)")


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


def test_tensorboard_gets_each_rows_numbers_at_its_step(tmp_path):
    """--tensorboard: each metrics row's numbers are scalars at the row's step, read back with
    TensorBoard's own reader; a None (not measured) and the row's step and time are left out.
    (tests/test_train.py's slow test_every_loss_norm_and_estimator_trains reads a run's.)"""
    from types import SimpleNamespace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_lite.extras import loggers

    flags = SimpleNamespace(tensorboard=True, wandb=None, out=str(tmp_path))
    sink = loggers.open_loggers(flags, {})
    sink.log({"step": 1, "reward": 0.5, "not measured": None, "time": 1.7e9})
    sink.log({"step": 2, "reward": 0.25, "loss": -0.125, "time": 1.7e9 + 10})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "reward"]
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(2, -0.125)]


@contextlib.contextmanager
def chromium_page():
    """A page in headless Chromium, and the list of the errors its scripts raise (without Chromium
    or playwright: skips, or fails under CI)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    require(sync_playwright is not None, NO_BROWSER)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    require(bool(chromium), NO_BROWSER)
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

        # the numbers: config, the last training row (NaN shown as no value), eight plots (the
        # entropy's among them)
        assert "smollm2" in page.inner_text("#config")
        assert page.inner_text('#latest [data-key="reward"]') == "reward 0.625"
        assert page.inner_text('#latest [data-key="prob_corr"]') == "prob_corr —"
        assert page.inner_text('#latest [data-key="eval_success"]') == "eval_success 0.500"
        assert page.locator("#plots svg").count() == 8
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
        assert page.locator("#plots svg").count() == 8 and page.locator("#by-harness").is_hidden()
    assert errors == []


def test_failed_rollouts_are_not_trained_and_the_step_counts_the_others_tokens(run):
    """calls/step_1 holds the failed rollout s1-g1's call (a rollout that timed out or crashed keeps
    what it recorded): none of its tokens is drawn trained, the list counts none of them, and the
    step's count is the other rollouts' response tokens in 3 samples, counted by hand and written
    as metrics.jsonl's, which the page says it matches (issue 49: 452 against 324). That it
    matches what train.py counts: tests/test_report_run.py."""
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


# ----------------------------------------------------------------------------- the live page (issue 49)
def bench_module():
    """bench/report_load.py, whose write_run synthesizes a run directory (not trained)."""
    import importlib.util

    path = os.path.join(ROOT, "bench", "report_load.py")
    spec = importlib.util.spec_from_file_location("report_load", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def live_server(*run_dirs):
    """The live page's server of ``run_dirs`` on a free loopback port, its tokenizers loaded; yields
    its URL."""
    import threading

    from lightning_lite.extras.report import make_server

    server = make_server([str(d) for d in run_dirs], "127.0.0.1", 0)
    handler = server.RequestHandlerClass
    for run in handler.runs:
        run.warm()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def http(url, method="GET"):
    """(status, body) of a request, errors included."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def tree_samples(tok):
    """Three samples of two rollouts, built from calls as train.py builds them: a GRPO pair sharing
    its prompt (so the packed tree holds that prefix once) and one of two merged calls."""
    from lightning_lite.algo import assign_advantages

    def ids(text):
        return tok.encode(text, add_special_tokens=False)

    prompt = ids(
        "<|im_start|>user\nWhat is 17 times 23? Think step by step.<|im_end|>\n<|im_start|>assistant\n"
    )
    calls = [
        call("g-0", 0, prompt, ids("17 times 23 is 391.")),
        call("g-1", 0, prompt, ids("It is 400.")),
        call(
            "g-1",
            1,
            prompt + ids("It is 400.") + ids("\nNo, check it."),
            ids("391, sorry."),
            parent=0,
        ),
    ]
    for c in calls:
        c.response_logprobs = [-0.25 - 0.01 * i for i in range(len(c.response_ids))]
    samples = []
    for rid in ("g-0", "g-1"):
        samples += build_samples([c for c in calls if c.rollout_id == rid])[0]
    return assign_advantages(samples, {"g-0": 1.0, "g-1": -1.0})


def test_token_records_map_a_tree_packed_batch_back_to_its_samples(
    model, tok, tmp_path, monkeypatch
):
    """hooks.TOKEN_RECORDERS gets each micro-batch packed as a prefix tree: the recorder's numbers of
    each sample are the trainer's logprobs and entropies of that sample's own trained positions, the
    same as when the samples run as separate rows; the ratio and clip follow algo.policy_loss."""
    import torch

    from lightning_lite import algo, hooks
    from lightning_lite.extras import recorder

    assert recorder.TokenRecorder in hooks.TOKEN_RECORDERS
    monkeypatch.setattr(recorder.RUN, "out", str(tmp_path))
    monkeypatch.setattr(recorder.RUN, "begun", set())
    samples = tree_samples(tok)
    weights = [0.5, 0.25, 0.25]
    tree = algo.collate(samples, weights, tree=True)
    rows = algo.collate(samples, weights, tree=False)
    assert tree["fwd_tokens"] < rows["fwd_tokens"]
    with torch.no_grad():
        packed, packed_entropy = algo.trainer_logprobs_and_entropy(model, tree)
        separate, separate_entropy = algo.trainer_logprobs_and_entropy(model, rows)
    options = {
        "loss": "ppo",
        "clip_low": 0.2,
        "clip_high": 0.28,
        "clip_ratio_c": 3.0,
        "tis_cap": 2.0,
    }
    rec = recorder.TokenRecorder(3, options)
    rec.add(samples, tree, packed, packed_entropy)
    rec.close()
    lines = [json.loads(line) for line in open(tmp_path / "tokens" / "step_3.jsonl")]
    assert len(lines) == len(samples)
    for line in lines:
        (i,) = [
            i
            for i, s in enumerate(samples)
            if s.rollout_id == line["rollout_id"] and s.calls == line["calls"]
        ]
        s = samples[i]
        pos = [p for p, m in enumerate(s.loss_mask) if m]
        assert line["pos"] == pos and line["len"] == len(s.tokens) and line["weight"] == weights[i]
        assert line["token"] == [s.tokens[p] for p in pos]
        assert line["old"] == [round(s.logprobs[p], 6) for p in pos]
        assert line["adv"] == [s.advantages[p] for p in pos] and line["call"] == [
            s.call[p] for p in pos
        ]
        assert max(abs(a - float(separate[i, p])) for a, p in zip(line["logprob"], pos)) < 1e-4
        assert (
            max(abs(h - float(separate_entropy[i, p])) for h, p in zip(line["entropy"], pos)) < 1e-4
        )
        assert min(line["entropy"]) >= 0 and max(line["entropy"]) > 0.01
        ratio = [torch.tensor(a - o).exp().item() for a, o in zip(line["logprob"], line["old"])]
        assert max(abs(a - b) for a, b in zip(ratio, line["ratio"])) < 1e-5
        # ppo: a ratio outside [0.8, 1.28] is clipped for a positive advantage above, a negative one below
        for r, a, c in zip(line["ratio"], line["adv"], line["clipped"]):
            assert c == int((a > 0 and r > 1.28) or (a < 0 and r < 0.8) or (a < 0 and r > 3.0))
        assert line["dlogp_max"] == round(
            max(abs(a - o) for a, o in zip(line["logprob"], line["old"])), 6
        )


def test_the_recorder_keeps_the_worst_and_a_random_few(tmp_path, monkeypatch):
    """A pass of 40 samples writes the 8 with the largest |dlogp| (largest first) and up to 4 others
    drawn at random: a step's file is bounded whatever the batch; a second pass of the step (one per
    adapter) appends."""
    import torch

    from lightning_lite import algo
    from lightning_lite.extras import recorder
    from lightning_lite.records import Sample

    monkeypatch.setattr(recorder.RUN, "out", str(tmp_path))
    monkeypatch.setattr(recorder.RUN, "begun", set())
    options = {
        "loss": "tis",
        "clip_low": None,
        "clip_high": None,
        "clip_ratio_c": 3.0,
        "tis_cap": 2.0,
    }
    rec = recorder.TokenRecorder(0, options)
    for mb in range(4):
        samples = []
        for i in range(10):
            n = 10 * mb + i
            s = Sample(f"r{n}", [1, 2, 3, 4], [0, 1, 1, 1], [0.0, -1.0, -1.0, -1.0], calls=[0])
            s.temperature, s.top_k, s.top_p = [1.0] * 4, [0] * 4, [1.0] * 4
            s.version, s.call, s.advantages = [0] * 4, [-1, 0, 0, 0], [0.0, 1.0, 1.0, 1.0]
            samples.append(s)
        batch = algo.collate(samples, [1.0] * 10)
        # sample n's trainer logprob is -1 + n / 100: |dlogp| n / 100
        logprobs = (
            batch["old_logprobs"]
            + batch["loss_mask"] * (torch.arange(10.0) + 10 * mb)[:, None] / 100
        )
        rec.add(samples, batch, logprobs, torch.zeros_like(logprobs))
    rec.close()
    lines = [json.loads(line) for line in open(tmp_path / "tokens" / "step_0.jsonl")]
    worst = [line["rollout_id"] for line in lines if line["why"] == "worst"]
    assert worst == [f"r{n}" for n in range(39, 31, -1)]
    random_ones = [line for line in lines if line["why"] == "random"]
    assert len(random_ones) <= 4 and all(int(line["rollout_id"][1:]) < 32 for line in random_ones)
    # tis: a ratio over the cap (2.0) is clipped; exp(0.39) = 1.48 is not
    assert lines[0]["clipped"] == [0, 0, 0] and lines[0]["ratio"][0] == round(2.718281828**0.39, 6)
    again = recorder.TokenRecorder(0, options)
    again.add(samples[:1], algo.collate(samples[:1], [1.0]), logprobs[:1], logprobs[:1] * 0)
    again.close()
    assert len(open(tmp_path / "tokens" / "step_0.jsonl").readlines()) == len(lines) + 1


def test_the_heartbeat_says_the_phase_and_the_rollouts_in_flight(tmp_path, monkeypatch):
    """hooks.PROGRESS events -> heartbeat.json, replaced whole: the phase, each rollout in flight
    with its seconds, calls so far and its last call's state; a finished one moves to ``finished``."""
    from types import SimpleNamespace

    from lightning_lite import hooks
    from lightning_lite.extras import recorder

    assert recorder.on_progress in hooks.PROGRESS
    beat = recorder.Heartbeat()
    monkeypatch.setattr(recorder.RUN, "out", str(tmp_path))
    monkeypatch.setattr(recorder.RUN, "rank", 0)
    beat.event("phase", {"phase": "rollouts", "step": 4})
    task = SimpleNamespace(id="t")
    harness = SimpleNamespace(name="calc")
    beat.event("rollout_start", {"rollout_id": "a", "task": task, "harness": harness})
    beat.event("rollout_start", {"rollout_id": "b", "task": task, "harness": harness})
    beat.event("call_start", {"rollout_id": "a"})
    done = call("a", 0, [1, 2], [3, 4, 5])
    beat.event("call_end", {"call": done})
    beat.event("call_start", {"rollout_id": "b"})
    result = SimpleNamespace(
        rollout_id="a", task_id="t", harness="calc", reward=1.0, error=None, seconds=2.5
    )
    beat.event("rollout_end", {"result": result})
    beat.write()
    got = json.load(open(tmp_path / "heartbeat.json"))
    assert (
        got["phase"] == "rollouts"
        and got["step"] == 4
        and not os.path.exists(tmp_path / "heartbeat.json.tmp")
    )
    (flying,) = got["in_flight"]
    assert (
        flying["rollout_id"] == "b"
        and flying["calls"] == 0
        and flying["last_call"]["state"] == "generating"
    )
    assert (
        flying["seconds"] >= 0
        and got["finished"][0]["rollout_id"] == "a"
        and got["finished"][0]["reward"] == 1.0
    )


def test_the_server_only_reads_and_says_what_is_torn_or_missing(tmp_path):
    """GET only (405 otherwise); files from inside the run directory only (403 outside, 404
    missing); a torn last line of metrics.jsonl is skipped and said, not a 500; a missing rollouts/
    is said; nothing in the run directory changes."""
    bench = bench_module()
    run_dir = tmp_path / "run"
    bench.write_run(str(run_dir), 3, 4)
    shutil.rmtree(run_dir / "rollouts")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')
    (tmp_path / "secret.txt").write_text("not served")
    # a NaN in a token record (JSON has none; Python writes it): served as null, not a 500
    path = run_dir / "tokens" / "step_2.jsonl"
    lines = path.read_text().splitlines()
    lines[0] = json.dumps({**json.loads(lines[0]), "dlogp_max": float("nan")})
    path.write_text("\n".join(lines) + "\n")
    before = sorted((str(p), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    with live_server(run_dir) as url:
        got = json.loads(http(url + "api/metrics?run=0")[1])
        assert [row["step"] for row in got["rows"]] == [1, 2, 3] and got["lines"] == 3
        assert got["notes"] == ["metrics.jsonl:4: a torn last line (16 bytes) skipped"] and got[
            "missing"
        ] == ["rollouts"]
        assert json.loads(http(url + "api/metrics?run=0&from=2")[1])["rows"][0]["step"] == 3
        assert http(url + "files/0/metrics.jsonl")[0] == 200
        assert http(url + "files/0/../secret.txt")[0] == 403
        assert http(url + "files/0/%2E%2E/secret.txt")[0] == 403
        assert http(url + "files/0/nope.jsonl")[0] == 404 and http(url + "files/7/x")[0] == 404
        assert http(url + "api/metrics", method="POST")[0] == 405
        batch = json.loads(http(url + "api/batch?run=0&kind=step&k=2")[1])
        # no rollouts/ file: what is trained is unknown, and said so
        assert len(batch["rollouts"]) == 4 and batch["rollouts"][0]["trained"] is None
        assert len(batch["records"]) == 4 and batch["records"][0]["sample"] == 0
        assert batch["records"][0]["dlogp_max"] is None
    assert sorted((str(p), p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before


def test_serve_flags(tmp_path, capsys):
    """--serve RUN_DIR RUN_DIR --port 0 serves both on loopback; several RUN_DIRs without --serve
    are refused."""
    import signal

    bench = bench_module()
    for name in ("a", "b"):
        bench.write_run(str(tmp_path / name), 2, 4)
    args = [
        sys.executable,
        "-m",
        "lightning_lite.extras.report",
        str(tmp_path / "a"),
        str(tmp_path / "b"),
    ]
    from lightning_lite.extras.report import main

    with pytest.raises(SystemExit) as refused:
        main(args[3:])
    assert refused.value.code == 2
    assert "one RUN_DIR at a time without --serve" in capsys.readouterr().err
    # The server stops at Ctrl-C as Python's default has it. A pytest started in the background by
    # a non-interactive shell (`make test &`) ignores SIGINT, and a child inherits that: Python then
    # leaves it ignored, and the server ran on. So the child starts with the default, and a server
    # that does not stop dumps every thread's stack (-X faulthandler) at SIGABRT.
    err_path = tmp_path / "server.err"
    serve = [sys.executable, "-X", "faulthandler", *args[1:], "--serve", "--port", "0"]
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with open(err_path, "w") as err:
            p = subprocess.Popen(
                serve + ["--host", "127.0.0.1"],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
    finally:
        signal.signal(signal.SIGINT, inherited)
    try:
        line = p.stdout.readline()
        assert "(read-only; Ctrl-C stops)" in line, line
        url = re.search(r"http://127\.0\.0\.1:\d+/", line)[0]
        runs = json.loads(http(url + "api/runs")[1])
        assert [r["name"] for r in runs] == ["a", "b"]
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # whether SIGINT reached it: blocked or ignored as inherited, or caught and not acted on
            with open(f"/proc/{p.pid}/status") as f:
                masks = [
                    line.strip() for line in f if line.startswith(("SigBlk", "SigIgn", "SigCgt"))
                ]
            p.send_signal(signal.SIGABRT)
            p.wait(timeout=30)
            stacks = err_path.read_text()[-6000:]
            raise AssertionError(f"Ctrl-C did not stop the server ({masks}): {stacks}")


def test_live_page_picks_up_a_new_row_and_shows_a_hung_rollout(tmp_path):
    """Two runs on one plot; a row appended while the page is open is plotted within seconds; a
    rollout in flight far longer than the finished ones is listed first, marked; log scale and
    smoothing redraw the charts."""
    import time

    bench = bench_module()
    for name in ("first", "second"):
        bench.write_run(str(tmp_path / name), 5, 4)
    now = time.time()
    finished = [
        {"rollout_id": f"s5-r{i}", "seconds": 3.0, "reward": 1.0, "error": None} for i in range(6)
    ]
    heartbeat = {
        "time": now,
        "pid": 1,
        "rank": 0,
        "phase": "rollouts",
        "step": 5,
        "phase_since": now - 200,
        "in_flight": [
            {
                "rollout_id": "s5-r6",
                "task_id": "t",
                "harness": "calc",
                "seconds": 4.0,
                "calls": 2,
                "last_call": {"state": "generating", "since": now - 1},
            },
            {
                "rollout_id": "s5-r7",
                "task_id": "t",
                "harness": "calc",
                "seconds": 190.0,
                "calls": 1,
                "last_call": {"state": "tool_calls", "index": 0, "tokens": 9, "since": now - 185},
            },
        ],
        "finished": finished,
    }
    (tmp_path / "first" / "heartbeat.json").write_text(json.dumps(heartbeat))
    with (
        live_server(tmp_path / "first", tmp_path / "second") as url,
        chromium_page() as (page, errors),
    ):
        page.goto(url)
        page.wait_for_selector("body[data-ready='1']")
        assert page.get_attribute("#charts", "data-last-step") == "5, 5"
        legend = page.inner_text('#charts .chart[data-key="reward"]')
        assert "first: reward" in legend and "second: reward" in legend
        flying = page.locator("#inflight tr[data-rollout]")
        assert flying.count() == 2 and flying.nth(0).get_attribute("data-rollout") == "s5-r7"
        assert (
            flying.nth(0).get_attribute("class") == "slow"
            and flying.nth(1).get_attribute("class") == ""
        )
        assert "waiting on the harness" in flying.nth(0).inner_text()
        with open(tmp_path / "first" / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 6, "reward": 0.99, "loss": 0.5}) + "\n")
        t0 = time.time()
        page.wait_for_selector("#charts[data-last-step='6, 5']", timeout=5000)
        assert time.time() - t0 < 4
        # y labels share their decimals, or their exponent's digits (readable at 1,000 steps)
        labels = page.evaluate("tickLabels(null, [0, 0.0002, 0.0004, 0.0006, 0.0008, 0.001])")
        assert labels == ["0.0000", "0.0002", "0.0004", "0.0006", "0.0008", "0.0010"]
        assert page.evaluate("tickLabels(null, [-2e-7, 0, 2e-7])") == ["-2e-7", "0", "2e-7"]
        assert page.evaluate("tickLabels(null, [200, 400, 600])") == ["200", "400", "600"]
        page.check("#log")
        assert page.evaluate("state.charts.dlogp_mean.scales.y.distr") == 3
        page.fill("#smooth", "0.9")
        page.dispatch_event("#smooth", "input")
        smoothed = page.evaluate("state.charts.reward.data[1]")
        raw = page.evaluate("state.metrics[0].map(row => row.reward)")
        assert len(smoothed) == len(raw) == 6 and smoothed[0] == raw[0] and smoothed != raw
    assert errors == []


def test_the_token_view_of_a_16k_token_sample(tok, tmp_path):
    """A 16,000-token sample (a 6,000-token prompt, a 10,000-token reply) with its per-token record:
    the token view draws it, and hovering a trained token shows exactly the recorded numbers; the
    step's worst-token table jumps to its token."""
    import random

    bench = bench_module()
    run_dir = tmp_path / "run"
    bench.write_run(str(run_dir), 1, 4)
    (run_dir / "config.json").write_text(json.dumps({"model": "smollm2", "max_seq_len": 32768}))
    rng = random.Random(1)
    prompt = [rng.randrange(1000, 30000) for _ in range(6000)]
    reply = [rng.randrange(1000, 30000) for _ in range(10000)]
    long = call("s0-r0", 0, prompt, reply)
    long.response_logprobs = [round(-rng.random(), 4) for _ in reply]
    write_jsonl(str(run_dir / "calls" / "step_0.jsonl"), [long])
    info = {
        "rollout_id": "s0-r0",
        "task_id": "t",
        "reward": 1.0,
        "error": None,
        "seconds": 9.0,
        "call_rewards": {},
        "harness": "calc",
        "flags": [],
        "advantage": 0.75,
    }
    (run_dir / "rollouts" / "step_0.jsonl").write_text(json.dumps(info) + "\n")
    (sample,), _ = build_samples([long])
    assert len(sample.tokens) == 16000
    line = bench.token_line(0, sample, 0.75, rng, "worst")
    (run_dir / "tokens" / "step_0.jsonl").write_text(json.dumps(line) + "\n")
    with live_server(run_dir) as url, chromium_page() as (page, errors):
        page.goto(url)
        page.wait_for_selector("#detail[data-rollout='s0-r0']")
        tokens = page.locator('#detail .sample[data-sample="0"] .tokens')
        # the prompt's middle is collapsed; every reply token is drawn
        assert tokens.locator(".tok.sampled").count() == 10000
        for j in (0, 4321, 9999):
            pos = line["pos"][j]
            tokens.locator(f'.tok[data-pos="{pos}"]').hover()
            page.wait_for_selector(f"#tip[data-pos='{pos}']")
            shown = {
                k: page.inner_text(f'#tip [data-k="{k}"] b')
                for k in (
                    "id",
                    "trainer logprob",
                    "rollout logprob",
                    "ratio",
                    "clipped",
                    "advantage",
                    "entropy",
                    "call",
                    "policy version",
                )
            }
            assert int(shown["id"]) == line["token"][j] == reply[j]
            assert (
                float(shown["trainer logprob"]) == line["logprob"][j]
                and float(shown["rollout logprob"]) == line["old"][j]
            )
            assert (
                float(shown["ratio"]) == line["ratio"][j]
                and float(shown["advantage"]) == line["adv"][j]
            )
            assert shown["clipped"] == ("yes" if line["clipped"][j] else "no")
            assert float(shown["entropy"]) == line["entropy"][j]
            assert (
                int(shown["call"]) == line["call"][j]
                and int(shown["policy version"]) == line["version"][j]
            )
        worst = page.locator("#worst tr[data-pos]").first
        pos = worst.get_attribute("data-pos")
        worst.click()
        page.wait_for_selector(f'#detail .tok.flash[data-pos="{pos}"]')
        # colored by |dlogp|: a recorded token's background says how far the two logprobs are
        page.select_option("#color", "dlogp")
        page.wait_for_selector("#detail[data-rollout='s0-r0']")
        background = tokens.locator(f'.tok[data-pos="{line["pos"][0]}"]').evaluate(
            "e => e.style.background"
        )
        assert background.startswith("rgba(220, 38, 38")
        # colored by entropy: blue, deeper the more uncertain the trainer's distribution
        page.select_option("#color", "entropy")
        page.wait_for_selector("#detail[data-rollout='s0-r0']")
        background = tokens.locator(f'.tok[data-pos="{line["pos"][0]}"]').evaluate(
            "e => e.style.background"
        )
        assert background.startswith("rgba(37, 99, 235")
        # as messages: the prompt the harness sent, the reply the model gave
        messages = page.locator("#detail .messages .msg")
        assert messages.count() == 2 and "(the prompt)" in messages.nth(0).inner_text()
        assert "assistant (stop, 10000 tokens)" in messages.nth(1).inner_text()
    assert errors == []


def test_a_200_step_64_rollout_run_loads_with_its_newest_step(tmp_path):
    """The live page of a synthesized 200-step run of 64 rollouts a step (12,800 rollouts, 25,600
    calls) reaches its first full draw (charts to step 200, the newest step's 64 rollouts; a group
    shown side by side, the list sorted by reward) with no script error. How fast is
    bench/report_load.py's to measure (0.8 s at 200 and 1,000 steps: docs/training.md); the 60 s
    here only stops a page that never draws, which no busy machine comes near."""
    bench = bench_module()
    bench.write_run(str(tmp_path / "run"), 200, 64)
    with live_server(tmp_path / "run") as url, chromium_page() as (page, errors):
        page.goto(url, timeout=60_000)
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        assert page.locator("#rollouts tr[data-rollout]").count() == 64
        assert page.get_attribute("#charts", "data-last-step") == "200"
        # a group side by side: the 4 rollouts of the first one's task
        page.click("#show-group")
        assert page.locator("#group .col").count() == 4
        # sorted by reward, highest first
        page.click('#rollouts th[data-col="3"]')
        rewards = page.locator("#rollouts tr[data-rollout] td:nth-child(4)").all_inner_texts()
        assert rewards == sorted(rewards, reverse=True)
    assert errors == []
