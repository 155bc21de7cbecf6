"""Multi-turn rollouts and training steps.  python benchmarks/multiturn.py [--quick]

Case `rollout`: the tool demo (examples/tools_demo: its model at T=1, the calculator tool
in an environment worker, at most 3 turns of 64 tokens) through the multi-turn rollout
(environments/driver.py) and the hf engine. Variants: `one_at_a_time` (baseline: every
trajectory's turn forwarded alone, `max_batch_size=1`) and `batched` (a round's turns of
every trajectory in one batched forward). Figures: model tokens generated per second.

Case `train`: one training step (forward, grpo loss, backward) on multi-turn batches shaped
like tool-use trajectories (prompts of 50-200 tokens, 1-4 model turns of lognormal length,
median 48, environment replies of 8-96 tokens between them) through a random Qwen2-shaped
model. Variants: `padded` (baseline: right-padded rows with an attention mask and a
per-token model mask, plain transformers SDPA) and `packed` (leangrpo's layout: one row,
the environment's tokens context only, `score` + `compute_loss`). The two losses are
checked to agree before timing.

Cases `latency_heavy_tail` and `latency_zero`: trajectories of several turns (the tool
demo's model; an environment, benchmarks/latency_env.py, that asks for another turn, each
step taking 10 ms, or a second one time in ten, or nothing), `environment.num_workers`
workers. Variants: `rounds` (baseline: every trajectory's turn, then every step, in
lockstep) and `per_trajectory` (a turn as soon as its trajectory's step returns).
Figures: trajectories per second, the engine's idle wait for environments. Case
`kept_caches` (zero latency, per-trajectory): prefill tokens per turn when every turn
prefills its whole conversation (`no_kept_caches`, baseline) and with each trajectory's
KV cache kept between its turns (`kept_caches`).

One JSON line per case and variant (`bench`, `case`, `device`, `variant`, `time_s`,
`peak_bytes`, `time_ratio` and `mem_ratio` against the baseline of the same run).
peak_bytes: CUDA max_memory_allocated; on CPU the peak of live tensor bytes created during
the measured call (benchmarks/packing.py's LiveBytes).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from device_info import device_name  # noqa: E402
from packing import LiveBytes  # noqa: E402

from leangrpo.config.environment import EnvironmentConfig  # noqa: E402
from leangrpo.config.training import LossConfig  # noqa: E402
from leangrpo.contracts import (  # noqa: E402
    Completion,
    LossInputs,
    LossNormalisers,
    Prompt,
    RolloutSample,
    SamplingParams,
    Trajectory,
)
from leangrpo.environments.driver import MultiTurnRollout, TurnLimits  # noqa: E402
from leangrpo.environments.pool import EnvironmentPool  # noqa: E402
from leangrpo.environments.rendering import Renderer  # noqa: E402
from leangrpo.model.scoring import score  # noqa: E402
from leangrpo.ops.attention.adapter import enable_packed_attention  # noqa: E402
from leangrpo.rollout.hf.engine import HFEngine  # noqa: E402
from leangrpo.train.loss import compute_loss  # noqa: E402
from leangrpo.train.packing import pack_samples  # noqa: E402

TOOLS_DEMO = ROOT / "examples" / "tools_demo"


def peak_of(fn, device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    with LiveBytes() as live:
        fn()
    return live.peak


def timed(fn, device, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def rows_with_ratios(bench_case: str, info: dict, results: dict, baseline: str):
    base_t, base_peak = results[baseline][:2]
    for name, (t, peak, extra) in results.items():
        row = {"bench": "multiturn", "case": bench_case, **info, "variant": name,
               "time_s": round(t, 5), "peak_bytes": peak, **extra}  # fmt: skip
        if name != baseline:
            row.update(time_ratio=round(t / base_t, 4), mem_ratio=round(peak / max(1, base_peak), 4))
        yield row


# -- rollout ------------------------------------------------------------------------------


def rollout_case(prompts_n: int, group: int, repeats: int, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOOLS_DEMO / "model")
    model = AutoModelForCausalLM.from_pretrained(TOOLS_DEMO / "model", dtype=torch.float32)
    model = model.to(device).eval()
    rows = [json.loads(s) for s in (TOOLS_DEMO / "train.jsonl").read_text().splitlines()]
    prompts = [
        Prompt(i, r["prompt"], [0], {"answer": r["answer"]}, [{"role": "user", "content": r["prompt"]}])
        for i, r in enumerate(rows[:prompts_n])
    ]
    env = EnvironmentConfig(tools=[f"{TOOLS_DEMO / 'calculator.py'}:add"], num_workers=2)
    results = {}
    with EnvironmentPool(env) as pool:
        renderer = Renderer(tokenizer, pool.tools)
        for name, per_forward in (("one_at_a_time", 1), ("batched", None)):
            engine = HFEngine(model, tokenizer, max_batch_size=per_forward)
            rollout = MultiTurnRollout(engine, pool, renderer, TurnLimits(3, 192), {tokenizer.eos_token_id})
            tokens = []

            def run(rollout=rollout, tokens=tokens):
                params = SamplingParams(temperature=1.0, max_new_tokens=64, seed=len(tokens))
                groups = rollout.generate(prompts, params, group, 0)
                tokens.append(sum(len(c.logprobs) for g in groups for c in g))

            run()  # warm-up
            t = timed(run, device, repeats)
            peak = peak_of(run, device)
            per_run = tokens[-1]
            extra = {"trajectories": prompts_n * group, "model_tokens": per_run,
                     "tokens_per_s": round(per_run / t, 1)}  # fmt: skip
            results[name] = (t, peak, extra)
    yield from rows_with_ratios("rollout", {"device": device_name(device.type)}, results, "one_at_a_time")


# -- latency: rounds vs per-trajectory scheduling; kept KV caches ------------------------

LATENCY_ENV = Path(__file__).resolve().parent / "latency_env.py"
MIXES = {"heavy_tail": (0.01, 1.0), "zero": (0.0, 0.0)}  # (fast_s, slow_s), 1 step in 10 slow


class NoKeptCaches:
    """An engine whose turn streams keep nothing between turns (every turn prefills its
    whole conversation): the baseline of the kept-cache rows."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def version(self):
        return self.engine.version

    def open_turns(self, params, version):
        stream = self.engine.open_turns(params, version)
        advance = stream.advance

        def advance_and_forget(timeout_s=0.0):
            done = advance(timeout_s)
            for request, _ in done:
                stream.release(request.key)  # its kept cache goes at once
            return done

        stream.advance = advance_and_forget
        return stream


