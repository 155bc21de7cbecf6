"""One full GRPO optimizer step, memory per term next to `leangrpo plan`.

    python benchmarks/grpo_step.py [--model qwen2.5-1.5b|llama-3.1-8b] [--quick]

The real code path, built from leangrpo's public pieces: a random-weight model of a known
shape (benchmarks/models.py) wrapped by `model.build_policy` from a validated `Config`
(LoRA r 16 on all linear layers, beta 0.04 so the reference pass runs with the adapters
off, mu 2 so the old-log-prob pass runs), one prompt group of synthetic `RolloutSample`s,
then `planning.plan_steps` -> `passes.attach_old_and_ref` (the "score" phase: old and reference
passes) -> `step.train_step` (forward, backward and AdamW over every micro-batch).

Variants: `all_off` (baseline: no checkpointing, no offload, full (T, V) logits) and
`all_on` (checkpointing + hidden-state offload + chunked log-probs). Only the memory
features differ; packing, LoRA and the attention kernel are the same.

Memory (CUDA): peak allocated bytes of each phase, and per term:
  weights      allocated after the policy is built (base weights, LoRA, buffers)
  gradients    bytes of the trainable parameters' gradients (what backward allocates)
  adamw_state  bytes of the optimizer state after the step
  lm_head      peak extra of the log-prob head alone (fwd + bwd with entropy) on the
               largest micro-batch's completion rows, measured separately
  activations  train-phase peak - weights - gradients - lm_head (derived), without
               checkpointing only: there the peak is when the head runs, every activation
               saved, which is `leangrpo plan`'s term; with checkpointing the most the
               activations hold is a layer's backward, where the head is not held, so the
               derivation does not measure it (benchmarks/context_parallel.py does, op by op)
next to `planner.plan.plan_memory` for the same config and tokens (`planned`, `ratio`).
On CPU the step runs with the same code and the memory figures are None.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import build_model, planner_dims  # noqa: E402

from leangrpo.config import Config, config_from_dict  # noqa: E402
from leangrpo.contracts import Completion, Prompt, RolloutSample  # noqa: E402
from leangrpo.model.policy import build_policy  # noqa: E402
from leangrpo.ops.logprobs.api import token_logprobs  # noqa: E402
from leangrpo.planner.plan import TRAINING_PASS, plan_memory  # noqa: E402
from leangrpo.train.passes import attach_old_and_ref  # noqa: E402
from leangrpo.train.planning import plan_steps  # noqa: E402
from leangrpo.train.step import train_step  # noqa: E402

BENCH = "grpo_step"
BASELINE = "all_off"
VARIANTS = ("all_off", "all_on")
TERMS = ("weights", "gradients", "adamw_state", "activations", "lm_head")
# generations x (prompt + completion) tokens, and the micro-batch the step is cut into
SHAPES = {
    "qwen2.5-1.5b": dict(generations=8, prompt=512, completion=3584, micro_batch_tokens=8192),
    "llama-3.1-8b": dict(generations=8, prompt=1024, completion=19456, micro_batch_tokens=20480),
    "tiny-qwen2": dict(generations=4, prompt=16, completion=48, micro_batch_tokens=128),
    "tiny-llama": dict(generations=4, prompt=24, completion=40, micro_batch_tokens=128),
}


def step_config(model: str, variant: str, device: str, shape: dict | None = None) -> Config:
    """The validated config of one variant (features on or off), as a user would write it.

    Tiny (dry-run) shapes offload every layer input, however small, so the copies run.
    """
    shape, on = shape or SHAPES[model], variant == "all_on"
    offload = {"activations": "hidden_states" if on else "none"}
    if model.startswith("tiny"):
        offload["min_tensor_bytes"] = 0
    return config_from_dict(
        {
            "run": {"device": device},
            "model": {
                "name_or_path": f"random:{model}",  # never loaded: build_policy gets the model
                "dtype": "bfloat16" if device == "cuda" else "float32",
                "gradient_checkpointing": on,
            },
            "data": {"path": "unused.jsonl"},
            "rewards": {"functions": ["length"]},
            "lora": {"enabled": True, "r": 16, "alpha": 32},
            "rollout": {
                "num_generations": shape["generations"],
                "prompts_per_batch": shape.get("prompts", 1),
                "max_new_tokens": shape["completion"],
            },
            "loss": {"beta": 0.04, "mu": 2},
            "train": {"micro_batch_tokens": shape["micro_batch_tokens"]},
            "logprobs": {"chunked": on},
            "offload": offload,
        }
    )


def synthetic_group(model: str, vocab: int, seed: int = 0) -> list[RolloutSample]:
    """One prompt and its G completions of exactly the shape's lengths, random tokens."""
    shape, rng = SHAPES[model], random.Random(seed)
    prompt = Prompt(0, "", [rng.randrange(vocab) for _ in range(shape["prompt"])])
    samples = []
    for i in range(shape["generations"]):
        n = shape["completion"]
        ids = [rng.randrange(vocab) for _ in range(n)]
        behaviour = [-rng.uniform(0.5, 12.0) for _ in range(n)]  # random-weight scale log-probs
        comp = Completion(ids, "", behaviour, "stop", 0)
        samples.append(RolloutSample(0, prompt, comp, reward=float(i % 2), advantage=i % 2 - 0.5))
    return samples


