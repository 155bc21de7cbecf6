"""Profile leangrpo's optimizer steps with cProfile (where a step's fixed overhead goes).

Runs `leangrpo train CONFIG` in-process for `--steps` steps with evaluation and
checkpoints out of the way, profiles every step after the first `--skip` (warm-up), and
prints the top functions by cumulative and by own time, per profiled step.

    python scripts/profile_step.py examples/demo.yaml --steps 12 --skip 2
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time

from leangrpo.config import load_config
from leangrpo.train import Trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("config")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the profile")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    out = tempfile.mkdtemp(prefix="leangrpo_profile_")
    cfg = load_config(
        args.config,
        [
            f"run.output_dir={out}",
            f"run.max_steps={args.steps}",
            "run.resume=never",
            "eval.every_steps=0",
            "eval.num_prompts=1",
            "checkpoint.every_steps=0",
            "logging.progress_bar=false",
            *args.overrides,
        ],
    )
    profiler = cProfile.Profile()
    marks: list[float] = []

    class ProfiledTrainer(Trainer):
        def on_step_end(self, metrics, batch):
            super().on_step_end(metrics, batch)
            if self.step == args.skip:
                marks.append(time.perf_counter())
                profiler.enable()
            elif self.step == args.steps:
                profiler.disable()
                marks.append(time.perf_counter())

    ProfiledTrainer(cfg).train()
    steps = args.steps - args.skip
    print(f"profiled {steps} steps: {(marks[1] - marks[0]) / steps:.3f} s per step (wall)")
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats(key).print_stats(args.top)
        print(f"\n===== by {key} (totals over {steps} steps) =====")
        print(buf.getvalue().split("\n\n", 1)[-1])


if __name__ == "__main__":
    main()