def latency_case(prompts_n: int, group: int, turns: int, workers: int, repeats: int):
    """Trajectories of `turns` turns through the tool demo's model and an environment whose
    steps take a heavy-tailed latency (benchmarks/latency_env.py), rounds (baseline) vs
    per-trajectory; then, at zero latency, prefill tokens per turn without and with kept
    caches."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOOLS_DEMO / "model")
    model = AutoModelForCausalLM.from_pretrained(TOOLS_DEMO / "model", dtype=torch.float32).eval()
    rows = [json.loads(s) for s in (TOOLS_DEMO / "train.jsonl").read_text().splitlines()]
    prompts = [
        Prompt(i, r["prompt"], [0], {}, [{"role": "user", "content": r["prompt"]}])
        for i, r in enumerate(rows[:prompts_n])
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=7)  # a few tokens a turn
    info = {"device": device_name("cpu"), "trajectories": prompts_n * group, "turns": turns,
            "env_workers": workers, "slow_every": 10}  # fmt: skip
    for mix, (fast_s, slow_s) in MIXES.items():
        kwargs = {"turns": turns, "fast_s": fast_s, "slow_s": slow_s}
        env = EnvironmentConfig(name=f"{LATENCY_ENV}:HeavyTail", kwargs=kwargs, num_workers=workers)
        with EnvironmentPool(env) as pool:
            renderer = Renderer(tokenizer, pool.tools)

            def rollout(engine, scheduling, pool=pool, renderer=renderer):
                limits, eos = TurnLimits(turns, 512), {tokenizer.eos_token_id}
                return MultiTurnRollout(engine, pool, renderer, limits, eos, scheduling)

            variants = {s: rollout(HFEngine(model, tokenizer), s) for s in ("rounds", "per_trajectory")}
            if mix == "zero":
                variants["no_kept_caches"] = rollout(NoKeptCaches(HFEngine(model, tokenizer)), "per_trajectory")  # fmt: skip
            results = _timed_rollouts(variants, prompts, params, group, repeats)
            extra = {"mix": mix, "fast_s": fast_s, "slow_s": slow_s, **info}
            schedulers = {k: results[k] for k in ("rounds", "per_trajectory")}
            yield from rows_with_ratios(f"latency_{mix}", extra, schedulers, "rounds")
            if mix == "zero":
                caches = {"no_kept_caches": results["no_kept_caches"], "kept_caches": results["per_trajectory"]}  # fmt: skip
                yield from rows_with_ratios("kept_caches", info, caches, "no_kept_caches")


def _timed_rollouts(variants: dict, prompts, params, group, repeats) -> dict:
    """Each variant's best time over `repeats` calls, the variants taking turns (a shared
    machine's load changes over a run: each variant meets the same), its peak, figures."""
    made: dict[str, list] = {name: [] for name in variants}

    def run(name):
        rollout = variants[name]
        t0 = time.perf_counter()
        groups = rollout.generate(prompts, params, group, 0)
        made[name].append((time.perf_counter() - t0, groups, dict(rollout.last_metrics)))

    for name in variants:
        run(name)  # warm-up
        made[name].clear()
    for _ in range(repeats):
        for name in variants:
            run(name)
    results = {}
    for name, rollout in variants.items():
        t, groups, metrics = min(made[name], key=lambda m: m[0])  # the figures of the best
        peak = peak_of(lambda name=name: run(name), torch.device("cpu"))
        results[name] = (t, peak, _rollout_figures(rollout.scheduling, t, groups, metrics))
    return results


