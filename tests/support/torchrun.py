"""Running `leangrpo train` under torchrun from a test: the launch (`torchrun`, or the ranks
started without its agent: `start_ranks`), waiting for it (`finish`), the final weights,
the metrics steps logged so far, and killing a launch with every process it started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from support.ranks import free_port


def torchrun(cfg: dict, *, nproc: int = 2) -> subprocess.Popen:
    """`torchrun --standalone --nproc_per_node N -m leangrpo train cfg.yaml`, own session;
    the config is written beside its output directory (cfg.yaml), the log too (cfg.log)."""
    path = Path(cfg["run"]["output_dir"]).with_suffix(".yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), "-m", "leangrpo", "train", str(path)]  # fmt: skip
    log = open(path.with_suffix(".log"), "w")  # noqa: SIM115 (the process owns it)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, cfg: dict, limit_s: float = 900.0) -> str:
    """Wait for a torchrun started by `torchrun`; its log, asserting it exited 0."""
    try:
        proc.wait(timeout=limit_s)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
            proc.wait()
    log = Path(cfg["run"]["output_dir"]).with_suffix(".log").read_text()
    assert proc.returncode == 0, log[-4000:]
    return log


def final_tensors(out: Path) -> dict[str, torch.Tensor]:
    """The final model's weights as loaded (full: every state-dict key, tied ones too)."""
    final = out / "final"
    if (final / "adapter_config.json").is_file():
        return load_file(final / "adapter_model.safetensors")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(final).state_dict()


def max_abs_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and every descendant (torchrun puts each rank in its own session)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def start_ranks(
    cfg: dict, tmp_path: Path, world_size: int = 2
) -> tuple[list[subprocess.Popen], list]:
    """Ranks launched as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT, each in its
    own session) but without its agent; logs in tmp_path/rank<r>.log (close them)."""
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs, logs = [], []
    for rank in range(world_size):
        logs.append(open(tmp_path / f"rank{rank}.log", "w"))  # noqa: SIM115
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "leangrpo", "train", str(path)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True,
        ))  # fmt: skip
    return procs, logs


def logged_steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    lines = metrics.read_text().splitlines()
    return [json.loads(x)["step"] for x in lines if x.endswith("}")]  # the last may be torn


def wait_for_logged_step(procs: list[subprocess.Popen], metrics: Path, step: int) -> None:
    deadline = time.monotonic() + 900  # a hang guard
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if step in logged_steps(metrics):
            return
        time.sleep(0.05)
    pytest.fail(f"step {step} was never logged (exit codes {[p.poll() for p in procs]})")
