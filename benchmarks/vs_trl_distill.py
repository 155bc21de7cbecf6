"""The distillation case of benchmarks/vs_trl.py (`--case distill`): one run of one variant,
inside its own subprocess, against TRL 1.16's DistillationTrainer.

The job (both trainers): the demo-distill student (the demo model noised, greedy eval
~0.3) and teacher (the demo model after 40 GRPO steps, ~0.99), built by
scripts/demo_distill.py (the teacher cached in runs/demo_distill/teacher); on-policy
generation at temperature 1 of 6 new tokens; each step 16 prompts x 8 completions, the
same prompts in the same order (leangrpo: data.shuffle false, 8 generations per prompt;
TRL, which samples one completion per prompt: each prompt repeated 8 times, shuffle off,
batch 128); the generalised JSD with the same beta and temperature, reduced as TRL does
(sum over completion tokens / their count); AdamW at a constant 2e-4, clipping at 1.0, no
weight decay, fp32, no gradient checkpointing, one thread; no reward function.

Variants: trl (the baseline), leangrpo (objective jsd), leangrpo_sampled (the sampled
reverse-KL advantage), leangrpo_nf4 (jsd, the teacher's linears nf4 through bitsandbytes).
Measured as the other cases: wall per optimizer step (median, the first step left out),
peak RSS (trainer + its largest child), and the greedy eval after the last step (the same
code for all, vs_trl_runs.greedy_eval, the math reward).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from vs_trl_runs import ChildMemory, StepClock, greedy_eval, peak_memory, read_jsonl, read_rows

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("trl", "leangrpo", "leangrpo_sampled", "leangrpo_nf4")  # baseline first
CONFIG = ROOT / "examples" / "distill_demo.yaml"
BETA = 1.0  # TRL's default: the reverse KL
GROUP = 8


def prepare(workdir: Path) -> dict:
    """Student, teacher and data paths (case.json in `workdir`)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import demo_distill

    os.chdir(ROOT)
    teacher = demo_distill.build_teacher()
    student = demo_distill.build_student(demo_distill.NOISE, workdir / "student")
    demo = ROOT / "examples" / "demo"
    paths = {"model": str(student), "teacher": str(ROOT / teacher),
             "train": str(demo / "train.jsonl"), "eval": str(demo / "eval.jsonl")}  # fmt: skip
    (workdir / "case.json").write_text(json.dumps(paths))
    return paths


def leangrpo_config(case, paths: dict, out_dir: Path, variant: str, device: str):
    from leangrpo.config import config_from_dict, load_config

    data = load_config(str(CONFIG)).model_dump(mode="json")
    distill = {"teacher": paths["teacher"], "objective": "jsd", "jsd_beta": BETA, "weight": 1.0}
    if variant == "leangrpo_sampled":
        distill = {"teacher": paths["teacher"], "objective": "sampled", "weight": 1.0}
    if variant == "leangrpo_nf4":
        distill["teacher_quantization"] = "nf4"
    updates = {
        "run": {"output_dir": str(out_dir), "max_steps": case.steps, "device": device,
                "resume": "never", "seed": 0, "num_threads": 1 if device == "cpu" else None},
        "model": {"name_or_path": paths["model"], "dtype": "float32"},
        "data": {"path": paths["train"], "eval_path": None, "shuffle": False},
        "rewards": {"functions": []},  # pure distillation: nothing to score
        "rollout": {"num_generations": GROUP, "prompts_per_batch": case.prompts_per_step,
                    "temperature": case.temperature, "max_new_tokens": case.max_new_tokens},
        "train": {"learning_rate": case.lr, "lr_scheduler": "constant", "max_grad_norm": 1.0},
        "eval": {"every_steps": 0},
        "checkpoint": {"every_steps": 0, "save_final_model": False},
        "logging": {"backends": ["jsonl"], "progress_bar": False},
        "distill": distill,
    }  # fmt: skip
    for section, values in updates.items():
        data[section] = values if section == "distill" else {**data[section], **values}
    return config_from_dict(data)


def run_leangrpo(case, paths: dict, workdir: Path, variant: str, device: str) -> dict:
    from leangrpo.model.scoring import causal_lm
    from leangrpo.train import Trainer

    clock, children = StepClock(), ChildMemory()

    class TimedTrainer(Trainer):
        def on_step_end(self, metrics, batch):
            super().on_step_end(metrics, batch)
            clock.mark({"generate_s": metrics.get("time/generate", 0.0),
                        "score_train_s": metrics.get("time/score", 0.0) + metrics["time/train"],
                        "tokens_per_step": metrics.get("packing/tokens", 0.0)})  # fmt: skip

    cfg = leangrpo_config(case, paths, workdir / f"run-{variant}-{os.getpid()}", variant, device)
    trainer = TimedTrainer(cfg)
    trainer.train()
    result = {**clock.summary(), **peak_memory(device, children)}
    model = trainer.policy.model
    causal_lm(model).set_attn_implementation("sdpa")
    result["final_eval"] = greedy_eval(model, trainer.policy.tokenizer,
                                       read_rows(paths["eval"], case), case, device)  # fmt: skip
    return result


def trl_dataset(path: str):
    """Each prompt GROUP times in a row: TRL's batch of 128 is leangrpo's 16 x 8."""
    from datasets import Dataset

    rows = [r for r in read_jsonl(path) for _ in range(GROUP)]
    return Dataset.from_list(rows)


def run_trl(case, paths: dict, workdir: Path, device: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    clock, children = StepClock(), ChildMemory()
    phase = {"generate_s": 0.0}
    if not hasattr(DistillationTrainer, "_generate"):  # a private hook: the timer needs it
        raise RuntimeError("this TRL's DistillationTrainer has no _generate; update the timer")

    class TimedDistillation(DistillationTrainer):
        def _generate(self, prompts):
            t0 = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                phase["generate_s"] += time.perf_counter() - t0

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            phase["begin"], phase["generate_s"] = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, **kwargs):
            step = time.perf_counter() - phase["begin"]  # generation happens inside the step
            clock.mark({"generate_s": phase["generate_s"],
                        "score_train_s": step - phase["generate_s"]})  # fmt: skip

    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    student = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(paths["teacher"], dtype=torch.float32)
    args = DistillationConfig(
        output_dir=str(workdir / f"run-trl-{os.getpid()}"),
        per_device_train_batch_size=case.prompts_per_step * GROUP,
        gradient_accumulation_steps=1,
        max_completion_length=case.max_new_tokens,
        temperature=case.temperature,
        top_p=1.0,
        top_k=0,
        beta=BETA,
        learning_rate=case.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        max_steps=case.steps,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=device == "cpu",
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = TimedDistillation(
        model=student, teacher_model=teacher, args=args, train_dataset=trl_dataset(paths["train"]),
        processing_class=tokenizer, callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()
    result = {**clock.summary(), **peak_memory(device, children)}
    result["final_eval"] = greedy_eval(trainer.model, tokenizer, read_rows(paths["eval"], case),
                                       case, device)  # fmt: skip
    return result


def run_variant(variant: str, case, workdir: Path, device: str) -> dict:
    if device == "cpu":
        torch.set_num_threads(1)
    paths = json.loads((workdir / "case.json").read_text())
    t0 = time.perf_counter()
    if variant == "trl":
        result = run_trl(case, paths, workdir, device)
    else:
        result = run_leangrpo(case, paths, workdir, variant, device)
    result["run_wall_s"] = time.perf_counter() - t0
    return result
