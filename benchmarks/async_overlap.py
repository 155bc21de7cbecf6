"""Does asynchronous GRPO hide generation behind training?  python benchmarks/async_overlap.py

(a) `sim`: the real producers (leangrpo.pipeline) driven by an engine and a trainer that
    take given times (sleeps), for gen/train ratios 0.25, 1 and 4. Sync wall time per step
    is gen + train + sync; async should approach max(gen, train) + sync.
(b) `demo`: the bundled demo on CPU, sync vs async (max_staleness 1), same number of
    steps: wall time and final eval reward (skipped with --sim-only).

Every case reports generator and trainer idle fractions and a staleness histogram.
One JSON object per line (see DESIGN.md, "Benchmarks").
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from leangrpo.contracts import Completion, Prompt, SamplingParams  # noqa: E402
from leangrpo.pipeline.batch import BatchFinisher, RolloutSettings, RolloutWorker  # noqa: E402
from leangrpo.pipeline.producers import AsyncProducer, SyncProducer  # noqa: E402


class TimedEngine:
    """Generation that takes `gen_s` seconds and records when it was busy."""

    def __init__(self, gen_s: float):
        self.gen_s = gen_s
        self.version = 0
        self.busy_s = 0.0

    def generate(self, prompts, params, n, version, prompt_offset=0):
        time.sleep(self.gen_s)
        self.busy_s += self.gen_s
        return [
            [Completion([1], str(i), [-1.0], "stop", self.version) for i in range(n)]
            for _ in prompts
        ]

    def update_weights(self, named_tensors, version):
        self.version = version

    def load_adapter(self, path, version):
        self.version = version

    def close(self):
        pass


class Rewards:
    def score(self, samples):
        for s in samples:
            s.rewards = {"r": float(s.completion.text)}
            s.reward = float(s.completion.text)
        return {}


class Sampler:
    def __init__(self):
        self.i = 0

    def next_batch(self):
        self.i += 1
        return [Prompt(self.i, "p", [1])]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]

    def requeue(self, prompts):
        pass


def simulate(
    mode: str, gen_s: float, train_s: float, sync_s: float, steps: int, max_staleness: int
) -> dict:
    engine = TimedEngine(gen_s)
    settings = RolloutSettings(2, 1, SamplingParams(), "group", seed=0)
    worker = RolloutWorker(engine, Rewards(), Sampler(), settings)
    finisher = BatchFinisher(settings, max_staleness)
    if mode == "async":
        producer = AsyncProducer(worker, finisher, prefetch_depth=1, max_staleness=max_staleness)
        producer.start()
    else:
        producer = SyncProducer(worker, finisher)
    version, waited, stale = 0, 0.0, collections.Counter()
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            w0 = time.perf_counter()
            batch = producer.next_batch(version)
            waited += time.perf_counter() - w0
            stale.update(version - s.version for s in batch.samples[:1])
            time.sleep(train_s)
            version += 1
            time.sleep(sync_s)  # the trainer-side cost of handing weights over
            producer.push_weights(version, lambda: [])
    finally:
        producer.close()
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "engine_busy_s": engine.busy_s,
        "trainer_wait_s": waited,
        "staleness_hist": {str(k): v for k, v in sorted(stale.items())},
    }


def sim_cases(steps: int) -> list[dict]:
    rows = []
    train_s, sync_s = 0.2, 0.01
    for ratio in (0.25, 1.0, 4.0):
        gen_s = ratio * train_s
        base = simulate("sync", gen_s, train_s, sync_s, steps, 0)
        run = simulate("async", gen_s, train_s, sync_s, steps, 1)
        ideal = max(gen_s, train_s) + sync_s
        for variant, r in (("sync", base), ("async", run)):
            per_step = r["wall_s"] / steps
            row = {
                "bench": "async_overlap",
                "case": f"sim gen/train={ratio}",
                "device": "cpu",
                "variant": variant,
                "time_s": per_step,
                "peak_bytes": None,
                "ideal_async_step_s": ideal,
                "serial_step_s": gen_s + train_s + sync_s,
                "generator_idle_frac": 1 - r["engine_busy_s"] / r["wall_s"],
                "trainer_idle_frac": r["trainer_wait_s"] / r["wall_s"],
                "staleness_hist": r["staleness_hist"],
            }
            if variant == "async":
                row["time_ratio"] = per_step / (base["wall_s"] / steps)
                row["mem_ratio"] = None
                row["vs_ideal"] = per_step / ideal
                # the first batch cannot overlap anything: the pipeline fills once per run
                row["vs_ideal_steady"] = (r["wall_s"] - gen_s) / steps / ideal
            rows.append(row)
    return rows


def demo_cases(steps: int) -> list[dict]:
    from leangrpo.config import load_config
    from leangrpo.train import Trainer

    rows, base_time = [], None
    runs = (
        ("warm-up", "pipeline.mode=sync"),
        ("sync", "pipeline.mode=sync"),
        ("async", "pipeline.mode=async"),
    )
    for variant, pipeline in runs:
        with tempfile.TemporaryDirectory() as out:
            cfg = load_config(
                ROOT / "examples" / "demo.yaml",
                [
                    f"run.output_dir={out}",
                    f"run.max_steps={steps}",
                    pipeline,
                    "pipeline.max_staleness=1",
                    "logging.progress_bar=false",
                    "logging.samples_every=0",
                    "checkpoint.save_final_model=false",
                ],
            )
            trainer = Trainer(cfg)  # set-up (model load, reward workers) is not timed
            t0 = time.perf_counter()
            final = trainer.train()
            wall = time.perf_counter() - t0
            metrics = [
                json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()
            ]
        if variant == "warm-up":  # first run in the process pays one-off import/JIT costs
            continue
        rows.append(_demo_row(variant, wall, steps, final, metrics, base_time))
        base_time = base_time or wall
    return rows


def _demo_row(variant, wall, steps, final, metrics, base_time) -> dict:
    stale = collections.Counter(int(m["staleness/max"]) for m in metrics if "staleness/max" in m)
    produce = sum(m.get("time/generate", 0.0) + m.get("time/rewards", 0.0) for m in metrics)
    waited = sum(m.get("time/trainer_wait", 0.0) for m in metrics)
    row = {
        "bench": "async_overlap",
        "case": f"demo {steps} steps",
        "device": "cpu",
        "variant": variant,
        "time_s": wall,
        "peak_bytes": None,
        "eval_reward_final": final.get("eval/reward"),
        "generator_idle_frac": max(0.0, 1 - produce / wall),
        "trainer_idle_frac": waited / wall if variant == "async" else produce / wall,
        "produce_s": produce,
        "staleness_hist": {str(k): v for k, v in sorted(stale.items())},
    }
    if base_time is not None:
        row["time_ratio"] = wall / base_time
        row["mem_ratio"] = None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (CPU, ~1-2 minutes)")
    parser.add_argument("--sim-only", action="store_true", help="skip the real demo runs")
    args = parser.parse_args()
    steps = 10 if args.quick else 30
    rows = sim_cases(steps)
    if not args.sim_only:
        rows += demo_cases(8 if args.quick else 40)
    for row in rows:
        row["host"] = platform.processor() or platform.machine()
        print(json.dumps(row))


if __name__ == "__main__":
    main()
