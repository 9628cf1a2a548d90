"""The sandboxes (lightning_lite/extras/sandbox.py) with a real proxy: from inside, every escape attempt fails while the
rollout's own proxy call succeeds, and what the proxy refused is flagged on the rollout that tried it."""

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

# The agent: one real call through its base URL, then every escape we can think of; it prints what each gave.
AGENT = r"""
import json, os, socket, sys, urllib.request, urllib.error
T = json.loads(sys.argv[1])
out = {}
def attempt(name, f):
    try:
        out[name] = "ok: " + str(f())[:200]
    except Exception as e:
        out[name] = "failed: %s" % type(e).__name__
def post(url, body, headers={}):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers})
    try:
        return urllib.request.urlopen(req, timeout=10).status
    except urllib.error.HTTPError as e:
        if e.code != 200: raise RuntimeError(e.code)
chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
base, server = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_BASE_URL"].split("/rollout/")[0]
attempt("own call", lambda: post(base + "/chat/completions", chat))
attempt("trainer env", lambda: open("/proc/%d/environ" % T["trainer_pid"], "rb").read())
attempt("trainer env by ppid", lambda: [l for l in open("/proc/%d/environ" % os.getppid(), "rb").read().split(b"\0") if b"HF_TOKEN" in l][0])
attempt("home secret", lambda: open(T["secret"]).read())
attempt("list other rollout", lambda: os.listdir(T["other"]))
attempt("write other rollout", lambda: open(os.path.join(T["other"], "pwned"), "w").write("x"))
attempt("list out dir", lambda: os.listdir(T["out"]) or 1/0)
attempt("write out dir", lambda: open(os.path.join(T["out"], "pwned"), "w").write("x"))
attempt("other port", lambda: socket.create_connection(("127.0.0.1", T["port"]), timeout=3))
attempt("host address", lambda: socket.create_connection((T["host_ip"], T["port"]), timeout=3))
attempt("own reward", lambda: post(server + "/rollout/%s/reward" % os.environ["LL_ROLLOUT_ID"], {"reward": 1}))
attempt("other rollout's route", lambda: post(server + "/rollout/%s/v1/chat/completions" % T["other_id"], chat))
attempt("no token", lambda: post(server + "/v1/chat/completions", chat))
attempt("write system", lambda: open("/usr/pwned", "w").write("x"))
attempt("docker socket", lambda: socket.socket(socket.AF_UNIX).connect("/run/docker.sock"))
print(json.dumps({"env": dict(os.environ), "attempts": out}))
"""


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


@pytest.mark.sandbox
def test_escapes_fail_and_the_own_proxy_call_succeeds(box, tok, tmp_path, monkeypatch):
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
    listener = socket.create_server(("127.0.0.1", 0))  # something else on the host's loopback
    host_ip = socket.gethostbyname(socket.gethostname())
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
            "host_ip": host_ip,
        }
        h = Escaper(box, targets)
        jobs = [("a", Task("ta", "a"), h), ("b", Task("tb", "b"), h)]
        results = asyncio.run(
            run_rollouts(
                jobs,
                lambda rid: srv.endpoint(rid, "m", socket=True),
                timeout=120,
                progress=False,
            )
        )
        flags = {rid: srv.proxy.flags(rid) for rid in ("a", "b")}
        srv.close_sockets(["a", "b"])
    finally:
        srv.stop()
        listener.close()
    assert [r.error for r in results] == [None, None], results
    for rid in ("a", "b"):
        seen = h.seen[rid]
        got = seen["attempts"]
        assert got.pop("own call") == "ok: 200", got
        if (
            box.name == "docker"
        ):  # the container's own files, thrown away with it (--rm): a pip install may go there
            assert got.pop("write system") == "ok: 1"
        assert all(v.startswith("failed") for v in got.values()), json.dumps(got)
        assert "HF_TOKEN" not in seen["env"] and "hf_planted" not in json.dumps(seen)
        assert not any("REWARD" in k for k in seen["env"])
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
