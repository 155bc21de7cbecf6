"""Launching a per-rank worker (support/dist_worker.py, or another script: `worker`) on 2
ranks (or `world_size`) as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT), each in its
own session, and checking that no process is left behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

WORKER = Path(__file__).with_name("dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    out: Path,
    *args: str,
    limit_s: float = 900.0,  # a hang guard (the ranks take 10-90 s on 2 quiet cores)
    env: dict | None = None,
    world_size: int = 2,
    worker: Path = WORKER,
) -> list[SimpleNamespace]:
    """Run the worker on `world_size` ranks; returns per rank (returncode, log text, seconds)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    env.update(WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(world_size):
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), *args],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    results = []
    try:
        for proc in procs:
            left = max(limit_s - (time.monotonic() - start), 1.0)
            proc.wait(timeout=left)
            results.append(time.monotonic() - start)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        for log in logs:
            log.close()
    for proc in procs:  # nothing left in either rank's session (children included)
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)
    return [
        SimpleNamespace(code=p.returncode, log=(out / f"rank{r}.log").read_text(), seconds=s)
        for r, (p, s) in enumerate(zip(procs, results))
    ]


def assert_ok(ranks: list[SimpleNamespace]) -> None:
    for r, rank in enumerate(ranks):
        assert rank.code == 0, f"rank {r} exited {rank.code}:\n{rank.log[-3000:]}"


