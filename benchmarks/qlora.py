"""QLoRA against LoRA: one GRPO step on a 4-bit (nf4) base against the full-precision one.

    python benchmarks/qlora.py [--quick] [--device cpu|cuda]

The step is the trainer's: `planning.plan_steps` -> `passes.attach_old_and_ref` (the
old-log-prob pass, mu 2, and the reference pass, beta 0.04: adapters off on the same base)
-> `step.train_step` (forward, backward, AdamW), on prompt groups of exactly the case's
lengths (random tokens), with gradient checkpointing on (the weights are then a visible
share of the step). The policy is loaded from disk as the trainer loads it
(`model.load_policy`: quantized by bitsandbytes as it loads, for the nf4 variant).

CPU (the default without a GPU): SmolLM2-135M-Instruct, real weights (leangrpo.model.smollm2),
fp32 LoRA (baseline `fp32_lora`) vs nf4 QLoRA with fp32 compute (`nf4_qlora`), one thread,
at the example's step shape (4 groups x (62-token prompt + 6 x 8)) and a longer one
(2 groups x (448 + 4 x 64)); `--quick` runs the first only. Each variant runs in a child
process of its own, so its RSS is its own. Per row: `time_s` (wall seconds of the step),
`cpu_s` (its CPU seconds: the figure to trust on a shared machine), `peak_bytes` (the
step's peak RSS: VmHWM reset once the policy is loaded), `live_peak_bytes` (the tensor
bytes alive at the peak of a second step, tests/support/memory_probe.LiveBytes: glibc's
slack left out), `weights_bytes` (the loaded policy's tensors: base, quantization constants,
adapters), `load_s`, `rss_loaded_bytes`, and `mem_ratio` / `time_ratio` / `cpu_ratio` /
`live_ratio` / `weights_ratio` against the baseline of the same shape.

CUDA: Qwen2.5-1.5B from its published config with random weights (benchmarks/models.py),
saved once to a temporary directory, bf16 LoRA (`bf16_lora`) vs nf4 QLoRA with bf16 compute
(`nf4_qlora`), grpo_step's shape (8 x (512 + 3584) tokens, micro-batch 8192) with
hidden-state offload and chunked log-probs as well; `peak_bytes` is
torch.cuda.max_memory_allocated over the step. Goal: the nf4 step's peak < 5 GB (Unsloth's
Qwen2.5-1.5B GRPO figure). The GPU suite runs the same rows (case `qlora_1.5b`; its dry run
takes tiny-qwen2 on CPU, in one process).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from leangrpo.config import Config, config_from_dict  # noqa: E402

BENCH = "qlora"
GB = 1e9
PEAK_GOAL_GB = 5.0  # the nf4 step on Qwen2.5-1.5B (GPU)
# name -> (groups, generations, prompt tokens, completion tokens, micro-batch tokens)
SHAPES = {
    "smollm2/4x(62+6x8)": (4, 6, 62, 8, 1024),
    "smollm2/2x(448+4x64)": (2, 4, 448, 64, 2048),
    "qwen2.5-1.5b/8x(512+3584)": (1, 8, 512, 3584, 8192),
    "tiny-qwen2/2x(16+4x24)": (2, 4, 16, 24, 256),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    quantization: str  # "none" | "nf4"


def variants(device: str) -> list[Variant]:
    base = "bf16_lora" if device == "cuda" else "fp32_lora"
    return [Variant(base, "none"), Variant("nf4_qlora", "nf4")]


def step_config(model_dir: Path, case: str, variant: Variant, device: str) -> Config:
    groups, generations, prompt, completion, budget = SHAPES[case]
    cuda = device == "cuda"
    return config_from_dict(
        {
            "run": {"device": device},
            "model": {
                "name_or_path": str(model_dir),
                "dtype": "bfloat16" if cuda else "float32",
                "gradient_checkpointing": True,
                "quantization": variant.quantization,
            },
            "data": {"path": "unused.jsonl"},
            "rewards": {"functions": ["length"]},
            "lora": {"enabled": True, "r": 16, "alpha": 32},
            "rollout": {"num_generations": generations, "prompts_per_batch": groups,
                        "max_new_tokens": completion},
            "loss": {"beta": 0.04, "mu": 2},
            "train": {"micro_batch_tokens": budget},
            "offload": {"activations": "hidden_states" if cuda else "none"},
        }
    )  # fmt: skip


def samples_for(case: str, vocab: int):
    from support.memory_probe import group

    groups, generations, prompt, completion, _ = SHAPES[case]
    return [
        dataclasses.replace(sample, group_id=g)
        for g in range(groups)
        for sample in group(vocab, generations, prompt, completion, seed=g)
    ]


# -- one variant, in this process ------------------------------------------------------------


def vm_hwm_bytes() -> int | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def reset_vm_hwm() -> bool:
    """Linux: writing 5 to clear_refs resets the peak RSS to the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def held_bytes(model) -> int:
    """Distinct storages of the parameters, buffers and bitsandbytes' quantization state."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            tensors += [state.absmax, state.code]
            if state.nested:
                tensors += [state.offset, state.state2.absmax, state.state2.code]
    alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(alive.values())


def run_variant(model_dir: Path, case: str, variant: Variant, device: torch.device) -> dict:
    """Load, then one timed GRPO step (and on CPU a second one under LiveBytes)."""
    from support.memory_probe import LiveBytes

    from leangrpo.model.policy import load_policy
    from leangrpo.train.passes import attach_old_and_ref
    from leangrpo.train.planning import plan_steps
    from leangrpo.train.step import train_step

    cuda = device.type == "cuda"
    cfg = step_config(model_dir, case, variant, device.type)
    start = time.perf_counter()
    torch.manual_seed(0)
    policy = load_policy(cfg, None, device)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-5)
    out = {"load_s": round(time.perf_counter() - start, 2), "weights_bytes": held_bytes(policy.model),
           "rss_loaded_bytes": rss_bytes(), "load_hwm_bytes": vm_hwm_bytes()}  # fmt: skip
    samples = samples_for(case, policy.model.get_input_embeddings().num_embeddings)
    sampling = cfg.rollout.sampling_params()

    def step():
        steps = plan_steps(samples, cfg, policy)
        attach_old_and_ref(policy, steps, cfg.loss, cfg.logprobs, sampling)
        return train_step(policy, steps[0].micro_batches, optimizer, cfg, sampling), steps

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    hwm = reset_vm_hwm()
    wall, cpu = time.perf_counter(), time.process_time()
    result, steps = step()
    if cuda:
        torch.cuda.synchronize()
    out.update(time_s=round(time.perf_counter() - wall, 3), cpu_s=round(time.process_time() - cpu, 3))
    out["peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else (vm_hwm_bytes() if hwm else None)
    out.update(tokens=sum(mb.num_tokens for mb in steps[0].micro_batches),
               micro_batches=len(steps[0].micro_batches), loss=result.metrics.get("loss"),
               updated=result.updated)  # fmt: skip
    if not cuda:
        out["live_peak_bytes"] = LiveBytes().peak_of(step)
    return out


# -- rows --------------------------------------------------------------------------------------


def case_rows(device: torch.device, quick: bool = False, dry: bool = False):
    """Baseline first, per shape; CPU (not dry): each variant in a child process."""
    with tempfile.TemporaryDirectory(prefix="leangrpo-qlora-") as tmp:
        if device.type == "cuda" or dry:
            name = "tiny-qwen2" if dry else "qwen2.5-1.5b"
            model_dir, cases = save_random_model(name, Path(tmp)), [c for c in SHAPES if c.startswith(name)]
        else:
            from leangrpo.model.smollm2 import missing_reason, smollm2_dir

            if missing_reason() is not None:
                yield {"bench": BENCH, "case": "smollm2", "device": "cpu", "error": missing_reason()}
                return
            model_dir, cases = smollm2_dir(), [c for c in SHAPES if c.startswith("smollm2")]
            cases = cases[:1] if quick else cases
        for case in cases:
            base = None
            for variant in variants(device.type):
                row = {"bench": BENCH, "case": case, "variant": variant.name,
                       "baseline": variants(device.type)[0].name, "device": device_name(device)}  # fmt: skip
                in_child = device.type == "cpu" and not dry
                try:
                    row.update(child(model_dir, case, variant) if in_child else
                               run_variant(model_dir, case, variant, device))  # fmt: skip
                except Exception as err:  # one variant's failure is a row
                    row.update(time_s=None, peak_bytes=None, error=f"{type(err).__name__}: {err}"[:300])
                if base is None:
                    base = row
                else:
                    add_ratios(row, base)
                if variant.quantization == "nf4" and device.type == "cuda" and row.get("peak_bytes"):
                    row["goal"] = f"nf4 step peak < {PEAK_GOAL_GB:g} GB"
                    row["goal_met"] = row["peak_bytes"] < PEAK_GOAL_GB * GB
                yield row
                if device.type == "cuda":
                    import gc

                    gc.collect()
                    torch.cuda.empty_cache()


def add_ratios(row: dict, base: dict) -> None:
    for key, ratio in [("peak_bytes", "mem_ratio"), ("time_s", "time_ratio"), ("cpu_s", "cpu_ratio"),
                       ("live_peak_bytes", "live_ratio"), ("weights_bytes", "weights_ratio")]:  # fmt: skip
        if row.get(key) and base.get(key):
            row[ratio] = round(row[key] / base[key], 4)


def device_name(device: torch.device) -> str:
    from device_info import device_name as name

    return name(device.type, threads=None if device.type == "cuda" else 1)


def save_random_model(name: str, tmp: Path) -> Path:
    """benchmarks/models.py's random-weight model of `name`, saved (bf16 on CUDA, fp32 else)."""
    from models import build_model

    cuda = torch.cuda.is_available() and not name.startswith("tiny")
    longest = max(p + c for n, (_, _, p, c, _) in SHAPES.items() if n.startswith(name))
    model = build_model(name, longest, "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    path = tmp / name
    model.save_pretrained(path)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return path


def child(model_dir: Path, case: str, variant: Variant) -> dict:
    """run_variant in a fresh interpreter (its own RSS), one JSON line back."""
    cmd = [sys.executable, __file__, "--child", str(model_dir), case, variant.name, variant.quantization]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the example's step shape only (CPU)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_dir, case, name, quant = args.child
        torch.set_num_threads(1)
        row = run_variant(Path(model_dir), case, Variant(name, quant), torch.device("cpu"))
        print(json.dumps(row), flush=True)
        return
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)
    for row in case_rows(device, quick=args.quick):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
