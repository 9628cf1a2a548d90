"""Sandboxes for the programs a rollout runs (README "Sandboxes"): ``make(kind)`` gives one, and its ``wrap`` turns a
command into the host command that runs it inside, with exactly the environment given::

    >>> make("bwrap", hide=["runs/x"]).wrap(["python3", "agent.py"], {"PATH": "/usr/bin"}, "/tmp/ll-r0/repo",
    ...                                      socket="/tmp/ll-proxy-1/0.sock", port=8000)
    ['bwrap', '--ro-bind', '/', '/', ..., 'python3', '.../sandbox.py', '/tmp/ll-proxy-1/0.sock', '8000', '--', 'python3', 'agent.py']

With ``socket`` and ``port``, 127.0.0.1:``port`` inside is bridged to the proxy's Unix socket ``socket``, so a
harness's base URL stays ``http://127.0.0.1:PORT/...`` though nothing else is reachable. The bridge is this file run
as a script by the sandbox's own ``python3`` (standard library only, Python >= 3.8): any image with Python has it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket as socketlib
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Optional

HERE = os.path.abspath(__file__)


@dataclass
class Limits:
    """Per-rollout resources (docker; bwrap and templates leave them to the rollout's timeout)."""

    cpus: Optional[float] = None  # e.g. 2.0
    memory: Optional[str] = None  # e.g. "4g"
    pids: Optional[int] = None  # e.g. 512


class Sandbox:
    """No sandbox (``none``): the host, the trainer's user, only the environment cleared."""

    name = "none"

    def wrap(
        self,
        cmd: list[str],
        env: dict,
        cwd: str,
        *,
        binds=(),
        ro_binds=(),
        hide=(),
        socket: Optional[str] = None,
        port: Optional[int] = None,
        image: Optional[str] = None,
        limits: Optional[Limits] = None,
        name: Optional[str] = None,
    ) -> list[str]:
        """The host argv that runs ``cmd`` in ``cwd`` with exactly ``env`` (see the module docstring)."""
        return ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *cmd]

    def kill(self, name: Optional[str]):
        """Stop what may outlive the host process once it is killed (a container); nothing here."""

    @staticmethod
    def _bridged(
        here: str, socket: Optional[str], port: Optional[int], cmd: list[str]
    ) -> list[str]:
        """``cmd`` under the bridge (this file, at ``here`` inside, run by the sandbox's own python3) when bridged."""
        return ["python3", here, socket, str(port), "--", *cmd] if socket else list(cmd)


class Bwrap(Sandbox):
    name = "bwrap"

    def __init__(self, hide=()):
        self.hide = [os.path.abspath(p) for p in hide]

    def wrap(
        self,
        cmd,
        env,
        cwd,
        *,
        binds=(),
        ro_binds=(),
        hide=(),
        socket=None,
        port=None,
        image=None,
        limits=None,
        name=None,
    ):
        a = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        # Order matters: a later mount covers an earlier one. Private dirs first (HOME holds the trainer's
        # tokens and keys; /run the Docker socket), then what the program needs from them read-only (its
        # interpreter, the repo it runs from), then what it must never see (the run's out dir, a harness's
        # answers), then what it needs from inside those (its venv in a hidden repo), then what it may write.
        hidden = [os.path.abspath(d) for d in (*self.hide, *hide)]
        ro_binds = (
            [*ro_binds, socket, HERE] if socket else ro_binds
        )  # the proxy's socket, the bridge (this file)
        inside = [
            d
            for d in ro_binds
            if any(os.path.commonpath([os.path.abspath(d), h]) == h for h in hidden)
        ]
        for d in (os.path.expanduser("~"), "/tmp", "/var/tmp", "/run"):
            a += ["--tmpfs", d] if os.path.isdir(d) else []
        for d in ro_binds:
            a += ["--ro-bind-try", d, d] if d not in inside else []
        hidden = [d for d in hidden if os.path.isdir(d)]
        for d in hidden:
            a += ["--tmpfs", d]
        for d in inside:
            a += ["--ro-bind-try", d, d]
        for d in (cwd, *binds):
            a += ["--bind", d, d]
        for d in hidden:  # read-only once its mount points exist: a write there fails, as anywhere but its own dirs
            a += ["--remount-ro", d]
        a += [
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--chdir",
            cwd,
        ]
        for k, v in env.items():
            a += ["--setenv", k, str(v)]
        return a + ["--", *self._bridged(HERE, socket, port, cmd)]


