"""The sandboxes (lightning_lite/extras/sandbox.py) with a real proxy: from inside, every escape attempt meets the
refusal expected of it while the rollout's own proxy call succeeds, and what the proxy refused is flagged on the
rollout that tried it; the same probe without a sandbox gets through (so it can tell one from none); docker's
CPU, memory and PID limits hold inside the container."""

import asyncio
import json
import os
import socket
import sys

import pytest

from lightning_lite.extras import sandbox
from lightning_lite.extras.programs import SubprocessHarness
from lightning_lite.harness import Task, run_rollouts
from lightning_lite.proxy import Proxy, ProxyServer
from test_faults import FakeBackend

# The agent: one real call through its base URL, then every escape we can think of. It prints, per attempt,
# "reached: ..." (it got through), "blocked: ERRNO" (the sandbox refused: a path not mounted or private, a
# read-only mount, no permission, nothing listening or no route in a network namespace of its own),
# "blocked: why" (it ran, and what it found is the sandbox's own, not the host's), "refused: HTTP 403" (the
# proxy's refusal) or "probe error: ..." for anything else: a bug of the probe, never counted as blocked.
# Attempts named in T["skip"] are not made.
AGENT = r"""
import errno, json, os, socket, sys, urllib.error, urllib.request
T = json.loads(sys.argv[1])
out = {}
REFUSALS = (errno.ENOENT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ECONNREFUSED, errno.ENETUNREACH,
            errno.EHOSTUNREACH)
class Blocked(Exception):
    pass
def attempt(name, f):
    if name in T["skip"]:
        return
    try:
        out[name] = "reached: " + str(f())[:200]
    except Blocked as e:
        out[name] = "blocked: " + str(e)
    except urllib.error.HTTPError as e:
        out[name] = "refused: HTTP %d" % e.code
    except OSError as e:
        if e.errno in REFUSALS:
            out[name] = "blocked: " + errno.errorcode[e.errno]
        else:
            out[name] = "probe error: %s: %s" % (type(e).__name__, e)
    except Exception as e:
        out[name] = "probe error: %s: %s" % (type(e).__name__, e)
def post(url, body, headers={}):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status
def connect(family, address):
    with socket.socket(family) as s:
        s.settimeout(3)
        s.connect(address)
    return "connected"
def parent_env():
    pid = os.getppid()
    with open("/proc/%d/environ" % pid, "rb") as f:
        names = {v.split(b"=", 1)[0].decode() for v in f.read().split(b"\0") if v}
    extra = sorted(names - set(os.environ))
    if not extra:
        raise Blocked("the parent has only the sandbox's environment")
    return "the parent (pid %d) has %d variables the sandbox did not give" % (pid, len(extra))
def list_out():
    names = os.listdir(T["out"])
    if "metrics.jsonl" not in names:
        raise Blocked("the out dir lists %s, not the run's files" % names)
    return names
def read(path):
    with open(path, "rb") as f:
        return f.read()
def write(path):
    with open(path, "w") as f:
        return f.write("x")
chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
base, server = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_BASE_URL"].split("/rollout/")[0]
attempt("own call", lambda: post(base + "/chat/completions", chat))
attempt("trainer env", lambda: "%d bytes" % len(read("/proc/%d/environ" % T["trainer_pid"])))
attempt("parent env", parent_env)
attempt("home secret", lambda: read(T["secret"]).decode())
attempt("list other rollout", lambda: os.listdir(T["other"]))
attempt("write other rollout", lambda: write(os.path.join(T["other"], "pwned")))
attempt("list out dir", list_out)
attempt("write out dir", lambda: write(os.path.join(T["out"], "pwned")))
attempt("other port", lambda: connect(socket.AF_INET, ("127.0.0.1", T["port"])))
attempt("abstract socket", lambda: connect(socket.AF_UNIX, "\0" + T["abstract"]))
attempt("unix socket", lambda: connect(socket.AF_UNIX, T["unix"]))
attempt("own reward", lambda: post(server + "/rollout/%s/reward" % os.environ["LL_ROLLOUT_ID"], {"reward": 1}))
attempt("other rollout's route", lambda: post(server + "/rollout/%s/v1/chat/completions" % T["other_id"], chat))
attempt("no token", lambda: post(server + "/v1/chat/completions", chat))
attempt("write system", lambda: write("/usr/ll-escape-probe"))
attempt("docker socket", lambda: connect(socket.AF_UNIX, "/run/docker.sock"))
print(json.dumps({"env": dict(os.environ), "attempts": out}))
"""

