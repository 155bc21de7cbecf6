"""`make demo-distill`: on-policy distillation against GRPO on the bundled demo task.

1. The teacher: the demo model after GRPO (`leangrpo train examples/demo.yaml`, 40 steps)
   in runs/demo_distill/teacher; its final greedy eval must reach 0.98, or the script
   stops saying so.
2. The student: the untrained demo model with each weight matrix noised by NOISE x its own
   standard deviation (seed 0), in runs/demo_distill/student. The demo model itself is
   too strong to show anything (greedy 0.71, and GRPO passes 0.95 within 4 steps); the
   noised copy starts near 0.3 and knows the task's format but much less arithmetic.
3. The runs, each `leangrpo train examples/distill_demo.yaml` with --set overrides, the
   same seed, data, sampling and learning rate: distillation (the config: objective jsd
   with beta 0, the forward KL; `--runs` also offers the sampled objective and beta 1),
   GRPO (no teacher, the math reward weighted 1) and both (the reward and the teacher's
   divergence). Each logs eval/reward/math (greedy, 128 held-out prompts) every 2 steps.

Prints one JSON line per run (the curve, the first step at >= 0.95, wall time) and a
markdown table of the curves; writes runs/demo_distill/curves.json. Run from the
repository root: `python scripts/demo_distill.py [--runs distill,grpo,...] [--steps N]`.
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
GRPO = ["--set", "distill=null", "--set", "rewards.functions[0].weight=1.0"]
RUNS = {  # examples/distill_demo.yaml is "distill": jsd with beta 0 (the forward KL)
    "distill": [],
    "grpo": GRPO,
    "both": ["--set", "rewards.functions[0].weight=1.0"],
    "distill_sampled": ["--set", "distill={teacher: runs/demo_distill/teacher/final, objective: sampled}"],
    "distill_reverse": ["--set", "distill.jsd_beta=1.0"],
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
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="comma-separated, of " + ",".join(RUNS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--noise", type=float, default=NOISE)
    parser.add_argument("--lr", type=float, default=None, help="train.learning_rate for every run")
    parser.add_argument("--eval-every", type=int, default=2, help="eval.every_steps")
    args = parser.parse_args()
    os.chdir(REPO)
    build_teacher()
    build_student(args.noise)
    results = {}
    lr = [] if args.lr is None else ["--set", f"train.learning_rate={args.lr}"]
    lr += ["--set", f"eval.every_steps={args.eval_every}"]
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