class Meter:
    """Peak allocated bytes of a phase on CUDA; None elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(self, out: dict, name: str):
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            out[f"{name}_s"] = round(time.perf_counter() - start, 4)
            out[f"{name}_peak_bytes"] = torch.cuda.max_memory_allocated() if self.cuda else None

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated() if self.cuda else None


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_variant(model_name: str, variant: str, device: torch.device) -> dict:
    """Build, score and train once; the figures of one row (raises on OOM)."""
    meter, out = Meter(device), {}
    cfg = step_config(model_name, variant, device.type)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[model_name]
    with meter.phase(out, "build"):
        model = build_model(model_name, shape["prompt"] + shape["completion"], device, dtype)
        policy = build_policy(model, cfg, None, device)
        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-6)
    weights = meter.allocated()
    if weights is None:  # CPU: count the tensors instead
        weights = tensor_bytes([*policy.model.parameters(), *policy.model.buffers()])
    out["attention_backend"] = policy.attention_backend
    samples = synthetic_group(model_name, model.config.vocab_size)
    sampling = cfg.rollout.sampling_params()
    steps = plan_steps(samples, cfg, policy)
    micro_batches = steps[0].micro_batches
    with meter.phase(out, "score"):
        attach_old_and_ref(policy, steps, cfg.loss, cfg.logprobs, sampling)
    with meter.phase(out, "train"):
        result = train_step(policy, micro_batches, optimizer, cfg, sampling)
    grads = tensor_bytes(policy.trainable_parameters())  # grads take their parameters' shape
    state = tensor_bytes(
        t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    )
    rows = max(mb.num_completion_tokens for mb in micro_batches)
    out.update(
        tokens=sum(s.num_tokens for s in samples),
        micro_batches=len(micro_batches),
        loss=result.metrics.get("loss"),
        updated=result.updated,
        offload_bytes=result.metrics.get("offload/bytes"),
        measured={"weights": weights, "gradients": grads, "adamw_state": state},
    )
    del policy, model, optimizer, steps, micro_batches
    free_memory(device)
    out["measured"]["lm_head"] = lm_head_peak(model_name, cfg, rows, device, dtype)
    return out


def lm_head_peak(model_name: str, cfg: Config, rows: int, device, dtype) -> int | None:
    """Peak extra bytes of the head alone: (rows, H) hidden through the (V, H) frozen head."""
    if device.type != "cuda":
        return None
    dims = planner_dims(model_name)
    hidden = torch.randn(rows, dims.hidden, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(dims.vocab, dims.hidden, device=device, dtype=dtype) * dims.hidden**-0.5
    targets = torch.randint(0, dims.vocab, (rows,), device=device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lp, ent = token_logprobs(
        hidden, weight, targets, chunked=cfg.logprobs.chunked, with_entropy=True
    )
    (lp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del hidden, weight, targets, lp, ent
    free_memory(device)
    return peak


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def plan_for(model_name: str, cfg: Config) -> dict[str, int]:
    """`leangrpo plan` for this case: its micro-batch, its prompt length, its model's shape."""
    return plan_memory(
        cfg,
        tokens=cfg.train.micro_batch_tokens,
        dims=planner_dims(model_name),
        prompt_tokens=SHAPES[model_name]["prompt"],
    )