# What each attempt gives in each sandbox; the proxy refuses the three routes that are not the rollout's own
# in every sandbox, and on the host too.
REFUSED_ROUTES = dict.fromkeys(
    ("own reward", "other rollout's route", "no token"), "refused: HTTP 403"
)
EXPECTED = {
    "bwrap": {
        "own call": "reached: 200",
        "trainer env": "blocked: ENOENT",  # its own /proc: no trainer pid
        "parent env": "blocked: the parent has only the sandbox's environment",  # the bridge
        "home secret": "blocked: ENOENT",  # HOME is a private tmpfs
        "list other rollout": "blocked: ENOENT",  # so is /tmp
        "write other rollout": "blocked: ENOENT",
        "list out dir": "blocked: the out dir lists [], not the run's files",  # hidden: an empty tmpfs
        "write out dir": "blocked: EROFS",  # ... remounted read-only
        "other port": "blocked: ECONNREFUSED",  # its own loopback
        "abstract socket": "blocked: ECONNREFUSED",  # abstract sockets belong to the network namespace
        "unix socket": "blocked: ENOENT",
        **REFUSED_ROUTES,
        "write system": "blocked: EROFS",
        "docker socket": "blocked: ENOENT",  # /run is private
    },
    "docker": {
        "own call": "reached: 200",
        "trainer env": "blocked: ENOENT",
        "parent env": "blocked: the parent has only the sandbox's environment",
        "home secret": "blocked: ENOENT",  # only its image and its binds
        "list other rollout": "blocked: ENOENT",
        "write other rollout": "blocked: ENOENT",
        "list out dir": "blocked: ENOENT",
        "write out dir": "blocked: ENOENT",
        "other port": "blocked: ECONNREFUSED",  # --network none: its own loopback only
        "abstract socket": "blocked: ECONNREFUSED",
        "unix socket": "blocked: ENOENT",
        **REFUSED_ROUTES,
        # The container's own files, thrown away with it (--rm): a pip install may go there.
        "write system": "reached: 1",
        "docker socket": "blocked: ENOENT",
    },
}


class Escaper(SubprocessHarness):
    def __init__(self, box, targets):
        self.sandbox, self.targets, self.seen = box, targets, {}
        self.image = "lightning-lite/sandbox:bookworm"

    def command(self, task, endpoint):
        t = {
            **self.targets,
            "other": self.targets["dirs"][task.prompt == "a"],
            "other_id": "a" if task.prompt == "b" else "b",
        }
        return ["python3", "-c", AGENT, json.dumps(t)], {}, self.targets["dirs"][task.prompt == "b"]

    def reward(self, task, stdout, returncode, workdir):
        self.seen[task.prompt] = json.loads(stdout.strip().splitlines()[-1])
        return 1.0


@pytest.fixture(params=["bwrap", "docker"])
def box(request, tmp_path):
    request.getfixturevalue("bwrap_ok" if request.param == "bwrap" else "docker_image")
    return sandbox.make(request.param, hide=[str(tmp_path / "out")])


