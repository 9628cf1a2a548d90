"""The core stands alone (DESIGN.md: the core and its extras): no core module imports an extra, at any
depth, and with lightning_lite/extras/ deleted train.py trains a step and proxy.py serves a chat
completion, plain and streamed; a flag or a request that needs a missing extra says which file. With
any one extra's file deleted, train.py and proxy.py still start: no extra imports another there."""

import ast
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from conftest import ROOT

SMOLLM2 = os.path.join(
    os.environ.get("LIGHTNING_LITE_CACHE", os.path.expanduser("~/.cache/lightning-lite")), "smollm2"
)


def extras_imports(path: str) -> list[str]:
    """Each line of ``path``, a module of lightning_lite/, that imports lightning_lite.extras (or a
    module in it), anywhere in the file: at the top, in a function, behind an if."""
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # relative to lightning_lite/: "from .extras import x", "from . import extras"
            module = node.module or ""
            if node.level == 1:
                module = "lightning_lite." + module if module else "lightning_lite"
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        if any(name.startswith("lightning_lite.extras") for name in names):
            found.append((node.lineno, f"{os.path.relpath(path, ROOT)}:{node.lineno}"))
    return [where for _, where in sorted(found)]


def test_no_core_module_imports_an_extra():
    core = sorted(glob.glob(os.path.join(ROOT, "lightning_lite", "*.py")))
    assert len(core) > 10
    bad = [line for path in core for line in extras_imports(path)]
    assert not bad, (
        f"the core imports lightning_lite.extras at {', '.join(bad)}: register through hooks.py"
    )


def test_the_layout_test_finds_an_import_at_any_depth(tmp_path):
    """The check above is not vacuous: it finds a function-local import and a relative one."""
    path = tmp_path / "m.py"
    path.write_text(
        "def f():\n    from .extras import lora\n\n\nimport lightning_lite.extras.vllm\n"
    )
    assert [line.rsplit(":", 1)[1] for line in extras_imports(str(path))] == ["2", "5"]


# Each file of lightning_lite/extras/ (its __init__.py too): with any one deleted, train.py and
# proxy.py still start. An extra that imported another would break this; one that needs another
# later says so where it loads it.
EXTRA_FILES = sorted(
    os.path.basename(path)[: -len(".py")]
    for path in glob.glob(os.path.join(ROOT, "lightning_lite", "extras", "*.py"))
)

# Run in a copy of the project, with the extras' names as arguments: each file in turn moved aside,
# then lightning_lite imported afresh (torch and the other packages stay imported: one process for
# them all), train.py's head run (its imports, EXTRAS loaded, its flags parsed) and proxy.py's
# extras loaded and flags parsed. Prints {name: "ok", or the traceback}.
PROBE = r"""
import ast, importlib, importlib.util, json, os, sys, traceback

sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in f.__module__]
# each module of the copy compiled once, not once per extra (its __pycache__ is the copy's own)
sys.dont_write_bytecode = False
root = sys.argv[1]
sys.path.insert(0, root)
source = open(os.path.join(root, "train.py")).read()
body = ast.parse(source).body
# train.py's head: its statements up to the one that parses the flags
end = next(i for i, node in enumerate(body) if "parse_args(" in ast.get_source_segment(source, node))
head = compile(ast.Module(body=body[: end + 1], type_ignores=[]), "train.py", "exec")
results = {}
for name in sys.argv[2:]:
    path = os.path.join(root, "lightning_lite", "extras", name + ".py")
    os.rename(path, path + ".deleted")
    importlib.invalidate_caches()
    for module in [m for m in sys.modules if m.split(".")[0] in ("lightning_lite", "proxy")]:
        del sys.modules[module]
    try:
        import lightning_lite

        assert lightning_lite.__file__.startswith(root), lightning_lite.__file__
        assert importlib.util.find_spec("lightning_lite.extras." + name) is None
        sys.argv = ["train.py"]
        exec(head, {"__name__": "train"})
        import proxy

        sys.argv = ["proxy.py", "--out", os.path.join(root, "runs", "proxy")]
        loaded = proxy.hooks.load_extras(proxy.PROXY_EXTRAS)
        proxy.parse_args({module.__name__.rsplit(".", 1)[-1]: module for module in loaded})
        results[name] = "ok"
    except BaseException:
        results[name] = traceback.format_exc()
    finally:
        os.rename(path + ".deleted", path)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def without_each_extra(tmp_path_factory) -> dict:
    """{extra's file name: "ok" or why train.py or proxy.py did not start without it}."""
    root = tmp_path_factory.mktemp("each") / "lightning-lite"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(os.path.join(ROOT, "lightning_lite"), root / "lightning_lite", ignore=ignore)
    for script in ("train.py", "proxy.py"):
        shutil.copy(os.path.join(ROOT, script), root / script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(root), *EXTRA_FILES],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", EXTRA_FILES)
def test_train_and_proxy_start_without_any_one_extra(without_each_extra, name):
    """No extra needs another at import: train.py's "report" needs no "recorder", for one."""
    assert without_each_extra[name] == "ok", without_each_extra[name]


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """The project copied without lightning_lite/extras/ (and without any installed copy in the way:
    the scripts import lightning_lite from their own folder)."""
    if not os.path.isdir(SMOLLM2):
        pytest.skip(f"no converted model at {SMOLLM2} (make venv converts it)")
    root = tmp_path_factory.mktemp("bare") / "lightning-lite"
    ignore = shutil.ignore_patterns(
        ".venv*", ".git", "runs", "__pycache__", ".harnesses", "*.egg-info"
    )
    shutil.copytree(ROOT, root, ignore=ignore)
    shutil.rmtree(root / "lightning_lite" / "extras")
    # An editable install of this checkout finds lightning_lite.extras here through its import hook,
    # even from the copy: the copy's processes start without it.
    site = root.parent / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in f.__module__]\n"
    )
    return root


