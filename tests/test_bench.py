"""Every script in bench/ runs through all its code paths in its --smoke mode and prints the tables it
promises: their columns, a row at least, and in each cell a value of the right kind (a positive number
where one must be); a benchmark that crashes at start or prints an empty or nonsensical table cannot go
unnoticed. The numbers' sizes are not checked: a smoke run's numbers mean nothing. And vs_trl.py's
reports of seeds measured apart merge into one table."""

import glob
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, require

# Found by glob: a new bench is covered without a change here (it needs a --smoke flag). vs_trl.py needs
# TRL's own venv and has its test below.
VS_TRL = os.path.join(ROOT, "bench", "vs_trl.py")
BENCHES = sorted(p for p in glob.glob(os.path.join(ROOT, "bench", "*.py")) if p != VS_TRL)
TRL_PYTHON = os.path.join(ROOT, ".venv-trl", "bin", "python")

# What each bench's --smoke output promises: its markdown tables in order, each as its columns and what
# every cell of a column holds. POS: a number > 0; NONNEG: a number >= 0 (a time or a size that a tiny
# smoke run may round to 0, a step with no signal trains for 0 s); NUM: any finite number (a difference
# that may be negative); any other string: a regular expression the whole cell matches; a tuple: any of
# its kinds. A number may carry thousands separators and a unit ("x", "%", " KB"). A table's rows have
# all its columns, or at least MIN_CELLS[name] where some rows leave the last ones out.
POS, NONNEG, NUM = "a number > 0", "a number >= 0", "a finite number"
TABLES = {
    "decode_roofline": [
        {
            "batch": POS,
            "decode tok/s": POS,
            "roofline tok/s": POS,
            "of roofline": POS,
            "bound by": "memory|compute",
            "GFLOP/step": POS,
            "MB/step": POS,
            "tokens": POS,
        }
    ],
    "decode_speed": [
        # "vs 64": decode speed against the first of --smoke's contexts (64 and 128)
        {"context": POS, "prefill s": POS, "decode tok/s": POS, "vs 64": POS, "tokens": POS}
    ],
    "lora": [
        {
            "mode": r"full|--lora \d+",
            "trainable / all params": r"[\d,]+ / [\d,]+ \(\d+\.\d\d%\)",
            "t_train s": NONNEG,
            "sync copy s": NONNEG,
            "peak RSS GB": POS,
            "reward": r"[01]\.\d{3}",
        },
        {
            "harnesses": POS,
            "samples": POS,
            "tokens": POS,
            "per-harness loop s": POS,
            "one pass s": POS,
            "speed-up": POS,
            "max weight diff": NONNEG,
        },
    ],
    "memory": [
        {
            "run": "full",
            "floor GB": POS,
            # each phase: the peak GB and its growth, or empty for a phase the smoke run skips
            **dict.fromkeys(
                ("model load", "rollouts", "update", "sync", "evaluation", "checkpoint", "between"),
                r"(\d+\.\d\d \(\+-?\d+\.\d\d\))?",
            ),
            "peak GB": POS,
            "peak / floor": POS,
        }
    ],
    "merging": [
        {
            "rollout": r"[\w/]+ \d+",
            "calls": POS,
            "samples": POS,
            "total tok": POS,
            "ids held": POS,
            "time ms": NONNEG,
            "us/call": NONNEG,
            "ns/id held": NONNEG,
            "ns/merged": NONNEG,
            "peak MiB": NONNEG,
            "train tok merged": POS,
            "one per call": POS,
            "ratio": POS,
        }
    ],
    "proxy_overhead": [
        {
            "mode": "json|stream",
            "conc": POS,
            "target": "direct|lightning-lite|litellm",
            # LiteLLM's row says why it has no numbers (--smoke: --no-litellm)
            "p50 ms": (POS, r"skipped \(.+\)|failed: .+"),
            "p99 ms": POS,
            "req/s": POS,
            "+p50 ms": NUM,
            "+p99 ms": NUM,
            "litellm/ours +p50": (NUM, "n/a"),
            "+p99": (NUM, "n/a"),
        },
        {
            "turns": r"\d+-\d+",
            "prompt tok": POS,
            "reuse on: ms": POS,
            "added ms": NUM,
            "reuse off: ms": POS,
            "added ms ": NUM,  # (a second "added ms": the space only keeps the key apart)
            "prompt tok ": POS,
            "direct ms": POS,
        },
    ],
    "report_load": [
        {
            "steps": POS,
            "rollouts a step": POS,
            "synthesized in s": NONNEG,
            "routes s": POS,
            "page load s (Chromium)": (POS, "no browser"),
            "tokens/ per 1,000 trained tokens": POS,
        }
    ],
    "sandbox_startup": [
        {
            "sandbox": "none|bwrap|docker",
            "conc": POS,
            "measure": "exit|request|exec",
            "first (s)": POS,
            "median (s)": POS,
            "p90 (s)": POS,
            "starts/s": POS,
        }
    ],
    "stream_latency": [
        {
            "api": "chat|responses|anthropic",
            "first content (s)": POS,
            "whole answer (s)": POS,
            "tokens": POS,
        }
    ],
    "train_step": [
        {
            "workload": r"\S.*",
            "rollouts": POS,
            "samples": POS,
            "trainable": POS,
            "fwd tree": POS,
            "fwd rows": POS,
            "ratio": POS,
            "s tree": NONNEG,
            "s rows": NONNEG,
            "speedup": POS,
            # whole tokens a second: a smoke workload of 40 tokens on a loaded machine may print 0
            "trainable tok/s tree": NONNEG,
            "rows": NONNEG,
        }
    ],
}
# proxy_overhead's part 1: the direct engine's rows end after req/s, LiteLLM's skipped rows after its
# reason.
MIN_CELLS = {"proxy_overhead": 4}


