"""Training throughput and per-rank memory at 1 and 2 (or N) torchrun ranks.
python benchmarks/scaling.py [--quick] [--ranks 1,2] [--beta 0.04]

The trainer's own step on every rank: the same global batch of synthetic GRPO samples
(groups of G completions with varied lengths), dealt to ranks by planning.plan_steps, one
optimizer step by step.train_step (FSDP2 full_shard under several ranks: all-reduced
normalisers, padding micro-batches, global gradient norm), AdamW. Random weights of a
benchmarks/models.py shape; generation is left out (it scales with the engine, not the
trainer). The micro-batch budget per rank is fixed, so each rank trains 1/W of the batch.
`--beta` > 0 adds the full fine-tuning reference, built and sharded as the trainer builds
it under torchrun (on the meta device, then given the policy's shards), and its no-grad
pass before each step (not timed).

Per world size one row (baseline = `ranks=1`): `time_s` (median step), `tokens_per_s`
(global tokens / step), `peak_bytes` (largest over ranks: CUDA max allocated, or the
process's peak RSS on CPU, where the runtime dominates), `state_bytes_per_rank` (the
largest rank's parameters + gradients + AdamW state, local shards: what full sharding
divides by W), `peak_param_bytes_per_rank` (the largest rank's tensor storages alive after
each set-up stage, the model built and then sharded: the weights and a reference, whole
or as shards, `fsdp.tensor_bytes_alive`) and `param_copies_per_rank` (that over the
model's parameter bytes: at most 1.0 + the shards, since no rank ever holds a second full
copy), `dist/imbalance` (most / least loaded rank's tokens, mean over steps), and
`time_ratio`, `mem_ratio`, `state_ratio` against the baseline.

CPU (gloo) with `--quick`: tiny-qwen2 shape, 2 cores at most, so no speed-up is expected,
only the memory split. CUDA: qwen2.5-1.5b shape, bf16, one GPU per rank; world sizes
larger than the visible GPUs are reported as skipped. Ranks are processes this script
starts itself (RANK, WORLD_SIZE, MASTER_ADDR/PORT as torchrun sets them).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BENCH = "scaling"
DEMO = ROOT / "examples" / "demo"


def settings(quick: bool, cuda: bool) -> dict:
    if cuda:
        return dict(model="qwen2.5-1.5b", groups=16, group_size=8, prompt=256, completion=768,
                    budget=16384, steps=3)  # fmt: skip
    if quick:
        return dict(model="tiny-qwen2", groups=8, group_size=4, prompt=24, completion=40,
                    budget=512, steps=3)  # fmt: skip
    return dict(model="tiny-llama", groups=16, group_size=8, prompt=64, completion=192,
                budget=2048, steps=5)  # fmt: skip


def config(s: dict, beta: float = 0.0):
    from leangrpo.config import config_from_dict

    return config_from_dict(
        {
            "model": {"name_or_path": str(DEMO / "model")},  # not loaded: random weights
            "data": {"path": str(DEMO / "train.jsonl")},
            "rewards": {"functions": [{"name": "math"}]},
            "rollout": {
                "num_generations": s["group_size"],
                "prompts_per_batch": s["groups"],
                "max_new_tokens": s["completion"],
            },  # fmt: skip
            "train": {"micro_batch_tokens": s["budget"], "learning_rate": 1e-5},
            "packing": {"shared_prefix": "off"},
            "loss": {"type": "dapo", "beta": beta},
        }
    )


def batch(s: dict, vocab: int, step: int) -> list:
    """Groups with varied completion lengths and advantages, the same on every rank."""
    from leangrpo.contracts import Completion, Prompt, RolloutSample

    g = torch.Generator().manual_seed(step)
    samples = []
    for k in range(s["groups"]):
        prompt = torch.randint(3, vocab, (s["prompt"],), generator=g).tolist()
        for j in range(s["group_size"]):
            n = int(torch.randint(s["completion"] // 4, s["completion"] + 1, (1,), generator=g))
            ids = torch.randint(3, vocab, (n,), generator=g).tolist()
            sample = RolloutSample(
                k, Prompt(k, "", prompt), Completion(ids, "", [-2.0] * n, "length", 0)
            )
            sample.reward, sample.advantage = float(j % 2), 1.0 if j % 2 else -1.0
            samples.append(sample)
    return samples


def state_bytes(params: list, optimizer) -> int:
    """This rank's parameters, gradients and optimizer state (local shards)."""
    from torch.distributed.tensor import DTensor

    def local(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = sum(local(p) + (local(p.grad) if p.grad is not None else 0) for p in params)
    for state in optimizer.state.values():
        total += sum(local(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return total


def setup_bytes() -> int:
    """Bytes of every tensor storage alive on this rank, whole or sharded."""
    from leangrpo.distributed.fsdp import tensor_bytes_alive

    gc.collect()
    return sum(tensor_bytes_alive().values())


def run_rank(s: dict, out: Path) -> None:
    """One rank: build, shard (W > 1), train s["steps"] + 1 steps, write its figures."""
    from models import build_model

    from leangrpo.distributed.context import init_distributed
    from leangrpo.model.policy import build_policy
    from leangrpo.train.passes import attach_old_and_ref
    from leangrpo.train.planning import plan_steps
    from leangrpo.train.ranks import ONE_PROCESS
    from leangrpo.train.step import train_step

    cfg = config(s, s["beta"])
    cuda = torch.cuda.is_available()
    ctx = init_distributed(cfg.distributed, "cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    before = setup_bytes()
    model = build_model(s["model"], s["prompt"] + s["completion"], ctx.device, dtype)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    policy = build_policy(model, cfg, None, ctx.device, reference_on_meta=ctx.distributed)
    setup = [setup_bytes() - before]  # the model built (and a reference: on meta if W > 1)
    ranks = ONE_PROCESS
    if ctx.distributed:
        from leangrpo.distributed.fsdp import shard_policy
        from leangrpo.distributed.strategy import TorchrunRanks

        shard_policy(policy, cfg.distributed, ctx)
        ranks = TorchrunRanks(ctx)
        setup.append(setup_bytes() - before)  # the policy and the reference sharded
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    sampling = cfg.rollout.sampling_params()
    times, imbalance, peak_state = [], [], 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(s["steps"] + 1):  # step 0 warms up
        samples = batch(s, model.config.vocab_size, step)
        planned = plan_steps(samples, cfg, policy, ctx.rank, ctx.world_size)[0]
        # the reference's pass, if any
        attach_old_and_ref(policy, [planned], cfg.loss, cfg.logprobs, sampling, ranks)
        ctx.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step(policy, planned.micro_batches, optimizer, cfg, sampling, ranks)
        if cuda:
            torch.cuda.synchronize()
        ctx.barrier()
        if step:
            times.append(time.perf_counter() - start)
            imbalance.append(planned.metrics.get("dist/imbalance", 1.0))
        peak_state = max(peak_state, state_bytes(params, optimizer))
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(
        resource.RUSAGE_SELF
    ).ru_maxrss * 1024  # fmt: skip
    tokens = sum(x.num_tokens for x in batch(s, model.config.vocab_size, 1))
    figures = dict(time_s=statistics.median(times), tokens=tokens, peak_bytes=peak,
                   state_bytes=peak_state, imbalance=statistics.mean(imbalance),
                   setup_bytes=max(setup), model_bytes=model_bytes)  # fmt: skip
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(figures))
    ctx.shutdown()


def launch(world: int, args, out: Path) -> list[dict]:
    """`world` rank processes of this script; their figures (or raises with their logs)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(world), "OMP_NUM_THREADS": str(args.threads)}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-of", str(out), "--beta", str(args.beta),
             *(["--quick"] if args.quick else [])],  # fmt: skip
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed:\n{logs[0][-3000:]}\n{logs[-1][-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def row(world: int, s: dict, device: str, ranks: list[dict], base: dict | None) -> dict:
    time_s = max(r["time_s"] for r in ranks)
    out = {
        "bench": BENCH,
        "case": f"{s['model']}/{s['groups']}x{s['group_size']}"
        + (f"/beta={s['beta']:g}" if s["beta"] else ""),
        "device": device,
        "variant": f"ranks={world}",
        "baseline": "ranks=1",
        "time_s": time_s,
        "peak_bytes": max(r["peak_bytes"] for r in ranks),
        "tokens_per_s": ranks[0]["tokens"] / time_s,
        "state_bytes_per_rank": max(r["state_bytes"] for r in ranks),
        "peak_param_bytes_per_rank": max(r["setup_bytes"] for r in ranks),
        "param_copies_per_rank": max(r["setup_bytes"] for r in ranks) / ranks[0]["model_bytes"],
        "loss/beta": s["beta"],
        "dist/imbalance": ranks[0]["imbalance"],
        "micro_batch_tokens_per_rank": s["budget"],
    }
    if base is not None:
        out["time_ratio"] = out["time_s"] / base["time_s"]
        out["mem_ratio"] = out["peak_bytes"] / base["peak_bytes"]
        out["state_ratio"] = out["state_bytes_per_rank"] / base["state_bytes_per_rank"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU-sized (tiny-qwen2)")
    parser.add_argument("--ranks", default="1,2", help="world sizes to measure, e.g. 1,2,4")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--beta", type=float, default=0.0, help="> 0: with a KL reference")
    parser.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)  # a rank's run
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    s = {**settings(args.quick, cuda), "beta": args.beta}
    if args.rank_of is not None:
        torch.set_num_threads(args.threads)
        run_rank(s, Path(args.rank_of))
        return
    device = torch.cuda.get_device_name() if cuda else "cpu"
    base = None
    for world in (int(w) for w in args.ranks.split(",")):
        if cuda and world > torch.cuda.device_count():
            print(json.dumps({"bench": BENCH, "case": s["model"], "device": device,
                              "variant": f"ranks={world}", "time_s": None, "peak_bytes": None,
                              "skipped": f"needs {world} GPUs"}), flush=True)  # fmt: skip
            continue
        with tempfile.TemporaryDirectory() as tmp:
            result = row(world, s, device, launch(world, args, Path(tmp)), base)
        base = base or result
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