def run_escaper(box, tok, tmp_path, monkeypatch, skip=()):
    """Two rollouts ("a" and "b") of the escaping agent in ``box``, with a planted HF token (in the
    trainer's HOME and environment), a run dir, and three listeners on the host: a loopback port, an
    abstract Unix socket and a Unix socket in the trainer's HOME. Returns (the rollouts' results,
    what each agent printed, the proxy's flags per rollout, the rollouts' dirs, the out dir)."""
    home, out = tmp_path / "home", tmp_path / "out"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_planted_secret")
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    monkeypatch.setenv("HOME", str(home))  # the trainer's HOME, as the sandbox sees it
    monkeypatch.setenv("HF_TOKEN", "hf_planted_env")
    dirs = [str(tmp_path / "ra"), str(tmp_path / "rb")]
    for d in dirs:
        os.mkdir(d)
    # Something else on the host: a loopback port, an abstract Unix socket (bound to the network
    # namespace), a Unix socket file in the trainer's HOME. The host itself reaches all three.
    listener = socket.create_server(("127.0.0.1", 0))
    abstract, unix = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    abstract_name = f"ll-escape-probe-{os.getpid()}-{id(abstract)}"
    abstract.bind("\0" + abstract_name)
    unix.bind(str(home / "s.sock"))
    for s in (abstract, unix):
        s.listen()
    bridged = box.name in sandbox.BRIDGED
    srv = ProxyServer(
        Proxy(FakeBackend(tok), tok, out_dir=str(out / "calls"), rollout_tokens=True)
    ).start()
    try:
        targets = {
            "trainer_pid": os.getpid(),
            "secret": str(home / ".cache/huggingface/token"),
            "dirs": dirs,
            "out": str(out),
            "port": listener.getsockname()[1],
            "abstract": abstract_name,
            "unix": str(home / "s.sock"),
            "skip": list(skip),
        }
        h = Escaper(box, targets)
        jobs = [("a", Task("ta", "a"), h), ("b", Task("tb", "b"), h)]
        results = asyncio.run(
            run_rollouts(
                jobs,
                lambda rid: srv.endpoint(rid, "m", socket=bridged),
                timeout=120,
                progress=False,
            )
        )
        flags = {rid: srv.proxy.flags(rid) for rid in ("a", "b")}
        if bridged:
            srv.close_sockets(["a", "b"])
    finally:
        srv.stop()
        for s in (listener, abstract, unix):
            s.close()
    return results, h.seen, flags, dirs, out


@pytest.mark.sandbox
def test_escapes_fail_and_the_own_proxy_call_succeeds(box, tok, tmp_path, monkeypatch):
    """In bwrap and docker every escape attempt is refused by the sandbox (or the proxy), each with the
    refusal expected of it, while the rollout's own proxy call succeeds; nothing of the trainer's
    environment or files reaches the agent, and the proxy flags the refused routes on the rollout."""
    results, seen, flags, dirs, out = run_escaper(box, tok, tmp_path, monkeypatch)
    assert [r.error for r in results] == [None, None], results
    for rid in ("a", "b"):
        got = seen[rid]["attempts"]
        assert got == EXPECTED[box.name], json.dumps(got, indent=1)
        assert "HF_TOKEN" not in seen[rid]["env"] and "hf_planted" not in json.dumps(seen[rid])
        assert not any("REWARD" in k for k in seen[rid]["env"])
        whats = " | ".join(f["what"] for f in flags[rid])
        assert [f["kind"] for f in flags[rid]] == ["route"] * 3, flags[rid]
        assert (
            "rewards come from the harness" in whats
            and "a wrong token" in whats
            and "/v1/chat/completions" in whats
        )
    assert sorted(os.listdir(out)) == ["calls", "metrics.jsonl"] and not any(
        os.listdir(d) for d in dirs
    )
    calls = [json.loads(line) for line in open(out / "calls" / "calls.jsonl")]
    assert sorted(c["rollout_id"] for c in calls) == ["a", "b"]  # only the own calls were recorded


