"""What the sandbox costs.  python benchmarks/sandbox.py [--quick] [--src DIR]

Per sandbox level (sandbox/levels.py): **baseline = `process`** (no namespaces) vs
`namespace` (the default where it starts). Cases:

- `start-up`: one reward worker (the `length` built-in) from `RewardPool(...)` until it
  has scored its first call: interpreter, confinement, imports.
- `reward call`: `RewardPool.score` of one prompt's 8 samples with `length` (one call), calls back to back (no
  compute: the per-call cost of the round trip, the call's box and its clean-up).
- `trajectory start`: `EnvironmentPool.reset` of one new trajectory of the tool demo's
  environment (its box started and the environment built).
- `tool call`: `EnvironmentPool.step` of one trajectory calling the tool demo's
  calculator (the `make demo-tools` path: parse, one limited tool call, reply).

One JSON line per case and variant: `time_s` (mean wall time), `cpu_s` (CPU seconds per
call of the trainer and every process of the worker, boxes that ended included: steadier
than wall time on a shared machine; start-up: of the trainer only), `peak_bytes`
(proportional set size, PSS, of the worker's processes after the measured calls; for a
trajectory, with its box alive), `time_ratio` and `mem_ratio` against `process` from the
same run. `--src DIR` measures another checkout's `src` (the code before a change, in the
same conditions: `--src ../main/src`). The namespace probe (once per trainer process) runs
before the timing. CPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

CALCULATOR = str(ROOT / "examples" / "tools_demo" / "calculator.py") + ":add"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 123, "b": 456}}</tool_call>'
USER = [{"role": "user", "content": "123+456="}]
LEVELS = ("process", "namespace")


def samples(n: int) -> list:
    from leangrpo.contracts import Completion, Prompt, RolloutSample

    return [
        RolloutSample(0, Prompt(0, "1+2=", [1]), Completion([1], "3", [0.0], "stop", 0))
        for i in range(n)
    ]


def rewards_cfg(level: str):
    from leangrpo.config.run import RewardsConfig

    return RewardsConfig(functions=[{"name": "length", "kwargs": {"target": 3}}],
                         num_workers=1, sandbox={"level": level})  # fmt: skip


def environment_cfg(level: str):
    from leangrpo.config.environment import EnvironmentConfig

    return EnvironmentConfig(name="tools", tools=[CALCULATOR], num_workers=1,
                             sandbox={"level": level})  # fmt: skip


def tree(pid: int) -> list[psutil.Process]:
    launcher = psutil.Process(pid)
    return [launcher, *launcher.children(recursive=True)]


def cpu_now(pid: int) -> float:
    """CPU seconds so far of this process, the worker's live processes and every child
    they reaped (the boxes that ended: RUSAGE_CHILDREN of the worker's own processes is
    not readable from here, so the worker tree's children_* times are used)."""
    total = time.process_time()
    for proc in tree(pid):
        times = proc.cpu_times()
        total += times.user + times.system + times.children_user + times.children_system
    return total


def tree_pss(pid: int) -> int:
    return sum(p.memory_full_info().pss for p in tree(pid))


def start_up(level: str, repeats: int) -> tuple[float, float, int]:
    from leangrpo.rewards import RewardPool

    times, cpu, pss = [], 0.0, 0
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        with RewardPool(rewards_cfg(level)) as pool:
            pool.score(samples(1))
            times.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
            pss = tree_pss(pool._workers[0].pid)
    return sum(times) / len(times), cpu / repeats, pss


def reward_calls(level: str, calls: int) -> tuple[float, float, int]:
    from leangrpo.rewards import RewardPool

    with RewardPool(rewards_cfg(level)) as pool:
        for _ in range(3):  # warm: the first calls measure the function's speed
            pool.score(samples(8))
        pid = pool._workers[0].pid
        t0, c0 = time.perf_counter(), cpu_now(pid)
        for _ in range(calls):
            batch = samples(8)
            pool.score(batch)
            assert batch[0].reward is not None, batch[0]
        elapsed = (time.perf_counter() - t0) / calls
        return elapsed, (cpu_now(pid) - c0) / calls, tree_pss(pid)


def trajectory_starts(level: str, calls: int) -> tuple[float, float, int]:
    from leangrpo.environments.pool import EnvironmentPool

    with EnvironmentPool(environment_cfg(level)) as pool:
        pid = pool._workers[0].pid
        elapsed, cpu = 0.0, 0.0
        for _ in range(calls):
            (key,) = pool.new_sessions(1)
            t0, c0 = time.perf_counter(), cpu_now(pid)
            (out,) = pool.reset([(key, USER, {}, 0)])
            elapsed += time.perf_counter() - t0
            cpu += cpu_now(pid) - c0
            assert out.error is None, out.error
            pss = tree_pss(pid)  # with one trajectory alive
            pool.finish([(key, "stop")])
        return elapsed / calls, cpu / calls, pss


def tool_calls(level: str, calls: int) -> tuple[float, float, int]:
    from leangrpo.environments.pool import EnvironmentPool

    with EnvironmentPool(environment_cfg(level)) as pool:
        (key,) = pool.new_sessions(1)
        (out,) = pool.reset([(key, USER, {}, 0)])
        assert out.error is None, out.error
        pool.step([(key, CALL, 0)])
        pid = pool._workers[0].pid
        t0, c0 = time.perf_counter(), cpu_now(pid)
        for _ in range(calls):
            (out,) = pool.step([(key, CALL, 0)])
            assert out.ok["reply"][0]["content"] == "579", out
        elapsed = (time.perf_counter() - t0) / calls
        return elapsed, (cpu_now(pid) - c0) / calls, tree_pss(pid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and calls")
    parser.add_argument("--src", default=str(ROOT / "src"), help="the leangrpo to measure")
    parser.add_argument("--case", action="append", help="only these cases (repeatable)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.src).resolve()))
    from device_info import device_name

    from leangrpo.sandbox.levels import namespace_failure

    repeats, calls = (2, 20) if args.quick else (5, 100)
    namespace_failure(False)  # the probe: once per trainer process, not per worker
    cases = {
        "start-up": lambda level: start_up(level, repeats),
        "reward call": lambda level: reward_calls(level, calls),
        "trajectory start": lambda level: trajectory_starts(level, calls),
        "tool call": lambda level: tool_calls(level, calls),
    }
    source = os.path.relpath(Path(args.src).resolve(), ROOT)
    for case, run in cases.items():
        if args.case and case not in args.case:
            continue
        base = None
        for level in LEVELS:
            time_s, cpu_s, peak = run(level)
            row = {"bench": "sandbox", "case": case, "device": device_name("cpu"),
                   "variant": level, "src": source, "time_s": round(time_s, 5),
                   "cpu_s": round(cpu_s, 5), "peak_bytes": peak}  # fmt: skip
            if base is None:
                base = (time_s, peak)
            else:
                row["time_ratio"] = round(time_s / base[0], 3)
                row["mem_ratio"] = round(peak / base[1], 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
