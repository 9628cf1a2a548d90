"""Every script in bench/ runs through all its code paths in its --smoke mode and prints its table: a
benchmark that crashes at start cannot go unnoticed (the numbers are not checked: they mean nothing)."""

import glob
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
