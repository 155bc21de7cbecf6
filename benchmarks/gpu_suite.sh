#!/usr/bin/env bash
# The GPU suite on a bare CUDA machine:  PYTHONUNBUFFERED=1 bash benchmarks/gpu_suite.sh
# 1. installs the wheels carried in .whl/ (scripts/fetch_gpu_wheels.sh) if an import the
#    suite needs is missing, into a private folder put on PYTHONPATH;
# 2. checks torch and CUDA in a throwaway process (the driver itself never touches CUDA);
# 3. runs benchmarks/gpu_suite.py (every case under its own cap; 480 s in all, counted
#    from here). Arguments go to the driver: --dry-run (tiny shapes, CPU), --only a,b.
set -u
export GPU_SUITE_T0="${GPU_SUITE_T0:-$(date +%s.%N)}"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
SITE="${GPU_SUITE_SITE:-/tmp/leangrpo-gpu-site}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
NEEDED="import pydantic, yaml, transformers, peft, pytest"
if ! "$PY" -c "$NEEDED" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_suite: missing Python packages and no wheels in .whl/ (run scripts/fetch_gpu_wheels.sh, carry .whl)"
    "$PY" -c "$NEEDED"
    exit 2
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || { echo "gpu_suite: installing .whl/*.whl failed"; exit 2; }
  export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH#$PWD/src}"
  "$PY" -c "$NEEDED" || { echo "gpu_suite: still missing a package after the wheels"; exit 2; }
  echo "gpu_suite: installed $(ls .whl/*.whl | wc -l) wheels into $SITE"
fi
# bitsandbytes (the qlora case) when the image has the rest but not it
if ! "$PY" -c "import bitsandbytes" 2>/dev/null && ls .whl/bitsandbytes-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/bitsandbytes-*.whl && echo "gpu_suite: installed bitsandbytes into $SITE"
  case ":$PYTHONPATH:" in *":$SITE:"*) ;; *) export PYTHONPATH="$PYTHONPATH:$SITE" ;; esac
fi
"$PY" - "$@" <<'PYEOF' || exit $?
import sys, torch
dry = "--dry-run" in sys.argv[1:]
ok = torch.cuda.is_available()
print(f"gpu_suite: python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, device visible: {ok}")
if ok:
    p = torch.cuda.get_device_properties(0)
    print(f"gpu_suite: {p.name}, {p.total_memory / 1e9:.0f} GB, sm_{p.major}{p.minor}")
elif not dry:
    print("gpu_suite: no CUDA device visible; on a CPU machine run it with --dry-run")
    sys.exit(3)
PYEOF
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv,noheader
fi
exec "$PY" benchmarks/gpu_suite.py "$@"
