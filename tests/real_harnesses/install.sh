#!/usr/bin/env bash
# Install the real agent harnesses under .harnesses/ (idempotent: each one is
# skipped when its marker file exists; delete .harnesses/ to reinstall).
#
#   tests/real_harnesses/install.sh            # all of them
#   tests/real_harnesses/install.sh codex smolagents
#
# Versions are pinned to the ones verified with tests/real_harnesses/run.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
H=.harnesses
mkdir -p "$H"

PY=${PY:-python3}
# OpenHands needs Python >= 3.12: take python3.12 from PATH or from pyenv.
find_py312() {
  for c in python3.12 python3.13; do
    if "$c" -V >/dev/null 2>&1; then echo "$c"; return; fi  # a pyenv shim may exist but not run
  done
  ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3 2>/dev/null | head -1
}
PY312=${PY312:-$(find_py312)}

NPM_PKGS=(
  "claude-code:@anthropic-ai/claude-code@2.1.197"
  "codex:@openai/codex@0.171.0"
  "opencode:opencode-ai@1.18.33"
  "qwen-code:@qwen-code/qwen-code@0.15.10"
)
# name | python | pip requirements
PY_PKGS=(
  "mini-swe-agent|$PY|mini-swe-agent==2.4.6"
  "openhands|$PY312|openhands-sdk==1.58.2 openhands-tools==1.58.2"
  "openai-agents|$PY|openai-agents==0.24.0"
  "smolagents|$PY|smolagents[openai]==1.26.0"
  "langgraph|$PY|langgraph==1.2.24 langchain-openai==1.7.4"
)

want() { [ -z "${SELECTED:-}" ] || [[ " $SELECTED " == *" $1 "* ]]; }
SELECTED="$*"

for entry in "${NPM_PKGS[@]}"; do
  name=${entry%%:*}; spec=${entry#*:}
  want "$name" || continue
  marker="$H/npm/.installed-$name"
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$spec" ]; then echo "[install] $name: present"; continue; fi
  echo "[install] $name: npm install $spec"
  npm install --prefix "$H/npm" --no-audit --no-fund --loglevel=error "$spec"
  echo "$spec" > "$marker"
done

for entry in "${PY_PKGS[@]}"; do
  IFS='|' read -r name py reqs <<< "$entry"
  want "$name" || continue
  venv="$H/$name-venv"
  if [ -f "$venv/.installed" ] && [ "$(cat "$venv/.installed")" = "$reqs" ]; then echo "[install] $name: present"; continue; fi
  if [ -z "$py" ]; then echo "[install] $name: needs Python >= 3.12 (set PY312=...)" >&2; exit 1; fi
  echo "[install] $name: $py -m venv $venv; pip install $reqs"
  test -x "$venv/bin/python" || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q $reqs
  echo "$reqs" > "$venv/.installed"
done
echo "[install] done"
