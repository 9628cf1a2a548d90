"""Every script in bench/ runs through all its code paths in its --smoke mode and prints its table: a
benchmark that crashes at start cannot go unnoticed (the numbers are not checked: they mean nothing).
And vs_trl.py's reports of seeds measured apart merge into one table."""

import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT

# Found by glob: a new bench is covered without a change here (it needs a --smoke flag). vs_trl.py needs
# TRL's own venv and has its test below.
VS_TRL = os.path.join(ROOT, "bench", "vs_trl.py")
BENCHES = sorted(p for p in glob.glob(os.path.join(ROOT, "bench", "*.py")) if p != VS_TRL)
TRL_PYTHON = os.path.join(ROOT, ".venv-trl", "bin", "python")


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
@pytest.mark.skipif(
    not os.path.exists(TRL_PYTHON),
    reason="TRL's venv .venv-trl is missing: make setup-trl installs it",
)
def test_vs_trl_smoke(tmp_path):
    # Two small steps a side, each side's peak memory and timings, four held-out prompts evaluated
    # three times (base, ours, TRL's): ~5 min on 2 quiet cores, so its own longer limit.
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


@pytest.mark.slow
@pytest.mark.parametrize("path", BENCHES, ids=lambda p: os.path.basename(p)[:-3])
def test_bench_smoke(path):
    code, out, tail = run_smoke(path, [], timeout=300)
    assert code == 0, f"exit code {code} (-9: over 300 s); {tail}"
    # Its table: markdown rows, as the docs show them.
    assert any(line.startswith("|") for line in out.splitlines()), f"no table; {tail}"


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