def _rollout_figures(scheduling: str, t: float, groups, metrics: dict) -> dict:
    completions = [c for g in groups for c in g]
    model_turns = sum(len(c.trajectory.turn_versions) for c in completions)
    prefill = metrics.get("multiturn/prefill_tokens", 0.0)
    return {
        "scheduling": scheduling,
        "trajectories_per_s": round(len(completions) / t, 3),
        "model_turns": model_turns,
        "model_tokens": sum(len(c.logprobs) for c in completions),
        "prefill_tokens_per_turn": round(prefill / max(1, model_turns), 2),
        "prefill_tokens_saved_per_turn": round(metrics.get("multiturn/prefill_tokens_saved", 0.0) / max(1, model_turns), 2),
        "env_wait_s": round(metrics.get("multiturn/env_wait_s", 0.0), 4),
        "generation_s": round(metrics.get("multiturn/generation_s", 0.0), 4),
        "in_flight_mean": round(metrics.get("multiturn/in_flight_mean", 0.0), 2),
    }  # fmt: skip


# -- train --------------------------------------------------------------------------------


def trajectory_batch(groups: int, group: int, vocab: int, seed: int = 0) -> list[RolloutSample]:
    rng = random.Random(seed)
    sigma = math.log(4) / 2.33
    samples = []
    for gid in range(groups):
        prompt = Prompt(gid, "", [rng.randrange(vocab) for _ in range(rng.randint(50, 200))])
        for _ in range(group):
            segments = []
            for turn in range(rng.randint(1, 4)):
                if turn:
                    segments.append((rng.randint(8, 96), False))
                segments.append((max(1, min(192, int(rng.lognormvariate(math.log(48), sigma)))), True))
            ids = [rng.randrange(vocab) for _ in range(sum(n for n, _ in segments))]
            model = sum(n for n, m in segments if m)
            logprobs = [-rng.random() * 3 for _ in range(model)]
            trajectory = Trajectory(segments, [0] * sum(m for _, m in segments), [])
            completion = Completion(ids, "", logprobs, "stop", 0, trajectory)
            samples.append(RolloutSample(gid, prompt, completion, advantage=rng.gauss(0, 1)))
    return samples


