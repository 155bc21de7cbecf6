"""Context parallelism: one training step on one long sequence, per rank, at C = 1, 2, 4.

    python benchmarks/context_parallel.py [--quick] [--model cp-small] [--tokens 8192]
                                          [--sizes 1,2,4]

A random-weight model (benchmarks/models.py), full fine-tuning in the model's dtype, one
sample of `--tokens` tokens (a 256-token prompt and the rest completion), the trainer's own
pieces: `build_policy`, and for C > 1 the torchrun strategy's (`build_mesh`,
`shard_on_mesh`: FSDP2 over the C processes, rows split by Ulysses), then `plan_steps` and
one `train_step` (forward, chunked log-probs, loss, backward, clipping; the optimizer's
update left out: it is the same for every C). Each C runs in processes of its own (C = 1: one
process, no torchrun; C > 1: C ranks, gloo on CPU, NCCL on GPUs), variants one after
another in the same run.

Per variant (the worst rank): `time_s` (the step), `peak_bytes` (the step's peak of tensor
bytes allocated during it and still alive: activations, the head's working set, the
exchange buffers and the gradients; on CPU counted op by op with a dispatch mode, on CUDA
max_memory_allocated above the start), `head_bytes` (the log-prob head's own peak on the
rank's completion rows, measured alone as benchmarks/grpo_step.py does: its tiles do not
grow with the sequence), `activation_bytes` = peak_bytes - the gradients the step leaves -
head_bytes (grpo_step.py's definition), and against C = 1 measured in the same run:
`time_ratio`, `mem_ratio` (activation_bytes; the goal: <= 0.6 at C = 2) and `peak_ratio`.
FSDP runs `no_shard` (parameters replicated), so the weights neither enter the figures nor
differ between variants, and every rank holds whole gradients, as one process does.

`--quick`: 4096 tokens, C = 1 and 2 (about a minute on 2 CPU cores). Without flags: 8192
tokens, C = 1, 2, 4 (C = 4 runs 4 processes; on 2 cores it is slow, not wrong). On a CUDA
machine the ranks take one GPU each; C above the GPUs visible is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "src")]

BENCH = "context_parallel"
PROMPT_TOKENS = 256
ROW = "@@RANK "


# ----------------------------------------------------------------------------- one rank


def rank_main(model_name: str, tokens: int, size: int) -> None:
    """One rank of a variant (C = size): build, one step, print this rank's figures."""
    import torch
    from models import build_model

    from leangrpo.config import config_from_dict
    from leangrpo.distributed.context import init_distributed
    from leangrpo.distributed.mesh import build_mesh
    from leangrpo.distributed.strategy import TorchrunRanks, shard_on_mesh
    from leangrpo.model.policy import build_policy
    from leangrpo.train.planning import plan_steps
    from leangrpo.train.ranks import ONE_PROCESS

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    cfg = config_from_dict(step_config(model_name, tokens, size, cuda))
    ctx = init_distributed(cfg.distributed, "cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(model_name, tokens + 1, ctx.device, dtype)
    policy = build_policy(model, cfg, None, ctx.device)
    ranks = ONE_PROCESS
    if size > 1:
        mesh = build_mesh(ctx, size)
        shard_on_mesh(policy, dist_cfg=cfg.distributed, ctx=ctx, mesh=mesh, engine_copy=False)
        ranks = TorchrunRanks(ctx, mesh)
    steps = plan_steps([long_sample(model_name, tokens)], cfg, policy, ranks.rank, ranks.world_size)
    micro_batches = steps[0].micro_batches
    figures = measured_step(policy, micro_batches, cfg, ranks, ctx.device)
    rows = sum(_split(policy).local_row(mb).completion_index.numel() for mb in micro_batches)
    figures["head_bytes"] = head_peak(model, rows, cfg, ctx.device, dtype)
    print(ROW + json.dumps({"rank": ctx.rank, "rows": rows, **figures}), flush=True)
    ctx.shutdown()


def step_config(model_name: str, tokens: int, size: int, cuda: bool) -> dict:
    return {
        "run": {"device": "cuda" if cuda else "cpu"},
        "model": {"name_or_path": model_name, "dtype": "bfloat16" if cuda else "float32"},
        "data": {"path": "unused.jsonl"},
        "rewards": {"functions": ["math"]},
        "rollout": {"num_generations": 2, "max_new_tokens": tokens - PROMPT_TOKENS},
        "loss": {"mu": 1, "beta": 0.0},
        "train": {"micro_batch_tokens": tokens},
        "packing": {"shared_prefix": "off"},
        "distributed": {"context_parallel_size": size, "sharding": "no_shard", "timeout_s": 600},
    }


def long_sample(model_name: str, tokens: int):
    import torch
    from models import CONFIGS

    from leangrpo.contracts import Completion, Prompt, RolloutSample

    g = torch.Generator().manual_seed(0)
    vocab = CONFIGS[model_name]["vocab_size"]
    ids = torch.randint(1, vocab, (tokens,), generator=g).tolist()
    completion = ids[PROMPT_TOKENS:]
    behaviour = [-2.0] * len(completion)
    sample = RolloutSample(
        0,
        Prompt(0, "", ids[:PROMPT_TOKENS]),
        Completion(completion, "", behaviour, "stop", 0),
        advantage=1.0,
    )
    sample.reward = 1.0
    return sample


class _Gradients:
    """Stands in for the optimizer: records the gradients' bytes, updates nothing."""

    def __init__(self, params):
        self.params, self.bytes = list(params), 0

    def step(self) -> None:
        self.bytes = sum(
            p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def measured_step(policy, micro_batches, cfg, ranks, device) -> dict:
    """One train_step: its seconds, its peak of live bytes, the gradients it made."""
    import torch

    from leangrpo.train.step import train_step

    grads = _Gradients(policy.trainable_parameters())
    sampling = cfg.rollout.sampling_params()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start_bytes = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        train_step(policy, micro_batches, grads, cfg, sampling, ranks)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - start_bytes
    else:
        t0 = time.perf_counter()
        with _LiveBytes() as mode:
            train_step(policy, micro_batches, grads, cfg, sampling, ranks)
        seconds, peak = time.perf_counter() - t0, mode.peak
    return {"time_s": seconds, "peak_bytes": int(peak), "gradient_bytes": grads.bytes}


def _live_bytes_mode():
    """benchmarks/packing.py's LiveBytes, skipping the tensors whose storage torch does not
    expose (what FSDP's and c10d's ops return around a collective)."""
    from packing import LiveBytes

    class Robust(LiveBytes):
        def _track(self, t):
            try:
                t.untyped_storage().data_ptr()
            except RuntimeError:
                return
            super()._track(t)

    return Robust()


_LiveBytes = _live_bytes_mode


def _split(policy):
    """The row split the scoring root uses (one process: the whole row)."""
    from leangrpo.ops.context_parallel.shards import WHOLE_ROW

    return getattr(policy.scoring_module, "split", WHOLE_ROW)


def head_peak(model, rows: int, cfg, device, dtype) -> int:
    """Peak bytes of the log-prob head alone, forward and backward with entropy, on `rows`
    completion rows through a frozen (V, H) head of the model's shape."""
    import torch

    from leangrpo.ops.logprobs.api import token_logprobs

    vocab, hidden_size = model.config.vocab_size, model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, hidden_size, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) * hidden_size**-0.5).to(device, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(device)
    options = {"chunked": cfg.logprobs.chunked, "with_entropy": True,
               "row_tile": cfg.logprobs.row_tile, "vocab_tile": cfg.logprobs.vocab_tile}  # fmt: skip

    def head() -> None:
        lp, ent = token_logprobs(hidden, weight, targets, **options)
        (lp.sum() + ent.sum()).backward()

    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        head()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with _LiveBytes() as mode:
        head()
    return mode.peak


# ----------------------------------------------------------------------------- the driver


def run_variant(model_name: str, tokens: int, size: int, limit_s: float) -> dict:
    """C = size: its ranks in processes of their own; their figures combined (the worst)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if size > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(size))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-of", str(size),
           "--model", model_name, "--tokens", str(tokens)]  # fmt: skip
    procs = [
        subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(size)
    ]  # fmt: skip
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=limit_s))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {limit_s:.0f} s"}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ranks = [json.loads(line[len(ROW):]) for out, _ in outs for line in out.splitlines()
             if line.startswith(ROW)]  # fmt: skip
    if len(ranks) != size:
        errors = [err.strip().splitlines()[-1] for _, err in outs if err.strip()]
        return {"error": errors[0] if errors else "a rank printed no figures"}
    keys = ("time_s", "peak_bytes", "gradient_bytes", "head_bytes", "rows")
    worst = {k: max(r[k] for r in ranks) for k in keys}
    worst["activation_bytes"] = max(
        r["peak_bytes"] - r["gradient_bytes"] - r["head_bytes"] for r in ranks
    )
    return worst


def case_rows(model_name: str, tokens: int, sizes: list[int], limit_s: float = 900.0):
    """One row per C (the first, C = 1, is the baseline), ratios against it."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
    base = None
    for size in sizes:
        row = {"bench": BENCH, "case": f"{model_name}/{tokens} tokens", "device": device,
               "variant": f"C={size}", "context_parallel_size": size, "tokens": tokens}  # fmt: skip
        if gpus is not None and size > gpus:
            yield {**row, "time_s": None, "peak_bytes": None,
                   "skipped": f"needs {size} GPUs, {gpus} visible"}  # fmt: skip
            continue
        row.update(run_variant(model_name, tokens, size, limit_s))
        if "error" not in row:
            if base is None:
                base = row
            else:
                row["time_ratio"] = round(row["time_s"] / base["time_s"], 3)
                row["mem_ratio"] = round(row["activation_bytes"] / base["activation_bytes"], 3)
                row["peak_ratio"] = round(row["peak_bytes"] / base["peak_bytes"], 3)
            row["time_s"] = round(row["time_s"], 3)
        yield row


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4096 tokens, C = 1 and 2")
    parser.add_argument("--model", default="cp-small", help="a shape of benchmarks/models.py")
    parser.add_argument("--tokens", type=int, default=None, help="the sequence's tokens")
    parser.add_argument("--sizes", default=None, help="comma list of C, the first the baseline")
    parser.add_argument("--rank-of", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = args.tokens or (4096 if args.quick else 8192)
    if args.rank_of is not None:
        rank_main(args.model, tokens, args.rank_of)
        return
    sizes = [int(c) for c in (args.sizes or ("1,2" if args.quick else "1,2,4")).split(",")]
    for row in case_rows(args.model, tokens, sizes):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
