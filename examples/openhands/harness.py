"""openhands: the OpenHands SDK agent fixes a bug in a small Python repo.

Same tasks and reward as examples/swe (see examples/swe/tasks.py). Each rollout
runs ``driver.py`` in the OpenHands venv (Python 3.12, OpenHands SDK 1.58.2, set
up by ``tests/real_harnesses/install.sh openhands``) as a subprocess, with the
SDK's terminal and file editor tools in a fresh copy of the repo, for at most
``max_steps`` agent iterations. Its first prompt is ~6.5k tokens: give the
embedded model a longer context, and let a sample be that long:

    python train.py --harness openhands --max-model-len 16384 --max-seq-len 16384

With ``--harness-arg instances=shipped`` (or a JSONL / dataset name, ``repos_dir``, ``split``, ``test_split``) the
tasks are SWE-bench-format instances instead (examples/swe/instances.py), graded by their own tests.
"""

from __future__ import annotations

import os
from pathlib import Path

from examples.swe.tasks import CodingHarness
from lightning_lite.harness import REPO_ROOT

PYTHON = os.environ.get(
    "LL_OPENHANDS_PYTHON", str(REPO_ROOT / ".harnesses" / "openhands-venv" / "bin" / "python")
)
DRIVER = str(Path(__file__).with_name("driver.py"))
INSTALL = "tests/real_harnesses/install.sh openhands"


class OpenHandsHarness(CodingHarness):
    name = "openhands"

    def __init__(self, max_steps: int = 4, **kw):
        if not os.access(PYTHON, os.X_OK):
            raise ValueError(f"the OpenHands venv is not installed at {PYTHON}: run {INSTALL}")
        super().__init__(**kw)
        self.max_steps = max_steps
        # the venv's interpreter lives in its base prefix (pyenv's, under HOME, which bwrap hides)
        self.ro_binds = (
            *self.ro_binds,
            str(Path(os.path.realpath(PYTHON)).parent.parent),
            str(Path(PYTHON).parent.parent),
            str(Path(DRIVER).parent),
        )  # and the venv itself and driver.py, from the hidden repo

    def agent(self, task, endpoint, repo, home):
        argv = [
            PYTHON,
            DRIVER,
            endpoint.base_url,
            endpoint.model,
            str(repo),
            str(self.max_steps),
            task.prompt,
        ]
        env = {
            "OPENAI_API_KEY": endpoint.api_key,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no cost-map download
            "OPENHANDS_SUPPRESS_BANNER": "1",
            "NO_COLOR": "1",
            "TERM": "dumb",
        }
        return argv, env
