#!/usr/bin/env bash
# `make test`: both suites, with the vLLM venv's set-up overlapped. The set-up
# (scripts/setup_vllm_venv.sh: mostly downloading and unpacking wheels) starts in the
# background at once, beside `make setup` and the main suite (which keep the CPU busy); its
# output goes to .venv-vllm-setup.log. After the main suite this waits for it: a failed
# set-up fails `make test` with one line and the log's tail; then the vLLM suite runs
# (`make test-vllm`, whose own set-up call then only checks the venv). A main suite that
# fails stops the set-up and fails at once, as `make test` did when the two ran in turn.
#
# Usage: bash scripts/test_all.sh   (what `make test` runs; MAKE names make)
set -euo pipefail
cd "$(dirname "$0")/.."
MAKE=${MAKE:-make}
LOG=.venv-vllm-setup.log
SETUP_LIMIT_S=${VLLM_SETUP_LIMIT_S:-3600}  # a hang guard only: it takes minutes

# timeout(1) leads a process group of its own: stopping the group stops pip too.
timeout "$SETUP_LIMIT_S" bash scripts/setup_vllm_venv.sh </dev/null >"$LOG" 2>&1 &
setup_pid=$!
# .venv-verifiers (verifiers 0.4's v1 stack) likewise: the tests that use it wait on the
# script's lock (tests/support/verifiers_venv.py) and fail with its output if it failed
timeout "$SETUP_LIMIT_S" bash scripts/setup_verifiers_venv.sh </dev/null >.venv-verifiers-setup.log 2>&1 &
verifiers_pid=$!

stop_setup() {
  for pid in "$setup_pid" "$verifiers_pid"; do
    if [ -n "$pid" ]; then
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    fi
  done
}
trap stop_setup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$MAKE" test-main
wait "$verifiers_pid" 2>/dev/null || true  # its failure failed the tests that use it
verifiers_pid=

echo "make test: waiting for the vLLM venv's set-up (scripts/setup_vllm_venv.sh, log $LOG)"
rc=0
wait "$setup_pid" || rc=$?
setup_pid=
if [ "$rc" -ne 0 ]; then
  why="exit $rc"
  [ "$rc" -eq 124 ] && why="stopped after ${SETUP_LIMIT_S} s"
  echo "make test: the vLLM venv's set-up (scripts/setup_vllm_venv.sh) failed ($why); the last lines of $LOG:" >&2
  tail -n 30 "$LOG" >&2
  exit 1
fi

"$MAKE" test-vllm