class Docker(Sandbox):
    name = "docker"

    def __init__(self, image: Optional[str] = None, cli: str = "docker"):
        self.image, self.cli = image, cli

    def wrap(
        self,
        cmd,
        env,
        cwd,
        *,
        binds=(),
        ro_binds=(),
        hide=(),
        socket=None,
        port=None,
        image=None,
        limits=None,
        name=None,
    ):
        image = image or self.image
        if not image:
            raise ValueError(
                "the docker sandbox needs an image: the task's, the harness's `image`, or --sandbox-image"
            )
        a = [
            self.cli,
            "run",
            "--rm",
            "-i",
            "--network",
            "none",
            "--cap-drop",
            "ALL",
            "--security-opt",
            "no-new-privileges",
            "-w",
            cwd,
            *(["--name", name] if name else []),
        ]
        for d in (cwd, *binds):
            a += ["-v", f"{d}:{d}"]
        for d in filter(os.path.exists, ro_binds):  # docker would create a missing one
            a += ["-v", f"{d}:{d}:ro"]
        if socket:
            a += ["-v", f"{socket}:/ll/proxy.sock", "-v", f"{HERE}:/ll/sandbox.py:ro"]
        limits = limits or Limits()
        a += ["--cpus", str(limits.cpus)] if limits.cpus else []
        a += ["--memory", limits.memory] if limits.memory else []
        a += ["--pids-limit", str(limits.pids)] if limits.pids else []
        for k, v in env.items():
            a += ["-e", f"{k}={v}"]
        return a + [
            image,
            *self._bridged("/ll/sandbox.py", "/ll/proxy.sock" if socket else None, port, cmd),
        ]

    def kill(self, name):
        if name:  # killing the client leaves the container running
            subprocess.run([self.cli, "rm", "-f", name], capture_output=True, timeout=60)


class Template(Sandbox):
    name = "template"

    def __init__(self, template: str, image: Optional[str] = None, kill: Optional[str] = None):
        if "{argv}" not in template:
            raise ValueError(
                f"a sandbox command template needs {{argv}} (where the command goes): {template!r}"
            )
        self.template, self.image, self.kill_template = shlex.split(template), image, kill

    def wrap(
        self,
        cmd,
        env,
        cwd,
        *,
        binds=(),
        ro_binds=(),
        hide=(),
        socket=None,
        port=None,
        image=None,
        limits=None,
        name=None,
    ):
        inner = f"cd {shlex.quote(cwd)} && exec env -i {shlex.join(f'{k}={v}' for k, v in env.items())} {shlex.join(cmd)}"
        fields = {"name": name or "", "image": image or self.image or "", "cwd": cwd}
        return [
            x
            for t in self.template
            for x in (["sh", "-c", inner] if t == "{argv}" else [t.format(**fields)])
        ]

    def kill(self, name):
        if self.kill_template and name:
            subprocess.run(
                shlex.split(self.kill_template.format(name=name)), capture_output=True, timeout=60
            )


def make(kind: str = "auto", hide=(), image: Optional[str] = None) -> Sandbox:
    """``auto`` (bwrap where it works, else an error that says how to get it), ``bwrap``, ``docker``, ``podman``,
    ``none``, or a command template with ``{argv}``. ``hide``: paths bwrap keeps from the program (the run's out dir);
    ``image``: docker's default image for tasks that name none."""
    if kind == "none":
        return Sandbox()
    if kind in ("auto", "bwrap"):
        problem = _bwrap_problem()
        if problem:
            raise ValueError(
                f"the bwrap sandbox does not work here: {problem}. Install bubblewrap (apt-get install "
                "bubblewrap, or make setup-sandbox), or run rollouts unsandboxed with --sandbox none"
            )
        return Bwrap(hide)
    if kind in ("docker", "podman"):
        cli = shutil.which(kind)
        if (
            not cli
            or subprocess.run([cli, "info"], capture_output=True, timeout=60).returncode != 0
        ):
            raise ValueError(
                f"{kind} is not installed or its daemon is not running (`{kind} info` failed): "
                "make setup-sandbox installs and starts Docker here"
            )
        return Docker(image, cli)
    if "{argv}" in kind:
        return Template(kind, image)
    raise ValueError(
        f"unknown sandbox {kind!r}: use auto, bwrap, docker, podman, none or a command template with {{argv}}"
    )


def _bwrap_problem() -> Optional[str]:
    if not shutil.which("bwrap"):
        return "bwrap is not installed"
    p = subprocess.run(
        [
            "bwrap",
            "--ro-bind",
            "/",
            "/",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
            "--unshare-pid",
            "--unshare-net",
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return p.stderr.strip() or f"exit code {p.returncode}" if p.returncode else None


# ---------------------------------------------------------------------------- the bridge (runs inside)


def _pump(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass  # the other side went away
    finally:
        try:
            dst.shutdown(
                socketlib.SHUT_WR
            )  # EOF onwards; each side closes when both pumps are done
        except OSError:
            pass


def bridge(unix_path: str, port: int, cmd: list[str]) -> int:
    """Forward 127.0.0.1:``port`` to ``unix_path`` while ``cmd`` runs; its exit code (128 + N for signal N)."""
    server = socketlib.create_server(("127.0.0.1", port))

    def serve():
        while True:
            conn, _ = server.accept()
            up = socketlib.socket(socketlib.AF_UNIX)
            try:
                up.connect(unix_path)
            except OSError:
                conn.close()
                continue
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    code = subprocess.call(cmd)
    return 128 - code if code < 0 else code


if __name__ == "__main__":  # python3 sandbox.py UNIX_SOCKET PORT -- CMD...
    sys.exit(bridge(sys.argv[1], int(sys.argv[2]), sys.argv[4:]))
