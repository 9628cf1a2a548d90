"""Sandboxes for the programs a rollout runs (docs/sandboxes.md). The hook: a SubprocessHarness
(extras/programs.py) runs its command through its ``sandbox`` attribute, any object whose ``wrap``
turns a command into the host command that runs it inside, with exactly the environment given.
``make(kind)`` gives one; at import this file adds ``setup`` to ``hooks.ROLLOUT_SETUP``, which gives
train.py's program harnesses theirs (``--sandbox``)::

    >>> make("bwrap", hide=["runs/x"]).wrap(["python3", "agent.py"], {"PATH": "/usr/bin"},
    ...     "/tmp/ll-r0/repo", socket="/tmp/ll-proxy-1/0.sock", port=8000)
    ['bwrap', '--ro-bind', '/', '/', ..., 'python3', '.../sandbox.py', '/tmp/ll-proxy-1/0.sock',
     '8000', '--', 'python3', 'agent.py']

With ``socket`` and ``port``, 127.0.0.1:``port`` inside is bridged to the proxy's Unix socket
``socket``, so a harness's base URL stays ``http://127.0.0.1:PORT/...`` though nothing else is
reachable. The bridge is this file run as a script by the sandbox's own ``python3`` (standard
library only, Python >= 3.8): any image with Python has it.
"""

import contextlib
import os
import shlex
import shutil
import socket as socketlib
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Optional

# the bridge: this file, run inside the sandbox
HERE = os.path.abspath(__file__)
# The sandboxes that reach the proxy through its Unix socket, and so get an Endpoint.socket of their
# own.
BRIDGED = ("bwrap", "docker")


@dataclass
class Limits:
    """Per-rollout resources (docker; bwrap and templates leave them to the rollout's timeout)."""

    # e.g. 2.0
    cpus: Optional[float] = None
    # e.g. "4g"
    memory: Optional[str] = None
    # e.g. 512
    pids: Optional[int] = None


class Sandbox:
    """No sandbox (``none``): the host, the trainer's user, only the environment cleared."""

    name = "none"

    def wrap(self, cmd: list[str], env: dict, cwd: str, **options) -> list[str]:
        """The host argv that runs ``cmd`` in read-write ``cwd`` with exactly ``env``. Of the
        ``options``, each sandbox uses what applies to it: read-write ``binds``, read-only
        ``ro_binds``, never ``hide``; 127.0.0.1:``port`` bridged to ``socket``; docker's ``image``,
        ``limits`` (Limits), container ``name``."""
        return ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *cmd]

    def kill(self, name: Optional[str]):
        """Stop what may outlive the host process once it is killed (a container): nothing here."""


def _bridged(bridge: str, socket: Optional[str], port: Optional[int], cmd: list[str]) -> list[str]:
    """``cmd`` under the bridge (this file at ``bridge`` inside, run by the sandbox's python3) when
    there is a ``socket`` to bridge to."""
    if not socket:
        return list(cmd)
    return ["python3", bridge, socket, str(port), "--", *cmd]


class Bwrap(Sandbox):
    """bubblewrap: the system read-only; the trainer's HOME, /tmp and /run private; no network, no
    other process."""

    name = "bwrap"
    # Its own namespaces: no network but loopback, no other process, a new session (no terminal to
    # inject into).
    UNSHARE = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    UNSHARE += ["--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv"]

    def __init__(self, hide=()):
        self.hide = [os.path.abspath(p) for p in hide]

    def wrap(self, cmd, env, cwd, *, binds=(), ro_binds=(), hide=(), socket=None, port=None, **_):
        argv = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        # Order matters: a later mount covers an earlier one. Private dirs first (HOME holds the
        # trainer's tokens and keys; /run the Docker socket), then what the program needs from them
        # read-only (its interpreter, the repo it runs from), then what it must never see (the run's
        # out dir, a harness's answers), then what it needs from inside those (its venv in a hidden
        # repo), then what it may write.
        hidden = [os.path.abspath(d) for d in (*self.hide, *hide)]
        if socket:
            # the proxy's socket and the bridge too
            ro_binds = [*ro_binds, socket, HERE]
        inside = [d for d in ro_binds if _under(d, hidden)]
        for d in (os.path.expanduser("~"), "/tmp", "/var/tmp", "/run"):
            if os.path.isdir(d):
                argv += ["--tmpfs", d]
        for d in ro_binds:
            if d not in inside:
                argv += ["--ro-bind-try", d, d]
        hidden = [d for d in hidden if os.path.isdir(d)]
        for d in hidden:
            argv += ["--tmpfs", d]
        for d in inside:
            argv += ["--ro-bind-try", d, d]
        for d in (cwd, *binds):
            argv += ["--bind", d, d]
        # Read-only once its mount points exist: a write there fails, as anywhere but its own dirs.
        for d in hidden:
            argv += ["--remount-ro", d]
        argv += [*self.UNSHARE, "--chdir", cwd]
        for k, v in env.items():
            argv += ["--setenv", k, str(v)]
        return argv + ["--", *_bridged(HERE, socket, port, cmd)]


