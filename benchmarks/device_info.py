"""The `device` field of the benchmarks' JSON lines: the GPU's name, or the CPU model with
its cores, the torch threads the measurement used and the 1-minute load average (on a
shared machine the load says how far wall times can be trusted)."""

from __future__ import annotations

import os


def device_name(device: str, threads: int | None = None) -> str:
    """`threads`: the torch threads of the measured runs (default: this process's)."""
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    with open("/proc/cpuinfo") as f:
        model = next(
            (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "cpu"
        )
    threads = torch.get_num_threads() if threads is None else threads
    plural = "" if threads == 1 else "s"
    load = os.getloadavg()[0]
    return f"{model} ({os.cpu_count()} cores, {threads} torch thread{plural}, load {load:.1f})"