def test_the_escape_probe_gets_through_without_a_sandbox(tok, tmp_path, monkeypatch):
    """The probe above can tell a sandbox from none: run on the host (--sandbox none), every attempt it
    makes reaches its target (the planted secret is read, the other rollout's dir and the out dir are
    written, the three host listeners answer), and only the proxy still refuses the foreign routes.
    Not made here: writing the host's /usr (as root it would succeed, for real) and the Docker socket
    (whether it answers depends on this host's dockerd)."""
    results, seen, flags, dirs, out = run_escaper(
        sandbox.Sandbox(), tok, tmp_path, monkeypatch, skip=("write system", "docker socket")
    )
    assert [r.error for r in results] == [None, None], results
    for rid in ("a", "b"):
        got = seen[rid]["attempts"]
        routes = {k: got.pop(k) for k in REFUSED_ROUTES}
        assert routes == REFUSED_ROUTES, routes
        assert set(got) == set(EXPECTED["bwrap"]) - set(REFUSED_ROUTES) - {
            "write system",
            "docker socket",
        }
        assert all(v.startswith("reached: ") for v in got.values()), json.dumps(got, indent=1)
        assert got["home secret"] == "reached: hf_planted_secret"
        # Only its environment is cleared: the one thing --sandbox none does.
        assert "HF_TOKEN" not in seen[rid]["env"]
    assert all(os.listdir(d) == ["pwned"] for d in dirs)  # each rollout wrote into the other's
    assert sorted(os.listdir(out)) == ["calls", "metrics.jsonl", "pwned"]
    # Over TCP nothing tells which rollout sent a refused request (test below).
    assert flags == {"a": [], "b": []}


# The limits probe: the container's cgroup limits as it sees them ([quota, period] of CPU time in
# microseconds, bytes of memory, tasks), then the limits at work: fork until refused (at most 200, so a
# missing limit cannot hurt the host) and allocate 16 MB and 256 MB in a child each, touching every
# page. A child's result: its exit code, or minus the signal that killed it.
LIMITS_PROBE = r"""
import errno, json, os, time
def cgroup(*paths):
    for p in paths:
        if os.path.exists("/sys/fs/cgroup/" + p):
            with open("/sys/fs/cgroup/" + p) as f:
                return f.read().split()
    raise SystemExit("no cgroup file of " + str(paths))
got = {}
if os.path.exists("/sys/fs/cgroup/cpu.max"):  # cgroup v2
    got["cpu"] = cgroup("cpu.max")
else:  # cgroup v1
    got["cpu"] = cgroup("cpu/cpu.cfs_quota_us") + cgroup("cpu/cpu.cfs_period_us")
got["memory"] = cgroup("memory.max", "memory/memory.limit_in_bytes")[0]
got["pids"] = cgroup("pids.max", "pids/pids.max")[0]
kids, refused = [], None
for _ in range(200):
    try:
        pid = os.fork()
    except OSError as e:
        refused = errno.errorcode[e.errno]
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
got["forks"], got["fork refused"] = len(kids), refused
def allocate(mb):
    pid = os.fork()
    if pid == 0:
        data = b"x" * (mb << 20)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
got["16 MB"], got["256 MB"] = allocate(16), allocate(256)
print(json.dumps(got))
"""


@pytest.mark.sandbox
def test_docker_limits_hold_inside_the_container(docker_image, tmp_path):
    """sandbox.Limits (docs/sandboxes.md) become docker's --cpus, --memory and --pids-limit and hold
    inside: the container's cgroup has 0.5 CPU's quota, 64 MiB and 16 tasks; the 16th task (the probe
    is the first) cannot be forked; 256 MB allocated in a 64 MiB container is killed (SIGKILL: the OOM
    killer) while 16 MB is not."""
    import subprocess

    box = sandbox.make("docker", image=docker_image)
    limits = sandbox.Limits(cpus=0.5, memory="64m", pids=16)
    argv = box.wrap(
        ["python3", "-c", LIMITS_PROBE],
        {"PATH": "/usr/bin:/bin"},
        str(tmp_path),
        limits=limits,
        name=f"ll-test-limits-{os.getpid()}",
    )
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    finally:
        box.kill(f"ll-test-limits-{os.getpid()}")
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)
    cpu = got.pop("cpu")
    assert int(cpu[0]) / int(cpu[1]) == 0.5, cpu  # e.g. 50000 us of CPU time per 100000 us
    assert got == {
        "memory": str(64 * 2**20),
        "pids": "16",
        "forks": 15,
        "fork refused": "EAGAIN",
        "16 MB": 0,
        "256 MB": -9,
    }


