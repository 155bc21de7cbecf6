""".venv-verifiers in tests: verifiers 0.4's v1 stack, which cannot be installed beside the
classic verifiers the tests' venv holds (scripts/setup_verifiers_venv.sh says why). Made on
first use by that script (`make test` makes it before pytest; a direct pytest run makes it
here: concurrent workers wait on the script's lock), then reused; never skipped, so CI tests
the v1 stack. The taskset the tests run is tests/support/vf_calculator.py."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from support.configs import ROOT

SETUP_HANG_S = 1800  # a hang guard: a cold install is minutes on a busy 2-core machine
TASKSET = "vf_calculator"


@functools.cache
def vf_python() -> Path:
    """The python of .venv-verifiers, made (or checked up to date) first."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup_verifiers_venv.sh")], cwd=ROOT,
                          capture_output=True, text=True, timeout=SETUP_HANG_S)  # fmt: skip
    assert done.returncode == 0, f"scripts/setup_verifiers_venv.sh failed:\n{done.stdout}\n{done.stderr}"
    return ROOT / ".venv-verifiers" / "bin" / "python"


def pythonpath() -> str:
    """PYTHONPATH for the v1 adapter: the tests (support.*) and tests/support (the taskset
    `vf_calculator`, which verifiers imports by its id, a top-level module name)."""
    return os.pathsep.join([str(ROOT / "tests"), str(ROOT / "tests" / "support")])


def adapter_command(*args: str) -> list[str]:
    return [str(vf_python()), "-m", "leangrpo.agents.verifiers_v1", *args, "--taskset", TASKSET]
