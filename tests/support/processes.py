"""Child interpreters: the CLI (`run_cli`) and short Python probes (`run_python`), run from
the repository root with their output captured as text. A probe checks what a fresh
process imports (torch, datasets, ...), which the test's own process cannot tell: its
asserts fail the child, so the exit status and stderr say what went wrong. `kill_tree`:
a `leangrpo serve` and the engine core it spawned, SIGKILLed."""

from __future__ import annotations

import contextlib
import subprocess
import sys

from support.configs import ROOT

# Runs the CLI and reports, on its last stdout line, whether torch was ever imported.
TORCH_PROBE = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
    "from leangrpo.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


HANG_S = 600  # a hang guard: a CLI run is seconds on 2 quiet cores, several times more under load


def run_python(
    code: str, *args: str, timeout: float = HANG_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -c code args...`; env replaces the environment when given."""
    return _run(["-c", code, *args], timeout, env)


def run_cli(
    *args: str, timeout: float = HANG_S, probe: bool = False
) -> subprocess.CompletedProcess:
    """`python -m leangrpo args...`; probe: through TORCH_PROBE, whose last stdout line is
    `torch imported: True|False`."""
    head = ["-c", TORCH_PROBE] if probe else ["-m", "leangrpo"]
    return _run([*head, *args], timeout)


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None):
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


def kill_tree(pid: int) -> None:
    """SIGKILL a process (a server) and every process it spawned (its engine core)."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for process in [*root.children(recursive=True), root]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
