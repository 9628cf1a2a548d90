"""How each real harness is started headless against the proxy, for one task.

``command(name, root, rid, task, work, home)`` returns ``(argv, env)``:
``root`` is the proxy's URL (``http://127.0.0.1:PORT``), ``rid`` the rollout
id, ``work`` a fresh empty workspace (the cwd), ``home`` a fresh HOME that
holds every config file the harness reads. The environment is built from
scratch (no API keys, proxies or user config leak in) and turns off update
checks, telemetry and other traffic that is not the LLM call itself.
"""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H = os.path.join(ROOT, ".harnesses")
NPM_BIN = os.path.join(H, "npm", "node_modules", ".bin")
DRIVERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drivers.py")
MODEL = "smollm2"

# name -> the API shape it speaks (what the table reports when no call got through)
HARNESSES = {
    "mini-swe-agent": "chat",
    "openhands": "chat",
    "claude-code": "anthropic",
    "codex": "responses",
    "opencode": "chat",
    "qwen-code": "chat",
    "agents-responses": "responses",
    "agents-chat": "chat",
    "smolagents": "chat",
    "langgraph": "chat",
}


def _write(path: str, text: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def base_env(home: str) -> dict:
    return {
        "PATH": os.pathsep.join([NPM_BIN, os.environ.get("PATH", "/usr/bin:/bin")]),
        "HOME": home,
        "USER": os.environ.get("USER", "user"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "XDG_CONFIG_HOME": f"{home}/.config",
        "XDG_DATA_HOME": f"{home}/.local/share",
        "XDG_CACHE_HOME": f"{home}/.cache",
        "XDG_STATE_HOME": f"{home}/.local/state",
        "TMPDIR": f"{home}/tmp",
        "NO_PROXY": "127.0.0.1,localhost",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }


def command(
    name: str, root: str, rid: str, task: str, work: str, home: str
) -> tuple[list[str], dict]:
    openai_base = (
        f"{root}/rollout/{rid}/v1"  # OpenAI clients append /chat/completions or /responses
    )
    env = base_env(home)
    os.makedirs(env["TMPDIR"], exist_ok=True)

    if name == "mini-swe-agent":
        env.update(
            MSWEA_CONFIGURED="true",
            MSWEA_COST_TRACKING="ignore_errors",
            MSWEA_GLOBAL_CONFIG_DIR=f"{home}/mini",
            MSWEA_SILENT_STARTUP="1",
            OPENAI_API_KEY="x",
            LITELLM_LOCAL_MODEL_COST_MAP="True",
        )
        return [
            f"{H}/mini-swe-agent-venv/bin/mini",
            "-m",
            f"openai/{MODEL}",
            "-t",
            task,
            "-y",
            "--exit-immediately",
            "-c",
            "mini.yaml",
            "-c",
            f"model.model_kwargs.api_base={openai_base}",
            "-c",
            "agent.step_limit=3",
            "-c",
            "model.model_kwargs.num_retries=0",
            "-o",
            f"{home}/traj.json",
        ], env

    if name == "claude-code":  # Anthropic Messages: the client appends /v1/messages to the base URL
        env.update(
            IS_SANDBOX="1",
            ANTHROPIC_BASE_URL=f"{root}/rollout/{rid}",
            ANTHROPIC_API_KEY="x",
            ANTHROPIC_MODEL=MODEL,
            ANTHROPIC_SMALL_FAST_MODEL=MODEL,
            CLAUDE_CONFIG_DIR=f"{home}/.claude",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            DISABLE_AUTOUPDATER="1",
            DISABLE_TELEMETRY="1",
            DISABLE_ERROR_REPORTING="1",
            CLAUDE_CODE_MAX_RETRIES="0",
        )
        return [
            "claude",
            "-p",
            task,
            "--output-format",
            "json",
            "--dangerously-skip-permissions",
            "--max-turns",
            "4",
        ], env

    if name == "codex":  # Responses API only, always streamed
        _write(
            f"{home}/codex/config.toml",
            f"""model = "{MODEL}"
model_provider = "lightning"
check_for_update_on_startup = false

[model_providers.lightning]
name = "lightning-lite"
base_url = "{openai_base}"
env_key = "LIGHTNING_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false
""",
        )
        env.update(CODEX_HOME=f"{home}/codex", LIGHTNING_API_KEY="x")
        return [
            "codex",
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
            task,
        ], env

    if name == "opencode":
        cfg = {
            "$schema": "https://opencode.ai/config.json",
            "autoupdate": False,
            "share": "disabled",
            "permission": "allow",
            "provider": {
                "local": {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "lightning-lite",
                    "options": {"baseURL": openai_base, "apiKey": "x"},
                    "models": {MODEL: {"name": MODEL}},
                }
            },
        }
        _write(f"{home}/opencode.json", json.dumps(cfg, indent=1))
        env.update(
            OPENCODE_CONFIG=f"{home}/opencode.json",
            OPENCODE_DISABLE_MODELS_FETCH="1",
            OPENCODE_DISABLE_AUTOUPDATE="1",
            OPENCODE_DISABLE_LSP_DOWNLOAD="1",
            OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
            OPENCODE_DISABLE_SHARE="1",
        )
        return ["opencode", "run", "-m", f"local/{MODEL}", task], env

    if name == "qwen-code":
        _write(
            f"{home}/.qwen/settings.json",
            json.dumps(
                {
                    "privacy": {"usageStatisticsEnabled": False},
                    "telemetry": {"enabled": False},
                    "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
                }
            ),
        )
        env.update(OPENAI_BASE_URL=openai_base, OPENAI_API_KEY="x", OPENAI_MODEL=MODEL)
        return [
            "qwen",
            "-p",
            task,
            "--yolo",
            "--auth-type",
            "openai",
            "--max-session-turns",
            "4",
        ], env

    # Python libraries: a small driver in the harness's own venv (drivers.py)
    venv = {
        "openhands": "openhands",
        "agents-responses": "openai-agents",
        "agents-chat": "openai-agents",
        "smolagents": "smolagents",
        "langgraph": "langgraph",
    }[name]
    env.update(
        OPENAI_API_KEY="x",
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        OPENAI_AGENTS_DISABLE_TRACING="1",
        LANGCHAIN_TRACING_V2="false",
        OPENHANDS_SUPPRESS_BANNER="1",
    )
    return [f"{H}/{venv}-venv/bin/python", DRIVERS, name, openai_base, task, work], env
