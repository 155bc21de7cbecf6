"""Context parallelism: one training step on one long sequence, per rank, at C = 1, 2, 4,
with gradient checkpointing off and on.

    python benchmarks/context_parallel.py [--quick] [--model cp-small] [--tokens 8192]
                                          [--sizes 1,2,4] [--checkpointing off,on]

A random-weight model (benchmarks/models.py), full fine-tuning in the model's dtype, one
sample of `--tokens` tokens (a 256-token prompt and the rest completion), the trainer's own
pieces: `build_policy`, and for C > 1 the torchrun strategy's (`build_mesh`,
`shard_on_mesh`: FSDP2 over the C processes, rows split by Ulysses), then `plan_steps` and
one `train_step` (forward, chunked log-probs, loss, backward, clipping; the optimizer's
update left out: it is the same for every C). Each C runs in processes of its own (C = 1: one
process, no torchrun; C > 1: C ranks, gloo on CPU, NCCL on GPUs), variants one after
another in the same run. Each checkpointing mode is a case of its own (model.
gradient_checkpointing false / true), with its own baseline C = 1.

Per variant (the worst rank): `time_s` (the step), `peak_bytes` (the step's peak of tensor
bytes allocated during it and still alive: activations, the head's working set, the
exchange buffers, FSDP's buffers and the gradients made by then; on CPU counted op by op
with a dispatch mode, on CUDA max_memory_allocated above the start), `gradient_bytes` (the
gradients the step leaves), `fsdp_bytes` (FSDP's own buffers alive at the peak: gathered
parameters, gradients around their reduction; 0 at C = 1, which runs without FSDP),
`head_bytes` (the log-prob head's own peak on the rank's completion rows, measured alone as
benchmarks/grpo_step.py does: its tiles do not grow with the sequence), and
`activation_bytes`: the most the step holds at any moment besides the gradients made by
then, FSDP's buffers and the head's working set, as `leangrpo plan`'s activation term
counts it. Op by op (the same dispatch mode, on every device) the step's storages are
followed from birth to release: those the gradients end in are the gradients, those
FSDP's code makes are its buffers, and the backbone's forward hook and the gradient of its
output mark the head's span (its forward, the loss and its backward), across which what
the forward had saved counts. Without checkpointing the most is every layer's saved
tensors (with the top layer's backward working set); with it, the layer inputs kept, one
recomputed layer's saved tensors, its backward's working set and the exchange buffers.
Against C = 1 of the same mode, measured in the same run: `time_ratio`, `mem_ratio`
(activation_bytes; the goal: <= 0.6 at C = 2) and `peak_ratio`. FSDP runs `no_shard`
(parameters replicated), so every rank holds whole gradients, as one process does.

`--quick`: 4096 tokens, C = 1 and 2 (a few minutes on 2 CPU cores). Without flags: 8192
tokens, C = 1, 2, 4 (C = 4 runs 4 processes; on 2 cores it is slow, not wrong). On a CUDA
machine the ranks take one GPU each; C above the GPUs visible is reported as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
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
MODES = {"off": False, "on": True}  # --checkpointing


# ----------------------------------------------------------------------------- one rank


def rank_main(model_name: str, tokens: int, size: int, modes: list[bool]) -> None:
    """One rank of a variant (C = size): for each checkpointing mode build, one step,
    print this rank's figures."""
    import torch

    from leangrpo.config import config_from_dict
    from leangrpo.distributed.context import init_distributed
    from leangrpo.distributed.mesh import build_mesh

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    cfg = config_from_dict(step_config(model_name, tokens, size, cuda))
    ctx = init_distributed(cfg.distributed, "cuda" if cuda else "cpu")
    mesh = build_mesh(ctx, size) if size > 1 else None
    for checkpointing in modes:
        figures = rank_figures(model_name, tokens, size, checkpointing, ctx, mesh)
        print(ROW + json.dumps({"rank": ctx.rank, "checkpointing": checkpointing, **figures}),
              flush=True)  # fmt: skip
    ctx.shutdown()


def rank_figures(model_name: str, tokens: int, size: int, checkpointing: bool, ctx, mesh) -> dict:
    """Build the policy (sharded on `mesh` for C > 1), one measured step, the head alone."""
    import torch
    from models import build_model

    from leangrpo.config import config_from_dict
    from leangrpo.distributed.strategy import TorchrunRanks, shard_on_mesh
    from leangrpo.model.policy import build_policy
    from leangrpo.train.planning import plan_steps
    from leangrpo.train.ranks import ONE_PROCESS

    cuda = ctx.device.type == "cuda"
    cfg = config_from_dict(step_config(model_name, tokens, size, cuda, checkpointing))
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(model_name, tokens + 1, ctx.device, dtype)
    policy = build_policy(model, cfg, None, ctx.device)
    ranks = ONE_PROCESS
    if mesh is not None:
        shard_on_mesh(policy, dist_cfg=cfg.distributed, ctx=ctx, mesh=mesh, engine_copy=False)
        ranks = TorchrunRanks(ctx, mesh)
    steps = plan_steps([long_sample(model_name, tokens)], cfg, policy, ranks.rank, ranks.world_size)
    micro_batches = steps[0].micro_batches
    figures = measured_step(policy, micro_batches, cfg, ranks, ctx.device)
    rows = sum(_split(policy).local_row(mb).completion_index.numel() for mb in micro_batches)
    figures["head_bytes"] = head_peak(model, rows, cfg, ctx.device, dtype)
    return {"rows": rows, **figures}


