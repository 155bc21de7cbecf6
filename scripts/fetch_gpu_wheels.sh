#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels the GPU suite needs and the GPU machine
# lacks, for its CPython 3.12 on x86-64 Linux; benchmarks/gpu_suite.sh installs them there
# with `pip install --no-index --no-deps --target`. Run from anywhere:
#
#     bash scripts/fetch_gpu_wheels.sh        # then carry ".whl" with the device run
#
# What the suite imports at runtime (benchmarks/*.py, leangrpo.{config,model,ops,train,
# planner,rollout.hf} and the gpu test files), minus
# what the GPU image already has (torch, transformers, peft, accelerate, safetensors,
# numpy, pyyaml, rich, pytest, hypothesis, psutil, tokenizers, triton): pydantic (for
# leangrpo.config) and its requirements, and bitsandbytes (the qlora case: 43 MB, its
# CUDA libraries included; it needs only numpy, packaging and torch, all on the image). Not needed by the suite, so not fetched: datasets
# (leangrpo.data), math-verify (the math reward), vLLM and flash-attn (not on the image;
# the suite uses the hf engine and torch's own varlen/flex attention). Never torch.
# Versions are the ones tested here (.venv); one version of each, or the install stops.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHEELS=(
  pydantic==2.14.4          # leangrpo.config
  pydantic-core==2.50.5     # compiled: the manylinux x86-64 cp312 wheel
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0 # pydantic 2.14 needs >= 4.16; the image's may be older
  bitsandbytes==0.50.2      # model.quantization (benchmarks/qlora.py): py3 manylinux_2_24
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
mkdir -p .whl
rm -f .whl/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
ls -1 .whl
bytes=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "fetch_gpu_wheels: $(ls .whl/*.whl | wc -l) wheels, $bytes bytes in .whl/"
if [ "$bytes" -gt $((64 * 1024 * 1024)) ]; then
  echo "fetch_gpu_wheels: over the 64 MiB a device run may carry" >&2
  exit 1
fi