def test_a_token_is_needed_for_every_call_and_the_harness_key_for_rewards(tok, tmp_path):
    """On the host too (--sandbox none): the proxy serves only the routes it handed out."""
    import requests

    srv = ProxyServer(
        Proxy(FakeBackend(tok), tok, out_dir=str(tmp_path), rollout_tokens=True)
    ).start()
    try:
        e = srv.endpoint("r1", "m")
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert e.base_url.startswith(srv.url + "/rollout/r1.") and e.route != "r1"
        assert requests.post(e.base_url + "/chat/completions", json=chat).status_code == 200
        for url in (
            srv.url + "/rollout/r1/v1/chat/completions",
            srv.url + "/rollout/r1.guess/v1/chat/completions",
            srv.url + "/v1/chat/completions",
            srv.url + "/rollout/r2.x/v1/chat/completions",
        ):
            r = requests.post(url, json=chat)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", url
        r = requests.post(
            e.anthropic_base_url + "/v1/messages",
            json={**chat, "max_tokens": 4},
            headers={"x-api-key": "k"},
        )
        assert r.status_code == 200 and r.json()["type"] == "message"
        r = requests.post(
            e.server_url + "/rollout/r1.x/v1/messages", json={**chat, "max_tokens": 4}
        )
        assert (
            r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        )  # the API's own format
        assert requests.post(e.reward_url, json={"reward": 1}).status_code == 403
        assert (
            requests.post(
                e.reward_url, json={"reward": 1}, headers={"X-Reward-Key": "wrong"}
            ).status_code
            == 403
        )
        assert srv.proxy.reward("r1") is None
        assert (
            requests.post(
                e.reward_url, json={"reward": 0.5}, headers={"X-Reward-Key": e.reward_key}
            ).status_code
            == 200
        )
        assert srv.proxy.reward("r1") == 0.5
        assert (
            requests.post(
                srv.url + "/rollout/nobody/reward",
                json={"reward": 1},
                headers={"X-Reward-Key": e.reward_key},
            ).status_code
            == 404
        )
        assert srv.proxy.flags("r1") == []  # over TCP nothing tells who sent a refused request
        srv.proxy.reset()  # the step is over: a straggler of r1 is refused
        assert requests.post(e.base_url + "/chat/completions", json=chat).status_code == 403
    finally:
        srv.stop()


def test_make_says_what_is_wrong():
    with pytest.raises(ValueError, match="unknown sandbox 'jail'"):
        sandbox.make("jail")
    with pytest.raises(ValueError, match="needs an image"):
        sandbox.Docker().wrap(["true"], {}, "/tmp")
    t = sandbox.make("kubectl run {name} -i --rm --image={image} -- {argv}", image="img")
    assert t.wrap(["python3", "a b.py"], {"K": "v w"}, "/w", name="ll-r1") == [
        "kubectl",
        "run",
        "ll-r1",
        "-i",
        "--rm",
        "--image=img",
        "--",
        "sh",
        "-c",
        "cd /w && exec env -i 'K=v w' python3 'a b.py'",
    ]
    assert sandbox.Sandbox().wrap([sys.executable, "-c", "pass"], {"A": "1"}, "/tmp") == [
        "env",
        "-i",
        "A=1",
        sys.executable,
        "-c",
        "pass",
    ]


