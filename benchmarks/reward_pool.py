"""Reward worker round-trips.  python benchmarks/reward_pool.py [--quick]

Times `RewardPool.score` on demo-shaped samples ("37+45=" prompts, 8 completions each,
the `math` reward against the `answer` column; a quarter of the completions correct) with
1 and 2 workers, with the `format` reward added (two functions per chunk), and three
cheap built-ins (format, length, format: the pool's own overhead). The pool is
started and warmed up (one untimed call) first. Per call: `time_s` (mean wall time) and
`cpu_s` (CPU seconds of the trainer process plus its workers; steadier than wall time on a
shared machine). CPU only: the workers never touch an accelerator.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from leangrpo.contracts import Completion, Prompt, RolloutSample  # noqa: E402
from leangrpo.rewards import RewardPool  # noqa: E402


def make_samples(n: int, seed: int = 0) -> list[RolloutSample]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        answer = a + b
        text = str(answer if rng.random() < 0.25 else answer + rng.choice([-10, -1, 1, 10]))
        prompt = Prompt(uid=i // 8, text=f"{a}+{b}=", ids=[1], columns={"answer": str(answer)})
        completion = Completion(ids=[1], text=text, logprobs=[0.0], finish_reason="stop", version=0)
        samples.append(RolloutSample(group_id=i // 8, prompt=prompt, completion=completion))
    return samples


def rewards_cfg(functions: list[dict], num_workers: int) -> SimpleNamespace:
    specs = [SimpleNamespace(**{"weight": 1.0, "kwargs": {}, **f}) for f in functions]
    return SimpleNamespace(
        functions=specs,
        timeout_s=10.0,
        num_workers=num_workers,
        fail_fast=False,
        memory_limit_mb=None,
        cpu_time_limit_s=None,
    )


def _cpu(workers: list[psutil.Process]) -> float:
    """CPU seconds used so far by this process and the workers."""
    total = time.process_time()
    for proc in workers:
        times = proc.cpu_times()
        total += times.user + times.system
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 timed calls per case")
    args = parser.parse_args()
    calls = 3 if args.quick else args.calls
    cheap = [  # almost no compute: the time is the pool's own overhead (IPC, scheduling)
        {"name": "format", "kwargs": {"pattern": r"^\d+$"}},
        {"name": "length", "kwargs": {"target": 3}},
        {"name": "format", "kwargs": {"pattern": r"^-"}},
    ]
    cases = {
        "math": [{"name": "math"}],
        "math+format": [{"name": "math"}, cheap[0]],
        "3 cheap functions": cheap,
    }
    for case, functions in cases.items():
        for workers in (1, 2):
            with RewardPool(rewards_cfg(functions, workers)) as pool:
                pool.score(make_samples(args.samples))  # start-up and first-call costs
                procs = []  # each worker's tree: a namespace worker runs under its launcher
                for w in pool._workers:
                    launcher = psutil.Process(w.proc.pid)
                    procs += [launcher, *launcher.children(recursive=True)]
                times = []
                cpu0 = _cpu(procs)
                for c in range(calls):
                    samples = make_samples(args.samples, seed=c + 1)
                    t0 = time.perf_counter()
                    metrics = pool.score(samples)
                    times.append(time.perf_counter() - t0)
                cpu = (_cpu(procs) - cpu0) / calls
            row = {
                "bench": "reward_pool",
                "case": case,
                "device": platform.processor() or platform.machine(),
                "variant": f"workers={workers}",
                "samples": args.samples,
                "time_s": round(sum(times) / len(times), 5),
                "min_s": round(min(times), 5),
                "cpu_s": round(cpu, 5),
                "failures": metrics.get("reward/failures"),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
