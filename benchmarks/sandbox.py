"""What the sandbox costs a worker.  python benchmarks/sandbox.py [--quick]

Per sandbox level (sandbox/levels.py): **baseline = `process`** (a hardened worker process,
no namespaces: the old worker plus an allow-listed environment and its output meter) vs
`namespace` (the default where it starts: user, PID, IPC, mount and network namespaces,
read-only filesystem, the waiting launcher process). Cases:

- `start-up`: one reward worker (the `length` built-in) from `RewardPool(...)` until it
  has scored its first call: interpreter, confinement, imports.
- `reward call`: `RewardPool.score` of 8 samples with `length` (no compute: the per-call
  cost of the round trip, the call's limits and its process clean-up).
- `tool call`: `EnvironmentPool.step` of one trajectory calling the tool demo's
  calculator (the `make demo-tools` path: parse, one limited tool call, reply).

One JSON line per case and variant: `time_s` (mean wall time), `cpu_s` (CPU seconds of the
trainer and the worker's processes per call: steadier than wall time on a shared machine;
start-up: of the trainer only), `peak_bytes` (proportional
set size, PSS, of the worker's processes after the measured calls: at `namespace` the
launcher waiting for the worker counts, with the pages it shares with it split between
them), `time_ratio` and `mem_ratio` against `process` from the same run. The namespace
probe (once per trainer process) runs before the timing. CPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from device_info import device_name  # noqa: E402

from leangrpo.config.environment import EnvironmentConfig  # noqa: E402
from leangrpo.contracts import Completion, Prompt, RolloutSample  # noqa: E402
from leangrpo.environments.pool import EnvironmentPool  # noqa: E402
from leangrpo.rewards import RewardPool  # noqa: E402
from leangrpo.sandbox.levels import namespace_failure  # noqa: E402

CALCULATOR = str(ROOT / "examples" / "tools_demo" / "calculator.py") + ":add"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 123, "b": 456}}</tool_call>'
LEVELS = ("process", "namespace")


def samples(n: int) -> list[RolloutSample]:
    return [
        RolloutSample(i, Prompt(i, "1+2=", [1]), Completion([1], "3", [0.0], "stop", 0))
        for i in range(n)
    ]


def rewards_cfg(level: str) -> SimpleNamespace:
    fn = SimpleNamespace(name="length", weight=1.0, kwargs={"target": 3})
    return SimpleNamespace(functions=[fn], timeout_s=10.0, num_workers=1, fail_fast=False,
                           memory_limit_mb=8192, cpu_time_limit_s=None,
                           sandbox=SimpleNamespace(level=level))  # fmt: skip


def tree_cpu(pid: int) -> float:
    """CPU seconds so far of this process and the worker's processes."""
    launcher = psutil.Process(pid)
    total = time.process_time()
    for proc in [launcher, *launcher.children(recursive=True)]:
        times = proc.cpu_times()
        total += times.user + times.system
    return total


def tree_pss(pid: int) -> int:
    launcher = psutil.Process(pid)
    return sum(p.memory_full_info().pss for p in [launcher, *launcher.children(recursive=True)])


def start_up(level: str, repeats: int) -> tuple[float, float, int]:
    times, cpu, rss = [], 0.0, 0
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        with RewardPool(rewards_cfg(level)) as pool:
            pool.score(samples(1))
            times.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
            rss = tree_pss(pool._workers[0].pid)
    return sum(times) / len(times), cpu / repeats, rss


def reward_calls(level: str, calls: int) -> tuple[float, float, int]:
    with RewardPool(rewards_cfg(level)) as pool:
        pool.score(samples(8))
        pid = pool._workers[0].pid
        t0, c0 = time.perf_counter(), tree_cpu(pid)
        for _ in range(calls):
            pool.score(samples(8))
        elapsed = (time.perf_counter() - t0) / calls
        return elapsed, (tree_cpu(pid) - c0) / calls, tree_pss(pid)


def tool_calls(level: str, calls: int) -> tuple[float, float, int]:
    cfg = EnvironmentConfig(name="tools", tools=[CALCULATOR], num_workers=1,
                            sandbox={"level": level})  # fmt: skip
    with EnvironmentPool(cfg) as pool:
        keys = pool.new_sessions(calls + 1)
        pool.reset([(k, [{"role": "user", "content": "123+456="}], {}, 0) for k in keys])
        pool.step([(keys[0], CALL, 0)])
        pid = pool._workers[0].pid
        t0, c0 = time.perf_counter(), tree_cpu(pid)
        for key in keys[1:]:
            (out,) = pool.step([(key, CALL, 0)])
            assert out.ok["reply"][0]["content"] == "579", out
        elapsed = (time.perf_counter() - t0) / calls
        return elapsed, (tree_cpu(pid) - c0) / calls, tree_pss(pid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and calls")
    args = parser.parse_args()
    repeats, calls = (2, 20) if args.quick else (5, 100)
    namespace_failure(False)  # the probe: once per trainer process, not per worker
    cases = {
        "start-up": lambda level: start_up(level, repeats),
        "reward call": lambda level: reward_calls(level, calls),
        "tool call": lambda level: tool_calls(level, calls),
    }
    for case, run in cases.items():
        base = None
        for level in LEVELS:
            time_s, cpu_s, peak = run(level)
            row = {"bench": "sandbox", "case": case, "device": device_name("cpu"),
                   "variant": level, "time_s": round(time_s, 5), "cpu_s": round(cpu_s, 5),
                   "peak_bytes": peak}  # fmt: skip
            if base is None:
                base = (time_s, peak)
            else:
                row["time_ratio"] = round(time_s / base[0], 3)
                row["mem_ratio"] = round(peak / base[1], 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
