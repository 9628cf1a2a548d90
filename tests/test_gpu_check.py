"""scripts/gpu_check.py, the checks for a bare GPU machine, in its --smoke mode on this CPU (the same
code on tiny shapes, gloo): every check writes its key with finite measurements named by their unit,
and a check that fails is reported while the others still run."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_smoke_run_writes_every_check_with_finite_measurements_in_units(tmp_path):
    """9-18 s on 2 cores (18 while other jobs share them): all five checks on tiny shapes, each
    ok, each measurement a finite number whose name ends in its unit, and the table printed."""
    gpu_check = load_script()
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, SCRIPT, "--smoke", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(gpu_check.CHECKS) <= set(report) and report["failed"] == []
    for name in gpu_check.CHECKS:
        result = report[name]
        measured = {k: v for k, v in result.items() if k not in ("config", "ok")}
        assert result["ok"] and len(measured) >= 5, (name, result)
        for key, value in measured.items():
            assert key.endswith(gpu_check.UNITS) and math.isfinite(value), (name, key, value)
    # the numbers each check exists for
    assert report["fsdp"]["after_first_grad_bytes_per_param"] > 0
    assert report["mismatch"]["trainer_bf16_dlogp_p99_nats"] > 0
    assert report["head_memory"]["peak_above_start_bytes"] > 0
    assert report["tree_memory"]["tree_512_peak_above_start_bytes"] > 0
    assert report["weight_sync"]["qwen3_8b_bf16_GB"] == pytest.approx(16.38, abs=0.01)
    assert "trainer_bf16_dlogp_mean_nats" in p.stdout and "failed: []" in p.stdout


def test_a_failing_check_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    """A check that raises gets ok False, its error and what it measured before it failed; the
    next check runs; the exit status is 1 and the JSON says which failed."""
    gpu_check = load_script()

    def broken(sizes, device, dtype, out):
        out["before_s"] = 1.0
        raise RuntimeError("CUDA out of memory (pretend)")

    monkeypatch.setitem(gpu_check.CHECKS, "fsdp", broken)
    out = tmp_path / "gpu_check.json"
    status = gpu_check.main(
        ["--smoke", "--only", "fsdp", "--only", "weight_sync", "--out", str(out)]
    )
    report = json.loads(out.read_text())
    assert status == 1 and report["failed"] == ["fsdp"]
    assert report["fsdp"]["ok"] is False and report["fsdp"]["before_s"] == 1.0
    assert report["fsdp"]["error"] == "RuntimeError: CUDA out of memory (pretend)"
    assert report["weight_sync"]["ok"] and report["weight_sync"]["write_s"] > 0


def test_a_measurement_without_a_unit_fails_its_check():
    gpu_check = load_script()

    def unnamed(sizes, device, dtype, out):
        out["peak"] = 3.0
        out["copy_s"] = float("nan")

    results = gpu_check.run_checks({"unnamed": unnamed}, {}, torch.device("cpu"), torch.float32)
    assert not results["unnamed"]["ok"] and "['peak', 'copy_s']" in results["unnamed"]["error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_smoke_and_without_cuda_it_says_what_to_do(tmp_path):
    gpu_check = load_script()
    with pytest.raises(SystemExit, match="no CUDA device here.*--smoke"):
        gpu_check.main(["--out", str(tmp_path / "x.json")])