def _under(path: str, dirs: list[str]) -> bool:
    """Whether ``path`` is one of ``dirs`` (absolute) or inside one."""
    path = os.path.abspath(path)
    return any(os.path.commonpath([path, d]) == d for d in dirs)


class Docker(Sandbox):
    """A container of ``image`` (docker or podman): only its image, the binds, and no network at
    all."""

    name = "docker"
    # no network, no capabilities, no setuid gains; removed when it exits
    OPTIONS = ["run", "--rm", "-i", "--network", "none", "--cap-drop", "ALL"]
    OPTIONS += ["--security-opt", "no-new-privileges"]

    def __init__(self, image: Optional[str] = None, cli: str = "docker"):
        # the default image, for tasks that name none
        self.image = image
        # docker or podman
        self.cli = cli

    def wrap(self, cmd, env, cwd, *, binds=(), ro_binds=(), socket=None, port=None, **options):
        image = options.get("image") or self.image
        name = options.get("name")
        limits = options.get("limits") or Limits()
        if not image:
            raise ValueError(
                "the docker sandbox needs an image: the task's, the harness's `image`, "
                "or --sandbox-image"
            )
        argv = [self.cli, *self.OPTIONS, "-w", cwd]
        if name:
            argv += ["--name", name]
        for d in (cwd, *binds):
            argv += ["-v", f"{d}:{d}"]
        # docker would create a missing one
        for d in filter(os.path.exists, ro_binds):
            argv += ["-v", f"{d}:{d}:ro"]
        if socket:
            argv += ["-v", f"{socket}:/ll/proxy.sock", "-v", f"{HERE}:/ll/sandbox.py:ro"]
        if limits.cpus:
            argv += ["--cpus", str(limits.cpus)]
        if limits.memory:
            argv += ["--memory", limits.memory]
        if limits.pids:
            argv += ["--pids-limit", str(limits.pids)]
        for k, v in env.items():
            argv += ["-e", f"{k}={v}"]
        # the proxy's socket as mounted inside, when there is one
        inner_socket = None
        if socket:
            inner_socket = "/ll/proxy.sock"
        return argv + [image, *_bridged("/ll/sandbox.py", inner_socket, port, cmd)]

    def kill(self, name):
        # killing the client leaves the container running
        if name:
            subprocess.run([self.cli, "rm", "-f", name], capture_output=True, timeout=60)


class Template(Sandbox):
    """A command template with ``{argv}`` (and maybe ``{name}``, ``{image}``, ``{cwd}``): a
    Kubernetes pod, say."""

    name = "template"

    def __init__(self, template: str, image: Optional[str] = None, kill: Optional[str] = None):
        if "{argv}" not in template:
            raise ValueError(
                f"a sandbox command template needs {{argv}} (where the command goes): {template!r}"
            )
        self.template = shlex.split(template)
        self.image = image
        # a command template with {name} that stops what a killed rollout left running
        self.kill_template = kill

    def wrap(self, cmd, env, cwd, *, image=None, name=None, **_):
        assignments = shlex.join(f"{k}={v}" for k, v in env.items())
        inner = f"cd {shlex.quote(cwd)} && exec env -i {assignments} {shlex.join(cmd)}"
        fields = {"name": name or "", "image": image or self.image or "", "cwd": cwd}
        argv = []
        for word in self.template:
            if word == "{argv}":
                argv += ["sh", "-c", inner]
            else:
                argv.append(word.format(**fields))
        return argv

    def kill(self, name):
        if self.kill_template and name:
            kill_argv = shlex.split(self.kill_template.format(name=name))
            subprocess.run(kill_argv, capture_output=True, timeout=60)


