"""swe: mini-swe-agent fixes a bug in a small Python repo (tasks and reward: tasks.py).

Each rollout runs the unmodified ``mini`` CLI (mini-swe-agent 2.4.6, installed by
``tests/real_harnesses/install.sh mini-swe-agent``) as a subprocess in a fresh copy
of the task's repo, against the rollout's base URL, for at most ``step_limit``
model calls and ``time_limit`` seconds. Then the hidden tests score the repo:

    python train.py --harness swe --max-seq-len 8192 --harness-arg step_limit=8

With ``--harness-arg instances=shipped`` (or a JSONL / dataset name, ``repos_dir``, ``split``, ``test_split``) the
tasks are SWE-bench-format instances instead (instances.py): the repository at base_commit, graded by its tests.
"""

from __future__ import annotations

import os
from pathlib import Path

from examples.swe.tasks import CodingHarness
from lightning_lite.harness import REPO_ROOT

MINI = os.environ.get(
    "LL_MINI", str(REPO_ROOT / ".harnesses" / "mini-swe-agent-venv" / "bin" / "mini")
)
INSTALL = "tests/real_harnesses/install.sh mini-swe-agent"


class SweHarness(CodingHarness):
    name = "swe"

    def __init__(self, step_limit: int = 4, time_limit: int = 240, command_timeout: int = 20, **kw):
        if not os.access(MINI, os.X_OK):
            raise ValueError(f"mini-swe-agent is not installed at {MINI}: run {INSTALL}")
        super().__init__(**kw)
        self.step_limit, self.time_limit, self.command_timeout = (
            step_limit,
            time_limit,
            command_timeout,
        )
        # mini's venv may rest on another Python than the trainer's (install.sh takes python3 from PATH)
        python = os.path.realpath(Path(MINI).with_name("python3"))
        self.ro_binds = tuple(
            dict.fromkeys(
                (*self.ro_binds, str(Path(python).parent.parent), str(Path(MINI).parent.parent))
            )
        )

    def agent(self, task, endpoint, repo, home):
        argv = [
            MINI,
            "-m",
            f"openai/{endpoint.model}",
            "-t",
            task.prompt,
            "-y",
            "--exit-immediately",
            "-o",
            f"{home}/traj.json",
            "-c",
            "mini.yaml",  # the stock config (system prompt, bash tool), then our limits
            "-c",
            f"model.model_kwargs.api_base={endpoint.base_url}",
            "-c",
            "model.model_kwargs.num_retries=0",  # a retry would be a second, differently sampled call
            "-c",
            f"agent.step_limit={self.step_limit}",
            "-c",
            "agent.cost_limit=0",
            "-c",
            f"agent.wall_time_limit_seconds={self.time_limit}",  # stops between steps; the repo is still scored
            "-c",
            f"environment.cwd={repo}",
            "-c",
            f"environment.timeout={self.command_timeout}",
        ]
        env = {
            "OPENAI_API_KEY": endpoint.api_key,
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_GLOBAL_CONFIG_DIR": f"{home}/mini",
            "MSWEA_SILENT_STARTUP": "1",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "NO_COLOR": "1",
            "TERM": "dumb",
            "PAGER": "cat",
        }
        return argv, env
