"""train.py's flags reach what they set: run train.py itself and look at what its proxy answers."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

# A harness file for train.py's --harness: its one task is never run (--steps 0). Loading it adds a
# hooks.ROLLOUT_SETUP entry, which train.py calls with its proxy server once that is up: it pauses
# the backend as train.py's sync_weights does, sends a chat call, resumes, sends another, writes
# what each got to $PROBE_OUT and ends the process (nothing else of the run is under test).
PROBE = r'''
import json, os
import requests
from lightning_lite import hooks
from lightning_lite.harness import Harness, Task


class Probe(Harness):
    name = "probe"

    def tasks(self, split):
        return [Task(f"{split}-0", "Hi")]

    async def run(self, task, endpoint):
        return 0.0


def call(endpoint):
    """A one-token chat call on ``endpoint``: (status, Retry-After, error type), or "waited" when
    no answer came within 10 s."""
    body = {"model": endpoint.model, "messages": [{"role": "user", "content": "Hi"}]}
    headers = {"Authorization": f"Bearer {endpoint.api_key}"}
    try:
        r = requests.post(
            endpoint.base_url + "/chat/completions",
            json=dict(body, max_tokens=1),
            headers=headers,
            timeout=10,
        )
    except requests.Timeout:
        return "waited"
    error = r.json().get("error", {}).get("type") if r.status_code != 200 else None
    return [r.status_code, r.headers.get("Retry-After"), error]


def probe(harnesses, args, server, log):
    endpoint = server.endpoint("probe", args.model)
    backend = server.proxy.backend
    backend.pause()
    paused = call(endpoint)
    backend.resume()
    resumed = call(endpoint)
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump({"paused": paused, "resumed": resumed}, f)
    os._exit(0)


hooks.ROLLOUT_SETUP.append(probe)
'''


# train.py's start-up (imports, the embedded model, the Learner): 9.4 s of CPU, 21-36 s on this shared
# 2-core machine (load 6-9).
@pytest.mark.slow
def test_pause_retry_after_from_train_py_answers_calls_during_a_pause_429_with_retry_after(
    tmp_path,
):
    """docs/gpus.md (Pause): with ``--pause-retry-after S`` a call that arrives while train.py's
    backend is paused for a weight sync is answered 429 with ``Retry-After: S`` (not made to
    wait); once the backend resumes, calls are served again."""
    harness = tmp_path / "probe.py"
    harness.write_text(PROBE)
    out = tmp_path / "probe.json"
    argv = [sys.executable, "train.py", "--harness", f"{harness}:Probe", "--steps", "0"]
    argv += ["--eval-tasks", "0", "--out", str(tmp_path / "run"), "--pause-retry-after", "2.5"]
    done = subprocess.run(
        argv,
        cwd=ROOT,
        env={**os.environ, "PROBE_OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["paused"] == [429, "2.5", "rate_limit_error"], got
    assert got["resumed"] == [200, None, None], got