def make(kind: str = "auto", hide=(), image: Optional[str] = None) -> Sandbox:
    """``auto`` (bwrap where it works, else an error that says how to get it), ``bwrap``,
    ``docker``, ``podman``, ``none``, or a command template with ``{argv}``. ``hide``: paths bwrap
    keeps from the program (the run's out dir); ``image``: docker's default image for tasks that
    name none."""
    if kind == "none":
        return Sandbox()
    if kind in ("auto", "bwrap"):
        problem = _bwrap_problem()
        if problem:
            raise ValueError(
                f"the bwrap sandbox does not work here: {problem}. Install bubblewrap "
                "(apt-get install bubblewrap, or make setup-sandbox), or run rollouts unsandboxed "
                "with --sandbox none"
            )
        return Bwrap(hide)
    if kind in ("docker", "podman"):
        cli = shutil.which(kind)
        if not cli or subprocess.run([cli, "info"], capture_output=True, timeout=60).returncode:
            raise ValueError(
                f"{kind} is not installed or its daemon is not running (`{kind} info` failed): "
                "make setup-sandbox installs and starts Docker here"
            )
        return Docker(image, cli)
    if "{argv}" in kind:
        return Template(kind, image)
    raise ValueError(
        f"unknown sandbox {kind!r}: use auto, bwrap, docker, podman, none or a command template "
        "with {argv}"
    )


def _bwrap_problem() -> Optional[str]:
    if not shutil.which("bwrap"):
        return "bwrap is not installed"
    probe = "bwrap --ro-bind / / --dev /dev --proc /proc --unshare-pid --unshare-net -- true"
    result = subprocess.run(probe.split(), capture_output=True, text=True, timeout=60)
    if result.returncode == 0:
        return None
    return result.stderr.strip() or f"exit code {result.returncode}"


# ---------------------------------------------------------------------------- train.py's set-up


HELP = "where a program harness's rollouts run: auto (bwrap, else an error that says how to install"
HELP += " it), bwrap, docker, podman (untested: docker's code with podman's CLI), none (the host),"
HELP += " or a command template with {argv}"


def add_args(parser):
    """train.py's flags for sandboxes."""
    group = parser.add_argument_group("sandboxes (lightning_lite/extras/sandbox.py)")
    group.add_argument("--sandbox", default="auto", help=HELP)
    group.add_argument("--sandbox-image", help="docker's image for tasks that name none")


def setup(harnesses, args, server, log):
    """hooks.ROLLOUT_SETUP: give each program harness (one with a ``sandbox`` attribute) that chose
    none of its own ``make(args.sandbox)`` (bwrap hides ``args.out``), and ``log`` where it runs;
    exit with the reason when that kind does not work here. A harness whose sandbox reaches the
    proxy through a Unix socket is marked ``bridged``: train.py gives each of its rollouts a socket.
    A Python harness runs in train.py's process (its tools are its own code: no program to
    sandbox)."""
    for harness in harnesses:
        if not hasattr(harness, "sandbox"):
            continue
        if harness.sandbox is None:
            try:
                harness.sandbox = make(args.sandbox, hide=[args.out], image=args.sandbox_image)
            except ValueError as e:
                sys.exit(f"--sandbox {args.sandbox}: {e}")
            log(f"{harness.name}'s rollouts run in sandbox {harness.sandbox.name}")
        harness.bridged = getattr(harness.sandbox, "name", "none") in BRIDGED


# ---------------------------------------------------------------------------- the bridge (inside)


def _pump(source, destination):
    # the other side may go away: then we are done
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            destination.sendall(data)
    # EOF onwards; each side closes when both pumps are done
    with contextlib.suppress(OSError):
        destination.shutdown(socketlib.SHUT_WR)


def bridge(unix_path: str, port: int, cmd: list[str]) -> int:
    """Forward 127.0.0.1:``port`` to ``unix_path`` while ``cmd`` runs; return its exit code
    (128 + N for signal N)."""
    server = socketlib.create_server(("127.0.0.1", port))

    def serve():
        while True:
            connection, _ = server.accept()
            upstream = socketlib.socket(socketlib.AF_UNIX)
            try:
                upstream.connect(unix_path)
            except OSError:
                connection.close()
                continue
            for a, b in ((connection, upstream), (upstream, connection)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    code = subprocess.call(cmd)
    return 128 - code if code < 0 else code


# python3 sandbox.py UNIX_SOCKET PORT -- CMD...: the bridge, inside a sandbox (standard library
# only). Imported, it gives train.py's program harnesses their sandboxes.
if __name__ == "__main__":
    sys.exit(bridge(sys.argv[1], int(sys.argv[2]), sys.argv[4:]))
else:
    from lightning_lite import hooks

    hooks.ROLLOUT_SETUP.append(setup)
