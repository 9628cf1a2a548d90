"""Session fixtures: the embedded model is loaded once and served by one proxy for all tests."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# The tests run the core with every extra loaded, as train.py does (tests/test_layout.py runs it with none).
from lightning_lite import hooks  # noqa: E402

EXTRAS = sorted(
    name[:-3]
    for name in os.listdir(os.path.join(ROOT, "lightning_lite", "extras"))
    if name.endswith(".py") and name != "__init__.py"
)
hooks.load_extras(EXTRAS)
# Requests captured from real harnesses: planning material that lives beside the repo, not in it.
# Tests that replay them skip with one line when the folder is absent (a plain clone);
# tests/fixtures/*_requests.json (chat, Anthropic Messages, Responses) have the same shapes, written
# for the project, and always run.
HARNESS_REQUESTS = os.environ.get(
    "LL_HARNESS_REQUESTS", os.path.join(os.path.dirname(ROOT), "shared", "harness-requests")
)
NO_CAPTURES = (
    f"no captured harness requests at {HARNESS_REQUESTS} (set LL_HARNESS_REQUESTS to replay them)"
)
# A captured request longer than this (as JSON) carries a real harness's system prompt and tools:
# thousands of tokens to prefill. Those replay in make test-slow: the first of each harness took
# 13-19 s on 2 cores, the rest ~1 s (the prefix is cached), 80 s for the 31 long ones.
LONG_CAPTURE_CHARS = 20_000


def capture_marks(body) -> list:
    """The marks of a captured request's test: slow when the request is long."""
    if len(json.dumps(body)) > LONG_CAPTURE_CHARS:
        return [pytest.mark.slow]
    return []


@pytest.fixture(scope="session")
def tok():
    from lightning_lite.models import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def model():
    from lightning_lite.models import load_model

    return load_model("smollm2").eval()


@pytest.fixture(scope="session")
def backend(model, tok):
    from lightning_lite.backends import HFBackend

    b = HFBackend(model, tok)
    yield b
    b.close()


@pytest.fixture(scope="session")
def server(backend, tok, tmp_path_factory):
    """One proxy on a free port; its calls go to <tmp>/calls.jsonl. Tests use their own rollout ids."""
    from lightning_lite.proxy import Proxy, ProxyServer

    out = tmp_path_factory.mktemp("proxy")
    srv = ProxyServer(Proxy(backend, tok, out_dir=str(out), max_body_mb=1)).start()
    srv.out = out
    yield srv
    srv.stop()


def require(ok: bool, what: str):
    """The one skip policy for a tool the project installs (chromium, the coding harnesses, the
    graders' python, the sandboxes): without it a test fails under CI (``.ci/run`` sets CI=1 and
    installs them all, so a missing one is a broken install) and skips with ``what`` elsewhere.
    ``what`` says what is missing and the make target that installs it."""
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI is set: .ci/run installs it)")
    pytest.skip(what)


# The sandboxes' programs (@pytest.mark.sandbox tests), which `make test-sandbox` installs and starts.
def _sandbox_check(argv, what):
    import subprocess

    try:
        ok = subprocess.run(argv, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    require(ok, f"{what}: run make setup-sandbox")


@pytest.fixture(scope="session")
def docker_image():
    """The local image the docker sandbox runs (scripts/sandbox_setup.sh builds it: no registry is reachable)."""
    image = "lightning-lite/sandbox:bookworm"
    _sandbox_check(
        ["docker", "image", "inspect", image], f"no docker, no running dockerd, or no image {image}"
    )
    return image


@pytest.fixture(scope="session")
def bwrap_ok():
    """bubblewrap is installed and may create the namespaces the bwrap sandbox uses."""
    _sandbox_check(
        ["bwrap", "--ro-bind", "/", "/", "--unshare-net", "--unshare-pid", "true"],
        "bwrap is missing or cannot create namespaces",
    )
    return True
