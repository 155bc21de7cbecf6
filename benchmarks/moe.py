"""Mixtures of experts: a GRPO step on an MoE against a dense model of the same active size,
and what routing replay costs and changes.

    python benchmarks/moe.py [--quick] [--device cpu|cuda] [--repeats N]

Each variant runs the trainer's own step (`planning.plan_steps` -> `passes.attach_old_and_ref`
(the old-log-prob pass: mu 2) -> `step.train_step`: forward, backward, AdamW) on samples an
hf engine generated from a bfloat16 copy of the policy (the trainer in float32): the
mismatch RL runs see between a low-precision generator and the trainer, here made on
purpose. Variants:

- `dense` (the baseline): a Qwen3 whose MLP is as wide as the MoE's k active experts
  (the same active size per token);
- `moe/replay=false`: the MoE routing as its forward decides;
- `moe/replay=true`: the MoE replaying the engine's routes (rollout.routing_replay).

Rows (one per variant, DESIGN.md's fields): `time_s` (median seconds of a step over the
repeats; the variants are timed in turn, repeat by repeat), `cpu_s` (its CPU seconds),
`peak_bytes` (what a step allocates at its peak beyond what was resident before it: CUDA's
allocator, or on CPU the tensor bytes alive, tests/support/memory_probe.LiveBytes),
`resident_bytes` (weights, gradients and AdamW state between steps: every expert's), and
`time_ratio` / `mem_ratio` / `resident_ratio` against `dense`; on the MoE rows `replay`, `routing_flips` (the share of completion tokens whose
experts in the training forward differ from the engine's in some layer: 0 with replay by
construction), `would_flip` (moe/routing_flips: tokens whose routing would have differed
without replay), `is_log_ratio_std` and `is_ratio_max` (the old-policy pass against the
engine's log-probs: the IS ratio's spread); on the replay row `replay_overhead` (its time /
the replay=false row's: wall seconds on CUDA, CPU seconds (`cpu_s`, one thread) on CPU,
the figure to trust on a shared machine; goal <= 1.05).

CPU: small-moe (Qwen3-MoE layout, hidden 256, 16 experts, top-2, ~7M parameters) vs
small-dense-active, one thread; `--quick` (CI, the GPU suite's dry run): tiny-moe (8
experts, top-2) vs tiny-dense-active, fewer samples and repeats. CUDA: qwen3-moe-1b (64 experts, top-8, ~1.1B
parameters) vs qwen3-dense-active-1b (benchmarks/models.py), random weights. The GPU suite
runs the same rows (case `moe`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from leangrpo.config import Config, config_from_dict  # noqa: E402

BENCH = "moe"
OVERHEAD_GOAL = 1.05
# device -> (MoE, dense of its active size, prompts, completions per prompt, prompt tokens,
# new tokens)
SHAPES = {
    "cpu": ("small-moe", "small-dense-active", 8, 4, 64, 64),
    "cpu-quick": ("tiny-moe", "tiny-dense-active", 4, 4, 16, 16),
    "cuda": ("qwen3-moe-1b", "qwen3-dense-active-1b", 8, 8, 128, 128),
}


def step_config(device: str, replay: bool, shape: tuple) -> Config:
    _, _, prompts, generations, prompt_tokens, new = shape
    return config_from_dict(
        {
            "run": {"device": device},
            "model": {"name_or_path": "random", "dtype": "float32",
                      "gradient_checkpointing": device == "cuda"},
            "data": {"path": "unused.jsonl"},
            "rewards": {"functions": ["length"]},
            "rollout": {"num_generations": generations, "prompts_per_batch": prompts,
                        "max_new_tokens": new, "routing_replay": replay},
            "loss": {"mu": 2},
            "train": {"micro_batch_tokens": 4 * generations * (prompt_tokens + new)},
            "packing": {"shared_prefix": "off"},
        }
    )  # fmt: skip


def generated(policy, cfg: Config, shape: tuple, device: torch.device) -> list:
    """Samples of a bfloat16 copy of the policy (route records included when it records)."""
    from leangrpo.contracts import Prompt, RolloutSample, SamplingParams
    from leangrpo.rollout.hf.engine import HFEngine

    _, _, prompts, generations, prompt_tokens, new = shape
    engine = HFEngine(policy.model, None, share_weights=False, device=device)
    engine.model.to(torch.bfloat16)
    vocab = policy.model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    asked = [Prompt(i, "", torch.randint(3, vocab, (prompt_tokens,), generator=g).tolist())
             for i in range(prompts)]  # fmt: skip
    engine.tokenizer = _NoTokenizer()
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=1)
    groups = engine.generate(asked, params, generations, 0)
    engine.close()
    return [
        RolloutSample(gi, p, c, reward=float(k % 2), advantage=float(k % 2) - 0.5)
        for gi, (p, cs) in enumerate(zip(asked, groups))
        for k, c in enumerate(cs)
    ]


class _NoTokenizer:
    """The engine decodes texts for rewards and stop strings; a benchmark needs neither."""

    eos_token_id = None
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""

    def batch_decode(self, rows, skip_special_tokens=True) -> list[str]:
        return [""] * len(rows)


def applied_flips(policy, samples, records) -> float:
    """Share of completion tokens whose experts, as the MoE blocks of a forward on the
    `samples` (packed in one row) received them, differ from the engine's `records` (the
    same samples with theirs) in some layer."""
    from support.moe import as_sets, experts_received, used_routes

    from leangrpo.contracts import SamplingParams
    from leangrpo.model.scoring import score
    from leangrpo.train.packing import pack_samples

    mb = pack_samples(samples, device=next(policy.model.parameters()).device)
    recorded = pack_samples(records).routes
    with torch.no_grad(), experts_received(policy.model) as calls:
        score(policy.model, mb, SamplingParams(), _Tiles())
    used = used_routes(calls)[mb.completion_index].cpu()
    return float((used != as_sets(recorded)).flatten(1).any(1).float().mean())


class _Tiles:
    chunked, row_tile, vocab_tile, compile = True, None, None, False


def policy_and_samples(model_name: str, replay: bool, shape, device):
    """The policy (routing replay installed when `replay`) and the samples a bf16 copy of it
    generated, with their route records (an MoE's) and without."""
    import models

    from leangrpo.model.policy import build_policy

    moe = model_name == shape[0]
    cfg = step_config(device.type, replay, shape)
    recording = step_config(device.type, moe, shape)  # an MoE's engine records routes
    base = models.build_model(model_name, 4096, device, torch.float32)
    engine_policy = build_policy(base, recording, None, device)
    samples = generated(engine_policy, recording, shape, device)
    policy = engine_policy if replay or not moe else None
    if policy is None:  # the same weights, without routing replay
        del engine_policy
        policy = build_policy(
            models.build_model(model_name, 4096, device, torch.float32), cfg, None, device
        )
    stripped = samples if replay else [_without_routes(s) for s in samples]
    return cfg, policy, samples, stripped


class Variant:
    """One variant's policy, samples and step (built at once; timed interleaved)."""

    def __init__(self, name: str, model_name: str, replay: bool, shape, device):
        from leangrpo.train.passes import attach_old_and_ref
        from leangrpo.train.planning import plan_steps
        from leangrpo.train.step import train_step

        self.name, self.moe, self.replay, self.device = name, model_name == shape[0], replay, device
        cfg, self.policy, self.records, self.samples = policy_and_samples(
            model_name, replay, shape, device
        )
        self.optimizer = optimizer = torch.optim.AdamW(self.policy.trainable_parameters(), lr=1e-5)
        sampling = cfg.rollout.sampling_params()
        self.times: list[float] = []
        self.cpu: list[float] = []

        def step():
            steps = plan_steps(self.samples, cfg, self.policy)
            attach_old_and_ref(self.policy, steps, cfg.loss, cfg.logprobs, sampling)
            self.steps = steps
            self.result = train_step(self.policy, steps[0].micro_batches, optimizer, cfg, sampling)

        self.step = step
        step()  # warm-up (kernels, caches, the optimizer's state)

    def timed(self) -> None:
        _sync(self.device)
        start, start_cpu = time.perf_counter(), time.process_time()
        self.step()
        _sync(self.device)
        self.times.append(time.perf_counter() - start)
        self.cpu.append(time.process_time() - start_cpu)

    def peak(self) -> int:
        """Bytes a step allocates at its peak beyond what was resident before it."""
        from support.memory_probe import LiveBytes

        if self.device.type != "cuda":
            return LiveBytes().peak_of(self.step)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self.step()
        return torch.cuda.max_memory_allocated() - before

    def resident(self) -> int:
        """Weights, gradients and AdamW state held between steps."""
        tensors = [*self.policy.model.parameters()]
        tensors += [p.grad for p in tensors if p.grad is not None]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(held.values())

    def row(self, shape) -> dict:
        mbs = self.steps[0].micro_batches
        row = {"bench": BENCH, "case": f"{shape[0]}/{shape[2]}x({shape[4]}+{shape[3]}x{shape[5]})",
               "device": self.device.type, "variant": self.name,
               "time_s": round(statistics.median(self.times), 4),
               "cpu_s": round(statistics.median(self.cpu), 4), "peak_bytes": int(self.peak()),
               "resident_bytes": self.resident(), "tokens": sum(mb.num_tokens for mb in mbs),
               "params": sum(p.numel() for p in self.policy.model.parameters())}  # fmt: skip
        if self.moe:  # flips and the IS ratio's spread (the old-policy pass against the engine)
            log_ratio = torch.cat(
                [(mb.old_logprobs - mb.behaviour_logprobs).float().cpu() for mb in mbs]
            )
            row.update(
                replay=self.replay,
                routing_flips=round(applied_flips(self.policy, self.samples, self.records), 4),
                is_log_ratio_std=round(float(log_ratio.std()), 5),
                is_ratio_max=round(float(log_ratio.exp().max()), 4),
            )
            if self.replay:
                row["would_flip"] = self.result.metrics.get("moe/routing_flips")
        return row


def _without_routes(sample):
    import copy

    out = copy.copy(sample)
    out.completion = copy.copy(sample.completion)
    out.completion.routes = None
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def case_rows(device: torch.device, quick: bool = False, repeats: int | None = None):
    """dense (the baseline), then the MoE without and with replay; ratios against dense,
    replay_overhead against the MoE without replay. The variants' steps are timed in turn,
    repeat by repeat, so a machine's load drifting during the run weighs on all alike."""
    shape = SHAPES["cuda" if device.type == "cuda" else ("cpu-quick" if quick else "cpu")]
    repeats = repeats or (2 if quick or device.type == "cuda" else 5)
    if device.type == "cpu":
        torch.set_num_threads(1)
    variants = [
        Variant("dense", shape[1], False, shape, device),
        Variant("moe/replay=false", shape[0], False, shape, device),
        Variant("moe/replay=true", shape[0], True, shape, device),
    ]
    for _ in range(repeats):
        for variant in variants:
            variant.timed()
    rows = {}
    for variant in variants:
        row = variant.row(shape)
        if variant.name != "dense":
            base = rows["dense"]
            row["time_ratio"] = round(row["time_s"] / base["time_s"], 3)
            row["mem_ratio"] = round(row["peak_bytes"] / base["peak_bytes"], 3)
            row["resident_ratio"] = round(row["resident_bytes"] / base["resident_bytes"], 3)
        if variant.replay:  # CPU: its CPU seconds, the figure to trust on a shared machine
            clock = "time_s" if device.type == "cuda" else "cpu_s"
            overhead = row[clock] / rows["moe/replay=false"][clock]
            row["replay_overhead"] = round(overhead, 3)
            row["goal"] = f"replay_overhead <= {OVERHEAD_GOAL}"
            row["goal_met"] = overhead <= OVERHEAD_GOAL
        rows[variant.name] = row
        yield row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args()
    for row in case_rows(torch.device(args.device), quick=args.quick, repeats=args.repeats):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