def markdown_tables(out: str) -> list:
    """The markdown tables in ``out``, as [(header cells, [row cells, ...]), ...]: a | line, a |---|
    line, then the | lines that follow."""
    lines = [line.strip() for line in out.splitlines()]
    cells = lambda line: [c.strip() for c in line[1:-1].split("|")]  # noqa: E731
    found = []
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|(---\|)+", lines[i + 1]):
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(cells(row))
            found.append((cells(line), rows))
    return found


def cell_is(kind, cell: str) -> bool:
    """Whether ``cell`` holds a value of ``kind`` (see TABLES)."""
    if isinstance(kind, tuple):
        return any(cell_is(k, cell) for k in kind)
    if kind not in (POS, NONNEG, NUM):
        return re.fullmatch(kind, cell) is not None
    text = cell.replace(",", "")
    for unit in (" KB", "x", "%"):
        text = text.removesuffix(unit)
    try:
        value = float(text)
    except ValueError:
        return False
    if not math.isfinite(value):
        return False
    return value > 0 if kind == POS else value >= 0 if kind == NONNEG else True


def check_tables(name: str, out: str) -> list:
    """What is wrong with bench ``name``'s tables in its output ``out``, as sentences (none: nothing)."""
    got, want = markdown_tables(out), TABLES[name]
    headers = [h for h, _ in got]
    expected = [[c.strip() for c in spec] for spec in want]
    if headers != expected:
        return [f"tables with columns {headers}, not {expected}"]
    problems = []
    for (header, rows), spec in zip(got, want):
        if not rows:
            problems.append(f"no rows under {header}")
        for row in rows:
            if not MIN_CELLS.get(name, len(header)) <= len(row) <= len(header):
                problems.append(f"{len(row)} cells for {len(header)} columns: {row}")
            for column, kind, cell in zip(spec, spec.values(), row):
                if not cell_is(kind, cell):
                    problems.append(f"{column.strip()!r} is {cell!r}, not {kind}: {row}")
    return problems