@pytest.mark.sandbox
def test_train_step_in_bwrap_records_flags_and_zeroes_flagged_rewards(bwrap_ok, tmp_path):
    """train.py --sandbox bwrap: a program harness's rollouts reach the proxy through the bridge (their calls are
    recorded and trained on), the audit flags them, the reward POSTs they tried are flagged, and rewards are zeroed."""
    import subprocess

    from conftest import ROOT
    from lightning_lite.records import read_jsonl

    out = str(tmp_path / "run")
    p = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--harness",
            "tests/harnesses.py:AuditedScript",
            "--sandbox",
            "bwrap",
            "--steps",
            "1",
            "--proxy-host",
            "localhost",  # base URLs name it; inside, the bridge answers on loopback
            "--batch-size",
            "1",
            "--group-size",
            "2",
            "--eval-tasks",
            "0",
            "--out",
            out,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert (
        "rollouts run in sandbox bwrap" in p.stdout
        and "rank 0 proxy at http://localhost:" in p.stdout
    )
    rows = list(read_jsonl(os.path.join(out, "rollouts", "step_0.jsonl")))
    assert len(rows) == 2 and all(r["error"] is None and r["reward"] == 0.0 for r in rows), rows
    for r in rows:
        kinds = sorted((f["kind"], f["what"].split(":")[0]) for f in r["flags"])
        assert kinds == [
            ("audit", "greeting"),
            ("route", "rewards come from the harness (header X-Reward-Key), never from the agent"),
        ], r["flags"]
    assert [
        r["flagged"] for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if "flagged" in r
    ] == [2]
    calls = list(read_jsonl(os.path.join(out, "calls", "step_0.jsonl")))
    assert sorted(c["rollout_id"] for c in calls) == sorted(r["rollout_id"] for r in rows)


def test_a_command_template_runs_the_program_with_its_env_and_cwd(tmp_path):
    """A template sandbox (README: one Kubernetes pod per rollout) runs the command it is given, in its cwd, with
    exactly its environment; here the template is a local shell, so no cluster is needed."""
    import subprocess

    box = sandbox.make("sh -c 'exec \"$@\"' {name} {argv}")
    argv = box.wrap(
        ["sh", "-c", 'pwd; echo "$A|$HOME"'],
        {"A": "x y", "PATH": os.environ["PATH"]},
        str(tmp_path),
        name="ll-r1",
    )
    out = subprocess.run(
        argv, capture_output=True, text=True, env={"PATH": os.environ["PATH"], "HOME": "/root"}
    ).stdout.split("\n")
    assert out[:2] == [str(tmp_path), "x y|"]


@pytest.mark.sandbox
def test_bwrap_hides_a_dir_but_what_the_harness_needs_inside_it(bwrap_ok, tmp_path):
    """A coding harness hides the repo (its tasks' answers) yet runs its agent from a venv inside it."""
    import subprocess

    repo = tmp_path / "repo"
    (repo / ".harnesses" / "venv").mkdir(parents=True)
    (repo / ".harnesses" / "venv" / "tool").write_text("tool")
    (repo / "answers.py").write_text("fix")
    work = tmp_path / "work"
    work.mkdir()
    os.makedirs("/var/tmp/ll-test-visible", exist_ok=True)  # outside /tmp (private in the sandbox)
    box = sandbox.make("bwrap")
    cmd = [
        "python3",
        "-c",
        "import os, sys; print([os.path.exists(p) for p in sys.argv[1:]])",
        str(repo / ".harnesses" / "venv" / "tool"),
        str(repo / "answers.py"),
        str(work),
    ]
    argv = box.wrap(
        cmd,
        {"PATH": "/usr/bin:/bin"},
        str(work),
        ro_binds=[str(repo / ".harnesses" / "venv")],
        hide=[str(repo)],
    )
    out = subprocess.run(argv, capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert out.stdout.strip() == "[True, False, True]", out.stderr
