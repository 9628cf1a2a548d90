"""Harnesses that are programs (docs/harnesses.md): any agent in any language, run as a process in a
sandbox (extras/sandbox.py) with its endpoint in its environment. The hook: it is a Harness like any
other (``from lightning_lite.extras.programs import SubprocessHarness``); the rollout runner awaits
its ``run``.
"""

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import urllib.parse
from typing import Optional

from ..harness import REPO_ROOT, Endpoint, Harness, Task


class SubprocessHarness(Harness):
    """A harness that is a program: write ``command(task, endpoint) -> (argv, env_extra, cwd)``,
    e.g. ``return ["python", "agent.py", task.prompt], {}, None``, and maybe ``reward``, run on the
    host once it exited. Of the trainer's environment it gets only ``BASE_ENV`` and ``pass_env``: no
    secret reaches an agent that may print it. It runs through ``sandbox``: any object with
    ``wrap(argv, env, cwd, **options) -> host argv`` and ``kill(name)`` (extras/sandbox.py); None:
    bwrap, chosen at its first rollout (train.py: ``--sandbox``)."""

    BASE_ENV = tuple("PATH HOME USER LOGNAME SHELL LANG LANGUAGE TERM TZ TMPDIR PYENV_ROOT".split())
    # more of the trainer's variables the program needs (e.g. "HF_HOME")
    pass_env: tuple[str, ...] = ()
    # where it runs (see above); None: bwrap, chosen at its first rollout
    sandbox = None
    # What the sandbox gets besides the command (see sandbox_options). Read-only: the interpreter
    # and the repo the program runs from (bwrap hides the trainer's HOME; docker sees only its
    # image), the harness's own installs.
    ro_binds: tuple[str, ...] = tuple(dict.fromkeys((sys.base_prefix, sys.prefix, str(REPO_ROOT))))
    # more read-write dirs than the cwd
    binds: tuple[str, ...] = ()
    # bwrap: dirs it must not see though the system is visible (its answers, hidden tests)
    hide: tuple[str, ...] = ()
    # docker's image (a task's own: override sandbox_options), and its CPU, memory and PID limits
    # (sandbox.Limits)
    image: Optional[str] = None
    limits = None

    def sandbox_options(self, task: Task) -> dict:
        """Per task: what ``sandbox.wrap`` gets besides the command (a SWE instance's own image,
        say)."""
        return {key: getattr(self, key) for key in ("binds", "ro_binds", "hide", "image", "limits")}

    def command(self, task: Task, endpoint: Endpoint) -> tuple[list[str], dict, Optional[str]]:
        raise NotImplementedError(f"{type(self).__name__} must define command(task, endpoint)")

    def reward(self, task: Task, stdout: str, returncode: int, workdir: str) -> Optional[float]:
        """Default: the last non-empty stdout line, as a float; None if it is not one."""
        try:
            return float(stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return None

    def environment(self, task: Task, endpoint: Endpoint, extra: Optional[dict]) -> dict:
        """The program's whole environment: the allowed part of ours, the endpoint, then
        ``extra``."""
        allowed = (*self.BASE_ENV, *self.pass_env)
        env = {k: v for k, v in os.environ.items() if k in allowed or k.startswith("LC_")}
        env.update(
            OPENAI_BASE_URL=endpoint.base_url,
            OPENAI_API_KEY=endpoint.api_key,
            OPENAI_MODEL=endpoint.model,
            ANTHROPIC_BASE_URL=endpoint.anthropic_base_url,
            ANTHROPIC_API_KEY=endpoint.api_key,
            LL_ROLLOUT_ID=endpoint.rollout_id,
            LL_TASK_ID=task.id,
        )
        return env | {key: str(value) for key, value in (extra or {}).items()}

    async def run(self, task: Task, endpoint: Endpoint) -> Optional[float]:
        argv, env_extra, cwd = self.command(task, endpoint)
        # the hook to extras/sandbox.py, where neither the harness nor --sandbox chose one
        if self.sandbox is None:
            from . import sandbox

            self.sandbox = sandbox.make("auto")
        workdir = cwd or tempfile.mkdtemp(prefix=f"ll-{endpoint.rollout_id}-")
        # a container's name: unique on the machine
        name = f"ll-{endpoint.rollout_id}-{os.getpid()}"
        port = urllib.parse.urlsplit(endpoint.server_url).port
        options = dict(socket=endpoint.socket, port=port, name=name, **self.sandbox_options(task))
        env = self.environment(task, endpoint, env_extra)
        host_argv = self.sandbox.wrap(argv, env, workdir, **options)
        proc = None
        # Output goes to files, not pipes: a grandchild that escaped the process group and keeps a
        # pipe open would otherwise hold the rollout until its timeout.
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                # start_new_session: its own process group, so killpg reaches its children too
                proc = await asyncio.create_subprocess_exec(
                    *host_argv,
                    cwd=workdir,
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                    stdout=out,
                    stderr=err,
                    stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True,
                )
                code = await proc.wait()
                out.seek(0)
                stdout = out.read().decode(errors="replace")
                err.seek(0)
                stderr = err.read().decode(errors="replace")
                # scoring may run tests for a while: off the event loop, so other rollouts go on
                reward = await asyncio.to_thread(self.reward, task, stdout, code, workdir)
                if reward is None and code != 0:
                    tail = " | ".join(stderr.strip().splitlines()[-3:]) or "(no stderr)"
                    what = f"{argv[0]} (sandbox {self.sandbox.name}) exited with code {code}"
                    raise RuntimeError(f"{what}: {tail}")
                return reward
            finally:
                # Timeout and cancellation land here too: kill the whole group (the agent's shells,
                # servers, test runners), then reap the child (awaiting wait() is what prevents a
                # zombie).
                if proc is not None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
                await asyncio.to_thread(self.sandbox.kill, name)
                if not cwd:
                    shutil.rmtree(workdir, ignore_errors=True)