def run_smoke(path, args, timeout):
    """``path --smoke`` plus ``args`` in its own process group (a timeout ends the servers and train.py
    runs a bench starts, too): (exit code, stdout, the output's tails for a failure's message)."""
    p = subprocess.Popen(
        [sys.executable, path, "--smoke", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    return p.returncode, out, f"stdout ends:\n{out[-3000:]}\nstderr ends:\n{err[-3000:]}"


@pytest.mark.slow
def test_vs_trl_smoke(tmp_path):
    """bench/vs_trl.py --smoke (make test-trl; make test-slow leaves it out): two small steps a side,
    each side's peak memory and timings, four held-out prompts evaluated three times (base, ours,
    TRL's); ~5 min on 2 quiet cores, so its own longer limit. Without .venv-trl it skips, and fails
    under CI (.ci/run runs make setup-trl first)."""
    require(
        os.path.exists(TRL_PYTHON), "TRL's venv .venv-trl is missing: make setup-trl installs it"
    )
    code, out, tail = run_smoke(VS_TRL, ["--out", str(tmp_path)], timeout=1200)
    assert code == 0, f"exit code {code} (-9: over 1200 s); {tail}"
    rows = [
        line for line in out.splitlines() if line.startswith("| ours") or line.startswith("| TRL")
    ]
    assert len(rows) == 2, f"no row for each side; {tail}"
    # The same prompts on both sides, token for token.
    assert "identical on both sides: yes" in out, tail
    with open(tmp_path / "vs_trl.json") as f:
        got = json.load(f)
    for side in ("ours", "trl"):
        assert len(got["results"][0][side]["steps"]) == 2, side


# Seconds a bench's smoke run may take before it counts as hung (300 unless named here).
SMOKE_TIMEOUT = {"train_step": 900}


@pytest.mark.slow
@pytest.mark.parametrize("path", BENCHES, ids=lambda p: os.path.basename(p)[:-3])
def test_bench_smoke(path):
    """The bench runs in its --smoke mode and prints the tables TABLES says it promises."""
    name = os.path.basename(path)[:-3]
    assert name in TABLES, f"bench/{name}.py is new: add the columns its tables promise to TABLES"
    # A bound for a hung smoke run, not a timing: train_step's, the slowest (two train.py steps
    # recorded, then six trainings), ran past 300 s at a load of ~8 on 2 cores.
    timeout = SMOKE_TIMEOUT.get(name, 300)
    code, out, tail = run_smoke(path, [], timeout=timeout)
    assert code == 0, f"exit code {code} (-9: over {timeout} s); {tail}"
    problems = check_tables(name, out)
    assert not problems, "\n".join(problems) + f"\n{tail}"


def test_the_table_check_finds_what_is_wrong():
    """check_tables, on hand-written output: a table as promised passes; a missing or renamed column,
    no rows, a row with a cell too many, a negative or non-numeric time, a zero rate are each found."""
    head = "| api | first content (s) | whole answer (s) | tokens |\n|---|---|---|---|\n"
    good = head + "| chat | 0.72 | 2.84 | 4 |\n| anthropic | 0.85 | 2,930.5 | 4 |\n"
    assert check_tables("stream_latency", "warm-up done\n" + good + "\nthe end\n") == []
    assert check_tables("stream_latency", "no table\n") == [
        "tables with columns [], not [['api', 'first content (s)', 'whole answer (s)', 'tokens']]"
    ]
    renamed = good.replace("| tokens |", "| tok |", 1)
    assert check_tables("stream_latency", renamed)[0].startswith("tables with columns")
    assert check_tables("stream_latency", head) == [
        "no rows under ['api', 'first content (s)', 'whole answer (s)', 'tokens']"
    ]
    for row, problem in [
        ("| chat | 0.72 | 2.84 | 4 | 5 |", "5 cells for 4 columns"),
        ("| chat | -0.72 | 2.84 | 4 |", "'first content (s)' is '-0.72', not a number > 0"),
        ("| chat | 0.72 | nan | 4 |", "'whole answer (s)' is 'nan', not a number > 0"),
        ("| chat | 0.72 | n/a | 4 |", "'whole answer (s)' is 'n/a', not a number > 0"),
        ("| chat | 0.72 | 2.84 | 0 |", "'tokens' is '0', not a number > 0"),
        ("| grpc | 0.72 | 2.84 | 4 |", "'api' is 'grpc', not chat|responses|anthropic"),
    ]:
        (got,) = check_tables("stream_latency", head + row + "\n")
        assert got.startswith(problem), got
    # Where a kind is a choice: a skipped LiteLLM row of proxy_overhead passes, a made-up reason not.
    part2 = (
        "| turns | prompt tok | reuse on: ms | added ms | reuse off: ms | added ms | prompt tok "
    )
    part2 += "| direct ms |\n|---|---|---|---|---|---|---|---|\n| 1-5 | 962 | 8.10 | -0.5 | 8.21 "
    part2 += "| 7.12 | 962 | 1.15 |\n"
    part1 = (
        "| mode | conc | target | p50 ms | p99 ms | req/s | +p50 ms | +p99 ms | litellm/ours +p50 "
    )
    part1 += "| +p99 |\n" + "|---" * 10 + "|\n| json | 1 | direct | 0.45 | 5.75 | 742 |\n"
    skipped = part1 + "| json | 1 | litellm | skipped (--no-litellm) |\n\n" + part2
    assert check_tables("proxy_overhead", skipped) == []
    (got,) = check_tables("proxy_overhead", skipped.replace("skipped (--no-litellm)", "fast"))
    assert got.startswith("'p50 ms' is 'fast'"), got


def test_vs_trl_tables_of_two_sessions_merge_into_one(tmp_path):
    """Seeds measured apart (--first-seed, another --out) make one table with --table A B; runs of
    other settings or a seed given twice are refused with what differs."""
    spec = importlib.util.spec_from_file_location("vs_trl", VS_TRL)
    vs_trl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vs_trl)
    base = {"settings": {"lr": 2e-5}, "steps": 30, "eval_tasks": 100, "versions": {"trl": "1"}}

    def saved(name, seeds, minutes, **changed):
        data = dict(base, results=[{"seed": s} for s in seeds], seeds=len(seeds), minutes=minutes)
        data.update(changed)
        path = tmp_path / name
        path.write_text(json.dumps(data))
        return str(path)

    a = saved("a.json", [0], 50.0)
    b = saved("b.json", [1, 2], 90.0)
    data = vs_trl.merged([a, b])
    assert [r["seed"] for r in data["results"]] == [0, 1, 2]
    assert data["seeds"] == 3 and data["minutes"] == 140.0 and data["steps"] == 30
    other = saved("c.json", [3], 50.0, steps=20)
    with pytest.raises(SystemExit, match="its steps \\(20\\) differ"):
        vs_trl.merged([a, other])
    with pytest.raises(SystemExit, match="a seed is in two of the files"):
        vs_trl.merged([a, a])