def step_config(
    model_name: str, tokens: int, size: int, cuda: bool, checkpointing: bool = False
) -> dict:
    return {
        "run": {"device": "cuda" if cuda else "cpu"},
        "model": {
            "name_or_path": model_name,
            "dtype": "bfloat16" if cuda else "float32",
            "gradient_checkpointing": checkpointing,
        },  # fmt: skip
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
    """Stands in for the optimizer: records the gradients (their bytes, and for the
    timeline the storages they end in), updates nothing."""

    def __init__(self, params, timeline: _Timeline | None = None):
        self.params, self.bytes, self.timeline = list(params), 0, timeline

    def step(self) -> None:
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        self.bytes = sum(g.numel() * g.element_size() for g in grads)
        if self.timeline is not None:
            self.timeline.gradients_end_in(grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def _local(t):
    """A DTensor's local tensor (FSDP's gradients), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def measured_step(policy, micro_batches, cfg, ranks, device) -> dict:
    """One train_step: its seconds, its peak of live bytes, the gradients it made, and the
    activations it held at that peak (`_Timeline`). On CUDA the timed step runs as it is
    (its peak from the allocator), and a second one under the timeline."""
    import torch

    from leangrpo.train.step import train_step

    sampling = cfg.rollout.sampling_params()
    figures = {}
    if device.type == "cuda":
        grads = _Gradients(policy.trainable_parameters())
        torch.cuda.synchronize()
        start_bytes = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        train_step(policy, micro_batches, grads, cfg, sampling, ranks)
        torch.cuda.synchronize()
        figures["time_s"] = time.perf_counter() - t0
        figures["peak_bytes"] = torch.cuda.max_memory_allocated() - start_bytes
    with _Timeline() as timeline, _head_span(policy, timeline):
        grads = _Gradients(policy.trainable_parameters(), timeline)
        t0 = time.perf_counter()
        train_step(policy, micro_batches, grads, cfg, sampling, ranks)
        seconds = time.perf_counter() - t0
    figures.setdefault("time_s", seconds)
    figures.setdefault("peak_bytes", timeline.peak)
    figures.update(
        gradient_bytes=grads.bytes,
        activation_bytes=timeline.activations(),
        fsdp_bytes=timeline.alive(timeline.peak_at, ("fsdp",)),
    )
    return {k: int(v) if k != "time_s" else v for k, v in figures.items()}


def _timeline_mode():
    """benchmarks/packing.py's LiveBytes, skipping the tensors whose storage torch does not
    expose (what FSDP's and c10d's ops return around a collective), and following each
    storage from its birth to its release (`Timeline`)."""
    from packing import LiveBytes

    class Timeline(LiveBytes):
        """Live bytes after each storage's birth (`samples`, by birth count), a record per
        storage: [birth, release, bytes, kind] (release: the birth count when it was freed,
        None while alive; kind "fsdp" for the buffers FSDP's own code makes: gathered
        parameters, gradients around their reduction; "gradient" for those the gradients
        end in), the birth count at the peak, and the head's span."""

        def __init__(self):
            super().__init__()
            self.births, self.peak_at, self.records, self.current = 0, 0, [], {}
            self.samples = [0]
            self.head_start = self.head_end = None
            self.live_at_head = 0

        def _track(self, t):
            try:
                key = t.untyped_storage().data_ptr()
            except RuntimeError:
                return
            born = key not in self.refs
            if born:
                self.births += 1
                kind = "fsdp" if _called_from_fsdp() else "step"
                self.current[key] = len(self.records)
                self.records.append([self.births, None, t.untyped_storage().nbytes(), kind])
            before = self.peak
            super()._track(t)
            if born:
                self.samples.append(self.live)
            if self.peak > before:
                self.peak_at = self.births

        def _release(self, key):
            super()._release(key)
            if key not in self.refs and key in self.current:
                self.records[self.current.pop(key)][1] = self.births

        def mark_head_start(self) -> None:
            if self.head_start is None:  # the backbone's forward ends: the head begins
                self.head_start, self.live_at_head = self.births, self.live

        def mark_head_end(self) -> None:
            if self.head_end is None:  # the gradient of the backbone's output is made
                self.head_end = self.births

        def gradients_end_in(self, grads) -> None:
            for g in grads:
                index = self.current.get(g.untyped_storage().data_ptr())
                if index is not None:
                    self.records[index][3] = "gradient"

        def alive(self, at: int, kinds: tuple[str, ...]) -> int:
            """Bytes of the given kinds alive at birth count `at`."""
            return sum(size for birth, release, size, kind in self.records
                       if kind in kinds and birth <= at and (release is None or release >= at))  # fmt: skip

        def activations(self) -> int:
            """The most the step held besides the gradients made by then and FSDP's
            buffers, outside the head's span; across it, what the forward had saved."""
            start, end = self.head_start, self.head_end
            if start is None or end is None:
                raise RuntimeError("the step's backbone or its backward was not seen")
            others = [0] * (self.births + 2)  # gradients' and FSDP's bytes, by birth count
            for birth, release, size, kind in self.records:
                if kind != "step":
                    others[birth] += size
                    others[(self.births if release is None else release) + 1] -= size
            held, most = 0, 0
            for at in range(1, self.births + 1):
                held += others[at]
                if at == start:
                    most = max(most, self.live_at_head - held)
                if not start < at <= end:
                    most = max(most, self.samples[at] - held)
            return most

    return Timeline()


def _called_from_fsdp() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if "/torch/distributed/fsdp/" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


_Timeline = _timeline_mode


@contextlib.contextmanager
def _head_span(policy, timeline):
    """Marks the head's span on the timeline: from the end of the backbone's forward to
    the gradient of its output (the head's and the loss's backward done)."""
    from leangrpo.model.scoring import backbone_and_head

    backbone, _ = backbone_and_head(policy.model)

    def forward_done(module, args, output):
        timeline.mark_head_start()
        output.last_hidden_state.register_hook(lambda grad: timeline.mark_head_end())

    handle = backbone.register_forward_hook(forward_done)
    try:
        yield
    finally:
        handle.remove()


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
    with _Timeline() as mode:
        head()
    return mode.peak


# ----------------------------------------------------------------------------- the driver


def run_variant(model_name: str, tokens: int, size: int, limit_s: float, modes: list[bool]) -> dict:
    """C = size: its ranks in processes of their own, each mode in turn; per mode the
    ranks' figures combined (the worst), or {"error": ...}."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if size > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(size))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-of", str(size),
           "--model", model_name, "--tokens", str(tokens),
           "--checkpointing", ",".join("on" if m else "off" for m in modes)]  # fmt: skip
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
    if len(ranks) != size * len(modes):
        errors = [err.strip().splitlines()[-1] for _, err in outs if err.strip()]
        return {"error": errors[0] if errors else "a rank printed no figures"}
    keys = ("time_s", "peak_bytes", "gradient_bytes", "fsdp_bytes", "head_bytes",
            "activation_bytes", "rows")  # fmt: skip
    return {
        mode: {k: max(r[k] for r in ranks if r["checkpointing"] == mode) for k in keys}
        for mode in modes
    }


def case_rows(
    model_name: str,
    tokens: int,
    sizes: list[int],
    limit_s: float = 900.0,
    modes: tuple[bool, ...] = (False,),
):
    """One row per C and checkpointing mode (C = 1, the first, is each mode's baseline),
    ratios against the baseline."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
    base: dict[bool, dict] = {}
    for size in sizes:
        rows = {}
        for mode in modes:
            case = f"{model_name}/{tokens} tokens" + (", checkpointing" if mode else "")
            rows[mode] = {"bench": BENCH, "case": case, "device": device, "variant": f"C={size}",
                          "context_parallel_size": size, "tokens": tokens,
                          "gradient_checkpointing": mode}  # fmt: skip
        if gpus is not None and size > gpus:
            for row in rows.values():
                yield {**row, "time_s": None, "peak_bytes": None,
                       "skipped": f"needs {size} GPUs, {gpus} visible"}  # fmt: skip
            continue
        figures = run_variant(model_name, tokens, size, limit_s, list(modes))
        for mode, row in rows.items():
            row.update(figures.get(mode, figures))
            if "error" not in row:
                _ratios(row, base.setdefault(mode, row))
            yield row


def _ratios(row: dict, base: dict) -> None:
    if row is not base:
        row["time_ratio"] = round(row["time_s"] / base["time_s"], 3)
        row["mem_ratio"] = round(row["activation_bytes"] / base["activation_bytes"], 3)
        row["peak_ratio"] = round(row["peak_bytes"] / base["peak_bytes"], 3)
    row["time_s"] = round(row["time_s"], 3)


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
    parser.add_argument("--checkpointing", default="off,on",
                        help="comma list of modes (off, on): a case each")  # fmt: skip
    parser.add_argument("--rank-of", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = args.tokens or (4096 if args.quick else 8192)
    modes = [MODES[m] for m in args.checkpointing.split(",")]
    if args.rank_of is not None:
        rank_main(args.model, tokens, args.rank_of, modes)
        return
    sizes = [int(c) for c in (args.sizes or ("1,2" if args.quick else "1,2,4")).split(",")]
    for row in case_rows(args.model, tokens, sizes, modes=tuple(modes)):
        if "error" in row:  # a case that errors fails the run
            sys.exit(f"{row['case']}, {row['variant']}: {row['error']}")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
