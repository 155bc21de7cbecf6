"""`make demo-distill`: on-policy distillation against GRPO on the bundled demo task.

1. The teacher: the demo model after GRPO (`leangrpo train examples/demo.yaml`, 40 steps)
   in runs/demo_distill/teacher; its final greedy eval must reach 0.98, or the script
   stops saying so.
2. The student: the untrained demo model with each weight matrix noised by NOISE x its own
   standard deviation (seed 0), in runs/demo_distill/student. The demo model itself is
   too strong to show anything (greedy 0.71, and GRPO passes 0.95 within 4 steps); the
   noised copy starts near 0.3 and knows the task's format but much less arithmetic.
3. The runs, each `leangrpo train examples/distill_demo.yaml` with --set overrides, the
   same seed, data, learning rate and 128 sampled completions a step (T = 1), each
   method in the batch layout it learns fastest with (benchmarks/RESULTS.md
   "demo-distill" has the sweep): distillation (the config: objective jsd with beta 0,
   the forward KL, on 128 prompts x 1 completion: a teacher's per-token signal needs no
   group, so every completion can be another problem; `--runs` also offers the sampled
   objective, beta 1, and the 16 x 8 layout), GRPO (no teacher, the math reward weighted
   1, 32 prompts x 4: its best of 16 x 8, 32 x 4 and 64 x 2) and both (the reward and the
   teacher's divergence, GRPO's 32 x 4). Each logs eval/reward/math (greedy, 128 held-out
   prompts) every 2 steps.

Prints one JSON line per run (the curve, the first step at >= 0.95, wall time), a
markdown table of the curves and the goal's line (distillation at 0.95 in at most half
GRPO's steps); writes runs/demo_distill/curves.json. Run from the repository root:
`python scripts/demo_distill.py [--runs distill,grpo,...] [--steps N] [--set KEY=VALUE]`
(`--set` goes to every run, after the run's own overrides).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = Path("runs/demo_distill")
DEMO = Path("examples/demo/model")
CONFIG = "examples/distill_demo.yaml"
NOISE = 0.25
TEACHER_STEPS = 40
TEACHER_MIN_EVAL = 0.98
GOAL = 0.95
REWARD = ["--set", "rewards.functions[0].weight=1.0"]
GROUPS = ["--set", "rollout.prompts_per_batch=32", "--set", "rollout.num_generations=4"]
RUNS = {  # examples/distill_demo.yaml is "distill": jsd with beta 0, 128 prompts x 1
    "distill": [],
    "grpo": ["--set", "distill=null", *REWARD, *GROUPS],
    "both": [*REWARD, *GROUPS],
    "distill_sampled": [
        "--set",
        "distill={teacher: runs/demo_distill/teacher/final, objective: sampled}",
    ],
    "distill_reverse": ["--set", "distill.jsd_beta=1.0"],
    "distill_16x8": ["--set", "rollout.prompts_per_batch=16", "--set", "rollout.num_generations=8"],
}
DEFAULT_RUNS = "distill,grpo,both"


def leangrpo(*args: str) -> None:
    cmd = [str(Path(sys.executable).parent / "leangrpo"), "train", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def evals(run_dir: Path, key: str = "eval/reward/math") -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(int(r["step"]), float(r[key])) for r in rows if key in r]


def build_teacher() -> Path:
    final = OUT / "teacher" / "final"
    if not (final / "model.safetensors").is_file():
        leangrpo("examples/demo.yaml", "--set", "run.overwrite=true",
                 "--set", f"run.output_dir={OUT / 'teacher'}",
                 "--set", f"run.max_steps={TEACHER_STEPS}",
                 "--set", f"eval.every_steps={TEACHER_STEPS}")  # fmt: skip
    step, score = evals(OUT / "teacher", "eval/reward")[-1]
    if score < TEACHER_MIN_EVAL:
        raise SystemExit(
            f"demo_distill: the GRPO teacher reached greedy eval {score:.3f} at step {step}, "
            f"below {TEACHER_MIN_EVAL}; delete {OUT / 'teacher'} and rerun (or raise "
            "TEACHER_STEPS)"
        )
    print(f"teacher: greedy eval {score:.3f} after {step} GRPO steps ({final})", flush=True)
    return final


def build_student(noise: float, student: Path = OUT / "student") -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(DEMO, student, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() >= 2:  # the matrices (embeddings tied to the head); norms kept
                p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    model.save_pretrained(student)
    return student


def first_at(curve: list[tuple[int, float]], goal: float) -> int | None:
    return next((step for step, value in curve if value >= goal), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs", default=DEFAULT_RUNS, help="comma-separated, of " + ",".join(RUNS)
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--noise", type=float, default=NOISE)
    parser.add_argument("--lr", type=float, default=None, help="train.learning_rate for every run")
    parser.add_argument("--eval-every", type=int, default=2, help="eval.every_steps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (after the run's own)")  # fmt: skip
    args = parser.parse_args()
    unknown = [name for name in args.runs.split(",") if name not in RUNS]
    if unknown:
        parser.error(f"--runs: {', '.join(unknown)} is not one of {', '.join(RUNS)}")
    os.chdir(REPO)
    build_teacher()
    build_student(args.noise)
    results = {}
    lr = [] if args.lr is None else ["--set", f"train.learning_rate={args.lr}"]
    lr += ["--set", f"eval.every_steps={args.eval_every}"]
    lr += [arg for override in args.set for arg in ("--set", override)]
    for name in args.runs.split(","):
        run_dir = OUT / name
        t0 = time.perf_counter()
        leangrpo(CONFIG, "--set", "run.overwrite=true", "--set", f"run.output_dir={run_dir}",
                 "--set", f"run.max_steps={args.steps}", *RUNS[name], *lr)  # fmt: skip
        curve = evals(run_dir)
        results[name] = {"curve": curve, "first_at_goal": first_at(curve, GOAL),
                         "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
        print(json.dumps({"bench": "demo_distill", "run": name, **results[name]}), flush=True)
    (OUT / "curves.json").write_text(json.dumps({"noise": args.noise, "runs": results}, indent=1))
    print(table(results))
    if "distill" in results and "grpo" in results:
        print(
            verdict(
                results["distill"]["first_at_goal"], results["grpo"]["first_at_goal"], args.steps
            )
        )


def verdict(distill: int | None, grpo: int | None, steps: int) -> str:
    """The goal's line: distillation at GOAL in at most half GRPO's steps (a GRPO that
    never got there within `steps` took more than `steps`)."""
    if distill is None:
        return f"goal not met: distillation did not reach {GOAL} within {steps} steps"
    if grpo is None:
        met = 2 * distill <= steps
        return (
            f"goal {'met' if met else 'not shown'}: distillation reached {GOAL} at step "
            f"{distill}, GRPO not within {steps} steps (ratio < {distill / steps:.2f})"
        )
    met = 2 * distill <= grpo
    return (
        f"goal {'met' if met else 'not met'}: distillation reached {GOAL} at step {distill}, "
        f"GRPO at step {grpo} (ratio {distill / grpo:.2f}, goal <= 0.5)"
    )


def table(results: dict) -> str:
    steps = sorted({s for r in results.values() for s, _ in r["curve"]})
    head = "| step | " + " | ".join(results) + " |"
    lines = [head, "|" + "---|" * (len(results) + 1)]
    for step in steps:
        cells = [f"{dict(r['curve']).get(step, float('nan')):.3f}" for r in results.values()]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    firsts = [str(r["first_at_goal"]) for r in results.values()]
    lines.append(f"| first step >= {GOAL} | " + " | ".join(firsts) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
