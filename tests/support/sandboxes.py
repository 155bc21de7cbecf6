"""The namespace sandbox in tests: required in CI (CI=1: .ci/run sets it), skipped with the
reason elsewhere when this machine cannot start one (levels.py's probe says why)."""

from __future__ import annotations

import os

import pytest

from leangrpo.sandbox.levels import namespace_failure


def require_namespace(network: bool = False) -> None:
    failure = namespace_failure(network)
    if failure is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must test the namespace sandbox, but it cannot start here: {failure}")
    pytest.skip(f"the namespace sandbox cannot start here: {failure}")
