"""Every script in bench/ runs through all its code paths in its --smoke mode and prints its table: a
benchmark that crashes at start cannot go unnoticed (the numbers are not checked: they mean nothing)."""

import glob
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT

# Found by glob: a new bench is covered without a change here (it needs a --smoke flag).
BENCHES = sorted(glob.glob(os.path.join(ROOT, "bench", "*.py")))


@pytest.mark.slow
@pytest.mark.parametrize("path", BENCHES, ids=lambda p: os.path.basename(p)[:-3])
def test_bench_smoke(path):
    # Its own process group: a timeout ends the servers and train.py runs a bench starts, too.
    p = subprocess.Popen(
        [sys.executable, path, "--smoke"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    tail = f"stdout ends:\n{out[-3000:]}\nstderr ends:\n{err[-3000:]}"
    assert p.returncode == 0, f"exit code {p.returncode} (-9: over 300 s); {tail}"
    # Its table: markdown rows, as the docs show them.
    assert any(line.startswith("|") for line in out.splitlines()), f"no table; {tail}"