def padded_loss(model, samples, cfg, device):
    """Right-padded (B, L) rows, an attention mask, full logits at the model positions."""
    width = max(s.num_tokens for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    attention = torch.zeros(len(samples), width, dtype=torch.long)
    rows, cols, targets, seqs = [], [], [], []
    for b, s in enumerate(samples):
        seq = s.prompt.ids + s.completion.ids
        ids[b, : len(seq)], attention[b, : len(seq)] = torch.tensor(seq), 1
        for j in s.completion.trajectory.model_offsets():
            rows.append(b)
            cols.append(len(s.prompt.ids) + j - 1)
            targets.append(seq[len(s.prompt.ids) + j])
            seqs.append(b)
    ids, attention = ids.to(device), attention.to(device)
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits  # (B, L, V)
    picked = logits[torch.tensor(rows), torch.tensor(cols)].float()  # (T, V)
    logp = picked.log_softmax(-1).gather(1, torch.tensor(targets, device=device)[:, None])[:, 0]
    return _loss(logp, samples, torch.tensor(seqs, device=device), cfg, device)


def packed_loss(model, samples, cfg, device, logprobs_cfg):
    batch = pack_samples(samples, device=device)
    logp, _ = score(model, batch, SamplingParams(), logprobs_cfg)
    return _loss(logp, samples, batch.token_seq, cfg, device)


def _loss(logp, samples, token_seq, cfg, device):
    behaviour = torch.tensor([x for s in samples for x in s.completion.logprobs], device=device)
    advantages = torch.tensor([s.advantage for s in samples], device=device)[token_seq]
    tokens = logp.numel()
    norm = LossNormalisers(sequences=len(samples), tokens=tokens, global_tokens=tokens)
    inputs = LossInputs(logp, behaviour, advantages, torch.ones(tokens, device=device), token_seq, len(samples))
    return compute_loss(inputs, norm, cfg).loss


def train_case(groups: int, group: int, quick: bool, repeats: int, device):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from leangrpo.config.training import LogprobsConfig

    shape = (dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2) if quick else
             dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                  num_key_value_heads=4))  # fmt: skip
    config = Qwen2Config(vocab_size=4096, max_position_embeddings=4096, tie_word_embeddings=False, **shape)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).train()
    samples = trajectory_batch(groups, group, 4096)
    cfg = LossConfig(type="grpo", is_correction="bypass")
    logprobs_cfg = LogprobsConfig()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        padded = padded_loss(model, samples, cfg, device).item()
    enable_packed_attention(model, "auto")
    with torch.no_grad():
        packed = packed_loss(model, samples, cfg, device, logprobs_cfg).item()
    agree = abs(packed - padded) <= 1e-3 * max(1.0, abs(padded)) * (1 if dtype == torch.float32 else 50)
    if not agree:
        raise SystemExit(f"packed loss {packed} != padded loss {padded}")

    def step(loss_fn):
        model.zero_grad(set_to_none=True)
        loss_fn().backward()

    variants = {
        "padded": lambda: padded_loss(model, samples, cfg, device),
        "packed": lambda: packed_loss(model, samples, cfg, device, logprobs_cfg),
    }
    results = {}
    for name, loss_fn in variants.items():
        if name == "padded":
            model.set_attn_implementation("sdpa")
        else:
            enable_packed_attention(model, "auto")
        step(loss_fn)  # warm-up
        t = timed(lambda f=loss_fn: step(f), device, repeats)
        peak = peak_of(lambda f=loss_fn: step(f), device)
        results[name] = (t, peak, {})
    width = max(s.num_tokens for s in samples)
    real = sum(s.num_tokens for s in samples)
    model_tokens = sum(len(s.completion.logprobs) for s in samples)
    info = {
        "device": device_name(device.type),
        "sequences": len(samples),
        "tokens": {"padded": len(samples) * width, "packed": real, "model": model_tokens},
        "padding_fraction": round(1 - real / (len(samples) * width), 4),
        "loss_padded": round(padded, 6),
        "loss_packed": round(packed, 6),
    }
    yield from rows_with_ratios("train", info, results, "padded")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a CPU-sized run of a minute or two")
    parser.add_argument("--case", choices=["rollout", "latency", "train", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if ns.case in ("rollout", "all"):
        prompts_n = 8 if ns.quick else 32
        for row in rollout_case(prompts_n, 8, ns.repeats, torch.device("cpu") if ns.quick else device):
            print(json.dumps(row), flush=True)
    if ns.case in ("latency", "all"):
        prompts_n, turns, workers = (8, 12, 16) if ns.quick else (16, 12, 32)
        for row in latency_case(prompts_n, 4, turns, workers, ns.repeats):
            print(json.dumps(row), flush=True)
    if ns.case in ("train", "all"):
        groups = 4 if ns.quick else 16
        for row in train_case(groups, 8, ns.quick, ns.repeats, device):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
