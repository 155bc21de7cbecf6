"""hf-engine generation and the GRPO step after it, fed into the async-overlap simulation.

    python benchmarks/hf_generation.py [--model qwen2.5-1.5b] [--quick]

The policy is built as in grpo_step.py (random weights, LoRA, memory features on). Then:
- `generate`: P prompts x G completions through `leangrpo.rollout.hf.engine.HFEngine` with the
  trainer's own weights (the sync path of `rollout.engine: hf`), temperature 1, seeded;
  one timed call after a short warm-up call; completion tokens per second.
- `weight_sync`: `update_weights` of the LoRA tensors into an engine holding its own copy
  (the async path of the hf engine).
- `train_step`: one GRPO step (old + reference passes, train) on the generated samples.
- `async_sim_sync` / `async_sim_async`: async_overlap.simulate (the real producers of
  leangrpo.pipeline with sleeping engine and trainer) fed with the three measured times,
  scaled so that the longer of generation and training lasts SIM_SLOT_S; the per-step
  times are scaled back to seconds. time_ratio = async / sync.
A random-weight model almost never samples its EOS id, so completions run to the limit.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from async_overlap import simulate  # noqa: E402
from grpo_step import Meter, free_memory, step_config  # noqa: E402
from models import build_model  # noqa: E402

from leangrpo.contracts import Prompt, RolloutSample  # noqa: E402
from leangrpo.model.policy import build_policy  # noqa: E402
from leangrpo.rollout.hf.engine import HFEngine  # noqa: E402
from leangrpo.train.passes import attach_old_and_ref  # noqa: E402
from leangrpo.train.planning import plan_steps  # noqa: E402
from leangrpo.train.step import train_step  # noqa: E402

BENCH = "hf_generation"
SIM_SLOT_S = 0.15  # simulated seconds of the longer phase
SIM_STEPS = 8
SHAPES = {  # prompts x generations, prompt tokens, new tokens
    "qwen2.5-1.5b": dict(prompts=8, generations=8, prompt=128, completion=256),
    "tiny-qwen2": dict(prompts=2, generations=4, prompt=8, completion=16),
}


class IdTokenizer:
    """Just what the hf engine asks of a tokenizer: ids decode to numbers, one EOS/pad id."""

    def __init__(self, eos_id: int):
        self.eos_token_id = self.pad_token_id = eos_id

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))

    def batch_decode(self, rows, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in rows]


def prompts_for(shape: dict, vocab: int, seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)
    return [
        Prompt(i, "", [rng.randrange(vocab) for _ in range(shape["prompt"])])
        for i in range(shape["prompts"])
    ]


def case_rows(model_name: str, device: torch.device):
    shape = dict(SHAPES[model_name])
    grpo_shape = dict(
        generations=shape["generations"],
        prompt=shape["prompt"],
        completion=shape["completion"],
        micro_batch_tokens=8192 if device.type == "cuda" else 64,
    )
    cfg = step_config(
        model_name, "all_on", device.type, {**grpo_shape, "prompts": shape["prompts"]}
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meter = Meter(device)
    model = build_model(model_name, shape["prompt"] + shape["completion"], device, dtype)
    vocab = model.config.vocab_size
    policy = build_policy(model, cfg, IdTokenizer(vocab - 1), device)
    engine = HFEngine(policy.model, policy.tokenizer, share_weights=True)
    params = cfg.rollout.sampling_params(seed=0)
    prompts = prompts_for(shape, vocab)
    info = {"bench": BENCH, "case": f"{model_name}/{shape['prompts']}x{shape['generations']}"}
    info["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    info["new_tokens"] = shape["completion"]
    engine.generate(prompts[:1], replace(params, max_new_tokens=4), shape["generations"], 0)
    gen = {}
    with meter.phase(gen, "generate"):
        groups = engine.generate(prompts, params, shape["generations"], 0)
    tokens = sum(len(c.ids) for g in groups for c in g)
    gen_s = gen["generate_s"]
    yield {
        **info,
        "variant": "generate",
        "time_s": gen_s,
        "peak_bytes": gen["generate_peak_bytes"],
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / gen_s, 1),
    }
    sync_s = weight_sync_seconds(policy, meter)
    yield {**info, "variant": "weight_sync", "time_s": sync_s, "peak_bytes": None}
    samples = [
        RolloutSample(p.uid, p, c, reward=float(j % 2), advantage=j % 2 - 0.5)
        for p, group in zip(prompts, groups)
        for j, c in enumerate(group)
    ]
    train_s, peak = train_seconds(policy, samples, cfg, meter)
    tokens = sum(s.num_tokens for s in samples)
    yield {
        **info,
        "variant": "train_step",
        "time_s": train_s,
        "peak_bytes": peak,
        "tokens": tokens,
        "tokens_per_s": round(tokens / train_s, 1),
    }
    del policy, model, engine
    free_memory(device)
    yield from sim_rows(info, gen_s, train_s, sync_s)


def train_seconds(policy, samples, cfg, meter: Meter) -> tuple[float, int | None]:
    """One GRPO step on the generated samples: plan, old + reference passes, train."""
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-6)
    sampling, out = cfg.rollout.sampling_params(), {}
    with meter.phase(out, "step"):
        steps = plan_steps(samples, cfg, policy)
        attach_old_and_ref(policy, steps, cfg.loss, cfg.logprobs, sampling)
        train_step(policy, steps[0].micro_batches, optimizer, cfg, sampling)
    return out["step_s"], out["step_peak_bytes"]


def weight_sync_seconds(policy, meter: Meter) -> float:
    """update_weights of the trainable tensors into an engine with its own copy (async hf)."""
    own = HFEngine(policy.model, policy.tokenizer, share_weights=False)
    out = {}
    with meter.phase(out, "sync"):
        own.update_weights(policy.named_trainable_tensors(), 1)
    own.close()
    del own
    return out["sync_s"]


def sim_rows(info: dict, gen_s: float, train_s: float, sync_s: float):
    """The pipeline simulation at the measured gen : train : sync proportions."""
    scale = SIM_SLOT_S / max(gen_s, train_s)
    base = None
    for mode in ("sync", "async"):
        staleness = 0 if mode == "sync" else 1
        r = simulate(mode, gen_s * scale, train_s * scale, sync_s * scale, SIM_STEPS, staleness)
        row = {
            **info,
            "variant": f"async_sim_{mode}",
            "time_s": round(r["wall_s"] / SIM_STEPS / scale, 4),
            "peak_bytes": None,
            "gen_s": gen_s,
            "train_s": train_s,
            "sync_s": sync_s,
            "ideal_async_step_s": round(max(gen_s, train_s) + sync_s, 4),
            "staleness_hist": r["staleness_hist"],
        }
        if base is not None:
            row["time_ratio"] = round(row["time_s"] / base["time_s"], 4)
            row["vs_ideal"] = round(row["time_s"] / row["ideal_async_step_s"], 4)
        base = base or row
        yield row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=f"one of {sorted(SHAPES)}")
    parser.add_argument("--quick", action="store_true", help="tiny shape (CPU, seconds)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    default = "tiny-qwen2" if args.quick or device.type == "cpu" else "qwen2.5-1.5b"
    start = time.perf_counter()
    for row in case_rows(args.model or default, device):
        print(json.dumps(row), flush=True)
    print(f"# {time.perf_counter() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
