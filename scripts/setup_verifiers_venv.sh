#!/usr/bin/env bash
# Create .venv-verifiers: verifiers 0.4's v1 stack, for agents run as commands
# (leangrpo.agents.verifiers_v1, docs/agents.md "verifiers 0.4's v1 stack"). It cannot share
# .venv: verifiers 0.4.0 is the same distribution as the classic 0.3.1 that
# leangrpo.environments.adapters.verifiers pins (<0.4), and it needs openai<3 and mcp==2.0.0
# where .venv has openai 3 (the OpenAI Agents SDK) and mcp 1.x (verifiers 0.3.1).
#
# Small on purpose: `--no-deps` and only what `import verifiers.v1` and its plugin loader
# import (loading any taskset imports every bundled taskset and harness package, mcp's server
# among them), 54 packages (about 320 MB), pinned to what pip resolves for verifiers==0.4.0;
# verifiers' full resolution is 96 (transformers, tokenizers, huggingface_hub, gepa, rich,
# pyzmq, ...): a taskset that needs more installs it here (.venv-verifiers/bin/pip install).
# leangrpo itself is put on the venv's path (a .pth file naming this checkout's src/), without
# its dependencies: the adapter imports nothing of leangrpo's heavy roles.
#
# Idempotent: installs only on first use or when this script changed since (stamp
# .venv-verifiers/.installed); concurrent callers (pytest-xdist workers) wait on one lock.
#
# Usage: scripts/setup_verifiers_venv.sh            (from anywhere; works in the repo root)
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=.venv-verifiers
PY=${PYTHON:-python3}
STAMP="$VENV/.installed"

PINS=(
  verifiers==0.4.0
  aiofiles==25.1.0 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0
  annotated-types==0.8.0 anthropic==2.16.0 antlr4-python3-runtime==4.13.2 anyio==4.16.0
  attrs==26.1.0 certifi==2026.10.19.post1 connectrpc==0.11.1 distro==1.9.0
  docstring_parser==0.18.0 frozenlist==1.8.0 h11==0.16.0 httpcore==1.0.9 httpcore2==2.16.2
  httpx==0.29.0 httpx2==2.16.2 idna==3.20 jiter==0.19.0 latex2sympy2_extended==1.11.0
  math-verify==0.9.0 mpmath==1.3.0 multidict==7.2.1 numpy==2.4.6 openai==2.54.0
  prime-pydantic-config==0.4.3 prime-runs==0.1.4 prime-sandboxes==0.5.1 prime-tunnel==0.1.15
  propcache==0.5.4 protobuf==7.36.2 protobuf-py==0.1.1 protobuf-py-ext==0.1.1
  pydantic==2.14.4 pydantic_core==2.50.5 pyqwest==0.12.0 renderers==0.1.12 sniffio==1.3.1
  sympy==1.14.0 tenacity==9.2.1 tomli_w==1.2.0 typing_extensions==4.16.0
  typing-inspection==0.4.5 yarl==1.25.1 opentelemetry-api==1.45.2
  mcp==2.0.0 mcp-types==2.0.0 starlette==1.10.0 sse-starlette==3.7.1 cryptography==50.0.2 cffi==2.1.1
)

exec 9>"$ROOT/.venv-verifiers.lock"
flock 9

if [ -f "$STAMP" ] && [ ! "scripts/setup_verifiers_venv.sh" -nt "$STAMP" ]; then
  exit 0
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --no-deps "${PINS[@]}"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ROOT/src" > "$SITE/leangrpo_src.pth"
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version

# what the adapter and verifiers' plugin loader (which imports every bundled plugin package) import
import verifiers.v1.envs, verifiers.v1.harnesses, verifiers.v1.judges, verifiers.v1.tasksets  # noqa: E401, F401
import leangrpo.agents.verifiers_v1  # noqa: F401

print(f"verifiers {version('verifiers')}  openai {version('openai')}  (.venv-verifiers)")
PY
touch "$STAMP"