def bare_env(bare) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(bare.parent / "site")
    return env


def run_bare(bare, *argv, timeout=600):
    return subprocess.run(
        [sys.executable, *argv],
        cwd=bare,
        env=bare_env(bare),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_copy_has_no_extras(bare):
    """The other tests of the copy test what they say: lightning_lite is the copy's, without extras."""
    code = "import importlib.util, lightning_lite; print(lightning_lite.__file__); "
    code += "print(importlib.util.find_spec('lightning_lite.extras'))"
    done = run_bare(bare, "-c", code)
    assert done.stdout.split() == [str(bare / "lightning_lite" / "__init__.py"), "None"], done


def test_train_runs_a_step_with_no_extras(bare):
    """The issue's command, then a second step resumed from its checkpoint under --loss sft (every
    rollout imitated: an update runs, where the calc rewards of an untrained model are all 0).
    Replies are short (--max-new-tokens 32): without extras/fast_decode.py the backend decodes
    slowly, and the steps only have to run and train."""
    out = bare / "runs" / "one"
    argv = [
        "train.py",
        "--harness",
        "calc",
        "--model",
        SMOLLM2,
        "--steps",
        "1",
        "--batch-size",
        "2",
    ]
    argv += ["--group-size", "2", "--eval-tasks", "0", "--max-new-tokens", "32", "--out", str(out)]
    done = run_bare(bare, *argv)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1] and rows[0]["rollouts"] == 4
    # the rollouts ran through the copy's proxy, which recorded their calls
    assert os.path.getsize(out / "calls" / "step_0.jsonl") > 0
    assert os.path.isdir(out / "checkpoints" / "step_1")
    resumed = [*argv[:6], "2", *argv[7:], "--resume", "--loss", "sft"]
    done = run_bare(bare, *resumed)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["loss"] is not None and rows[1]["grad_norm"] > 0, rows[1]


# Each flag that needs a missing extra, and what its refusal says.
REFUSED = [
    (["--lora", "8"], "--lora needs lightning_lite/extras/lora.py"),
    (["--backend", "vllm"], "--backend vllm needs lightning_lite/extras/vllm.py"),
    (["--parallel", "fsdp"], "--parallel fsdp needs lightning_lite/extras/fsdp.py"),
    (["--from-calls", "runs/x"], "--from-calls needs lightning_lite/extras/from_calls.py"),
    (["--harness", "calc", "--harness", "search"], "lightning_lite/extras/harnesses.py"),
]


def test_a_flag_of_a_missing_extra_names_its_file(bare):
    """Each refusal comes at start-up, before a model loads: the five runs start together, since
    each spends its seconds importing on one core."""
    running = []
    for flags, says in REFUSED:
        argv = [sys.executable, "train.py", "--model", SMOLLM2, "--steps", "0", *flags]
        proc = subprocess.Popen(
            argv, cwd=bare, env=bare_env(bare), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        running.append((proc, flags, says))
    for proc, flags, says in running:
        said = proc.communicate(timeout=300)[0].decode()
        assert proc.returncode != 0 and says in said, (flags, said[-2000:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict):
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_proxy_serves_chat_completions_with_no_extras(bare, tmp_path):
    port = free_port()
    argv = [sys.executable, "proxy.py", "--model", SMOLLM2, "--port", str(port)]
    argv += ["--out", str(tmp_path / "proxy")]
    proc = subprocess.Popen(
        argv, cwd=bare, env=bare_env(bare), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        # up once its /health answers, and it is this copy's proxy (not another on a reused port)
        for _ in range(600):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if json.loads(r.read())["model"] == SMOLLM2:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the copy's proxy.py did not answer /health within 5 minutes")
        chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
        status, body = post(url + "/v1/chat/completions", chat)
        assert status == 200, body
        assert json.loads(body)["choices"][0]["message"]["role"] == "assistant"
        status, body = post(url + "/v1/chat/completions", {**chat, "stream": True})
        assert status == 200 and body.rstrip().endswith("data: [DONE]"), body
        assert '"delta"' in body
        # a route of a missing extra: a 404 in OpenAI's shape, and the server keeps serving
        status, body = post(url + "/v1/messages", {"model": "m", "messages": [], "max_tokens": 1})
        assert status == 404, body
        assert "needs lightning_lite/extras/anthropic.py" in json.loads(body)["error"]["message"]
        # a forced tool call without the grammar extra: its arguments unconstrained, still served
        tool = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
        forced = {"type": "function", "function": {"name": "calc"}}
        status, body = post(
            url + "/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": forced}
        )
        assert status == 200, body
        calls = [json.loads(line) for line in open(tmp_path / "proxy" / "calls.jsonl")]
        assert len(calls) == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)