def planned_total(plan: dict[str, int]) -> int:
    """The plan's peak over these terms: weights and optimizer state, and the training
    pass at its peak (its gradients, activations and head are not all held at once)."""
    return plan["weights"] + plan["adamw_state"] + plan[TRAINING_PASS]


def add_plan(row: dict, model_name: str, cfg: Config) -> None:
    """`leangrpo plan`'s figure for every term, and measured / planned where both exist."""
    plan = plan_for(model_name, cfg)
    measured = row["measured"]
    peak = row.get("train_peak_bytes")
    derivable = not cfg.model.gradient_checkpointing  # see the module docstring
    if peak is not None and measured.get("lm_head") is not None and derivable:
        measured["activations"] = (
            peak - measured["weights"] - measured["gradients"] - measured["lm_head"]
        )
    row["planned"] = {t: plan[t] for t in TERMS}
    row["planned_total"] = planned_total(plan)
    row["plan_ratio"] = {
        t: round(measured[t] / plan[t], 3) for t in TERMS if measured.get(t) and plan[t]
    }


def case_rows(model_name: str, device: torch.device, variants=VARIANTS):
    """One row per variant, baseline first; an out-of-memory variant is a row, not a crash."""
    base = None
    for variant in variants:
        cfg = step_config(model_name, variant, device.type)
        shape = SHAPES[model_name]
        row = {
            "bench": BENCH,
            "case": f"{model_name}/{shape['generations']}x{shape['prompt'] + shape['completion']}",
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "variant": variant,
            "baseline": BASELINE,
            "micro_batch_tokens": shape["micro_batch_tokens"],
        }
        try:
            row.update(run_variant(model_name, variant, device))
        except torch.cuda.OutOfMemoryError:
            row.update(time_s=None, peak_bytes=None, oom=True)
        except Exception as err:  # one variant's failure is a row; the next still runs
            traceback.print_exc()
            row.update(time_s=None, peak_bytes=None, error=f"{type(err).__name__}: {err}"[:300])
        free_memory(device)
        if row.get("oom"):
            planned = plan_for(model_name, cfg)
            row["planned_total"] = planned_total(planned)
        elif "error" not in row:
            _summarise(row, base, model_name, cfg)
        if variant == BASELINE:
            base = row
        yield row


def _summarise(row: dict, base: dict | None, model_name: str, cfg: Config) -> None:
    """Step time and peak, the plan next to the measured terms, ratios to the baseline."""
    row["time_s"] = round(row["score_s"] + row["train_s"], 4)
    peaks = [row["score_peak_bytes"], row["train_peak_bytes"]]
    row["peak_bytes"] = None if None in peaks else max(peaks)
    if row["peak_bytes"] is not None:
        row["peak_above_weights_bytes"] = row["peak_bytes"] - row["measured"]["weights"]
    add_plan(row, model_name, cfg)
    if base is None or not base.get("time_s"):  # no baseline row, or it ran out of memory
        return
    row["loss_diff_vs_baseline"] = abs(row["loss"] - base["loss"])
    row["time_ratio"] = round(row["time_s"] / base["time_s"], 4)
    if row["peak_bytes"] and base["peak_bytes"]:
        row["mem_ratio"] = round(row["peak_bytes"] / base["peak_bytes"], 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=f"one of {sorted(SHAPES)}")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU, seconds)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    default = "tiny-qwen2" if args.quick or device.type == "cpu" else "qwen2.5-1.5b"
    for row in case_rows(args.model or default, device):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
