#!/usr/bin/env bash
# Runs a pytest command; exit status 5 ("no tests collected", e.g. everything skipped by
# marker selection) counts as success, every other failure is passed through.
set -u
"$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit 5): treated as success"
  exit 0
fi
exit "$rc"
