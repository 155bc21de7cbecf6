"""One rank of the context-parallel gloo tests (tests/distributed/test_context_parallel.py).

Run as `python tests/support/cp_worker.py SCENARIOS OUT_DIR CONTEXT_SIZE` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (support/ranks.py `launch`); SCENARIOS are
run in order in one launch (`+`-separated: a launch costs seconds of start-up). The
processes form a (WORLD_SIZE / C) x C mesh (distributed/mesh.py), the policy is FSDP2-
sharded over all of them and its scoring roots split rows with Ulysses, as the torchrun
strategy does.

- exact (or exact:NAME,NAME for some cases): every case of CASES (the setups built once:
  full fine-tuning with checkpointing, hidden-state offload and a sharded reference;
  LoRA; QLoRA, the demo's linears quantized to nf4 as they load): one optimizer step's
  no-grad passes, loss, metrics and every (clipped) gradient,
  on the mesh and, on rank 0, in one process on the same batch. Rank 0 writes
  OUT_DIR/exact.pt.
- resume: two optimizer steps of one batch (mu = 2) with AdamW; a sharded checkpoint
  (DCP over the mesh, the batch in progress with each rank's old log-probs) taken between
  them, loaded into a fresh policy and optimizer, the second step run again. Rank 0
  writes both runs' parameters to OUT_DIR/resume.pt.
- kill: rank 1 SIGKILLs itself inside the next forward's attention all-to-all; rank 0,
  waiting in it, must exit 1 with one line naming rank 1.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))

from support.configs import DEMO_MODEL  # noqa: E402
from support.context import cp_config, cp_samples, one_step  # noqa: E402

FULL = {"model": {"gradient_checkpointing": True},
        "offload": {"activations": "hidden_states", "keep_last_layers": 1, "min_tensor_bytes": 0},
        "loss": {"beta": 0.04}}  # fmt: skip
LORA = {"lora": {"enabled": True, "r": 4, "alpha": 8}}
QLORA = {"model": {"quantization": "nf4"}, **LORA}  # the demo's linears, 4-bit (bitsandbytes)
# (name, setup, sections, multi-turn): every loss type, both references, every layout
CASES = [
    ("full/plain/grpo-kl-is", "full", {"loss": {"type": "grpo", "mu": 2, "beta": 0.04}}, False),
    ("full/prefix/dapo", "full", {"loss": {"type": "dapo", "beta": 0.0},
                                  "packing": {"shared_prefix": "on"}}, False),
    ("full/multiturn/gspo-seq-is", "full", {"loss": {"type": "gspo", "mu": 2, "beta": 0.0,
                                                     "is_mode": "sequence_mask"}}, True),
    ("lora/plain/bnpo-kl", "lora", {"loss": {"type": "bnpo", "beta": 0.04}}, False),
    ("lora/prefix-multiturn/cispo", "lora", {"loss": {"type": "cispo", "epsilon_high": 5.0, "mu": 2},
                                             "packing": {"shared_prefix": "on"}}, True),
    ("lora/plain/dr_grpo-masked", "lora", {"loss": {"type": "dr_grpo",
                                                    "mask_truncated_completions": True}}, False),
    ("qlora/prefix/grpo-kl", "qlora", {"loss": {"type": "grpo", "beta": 0.04},
                                       "packing": {"shared_prefix": "on"}}, False),
]  # fmt: skip
SETUPS = {"full": FULL, "lora": LORA, "qlora": QLORA}


def config(setup: str, size: int, sections: dict | None = None):
    merged = {k: dict(v) for k, v in SETUPS[setup].items()}
    for name, values in (sections or {}).items():
        merged.setdefault(name, {}).update(values)
    return cp_config(DEMO_MODEL, size, **merged)


def build(setup: str, size: int, base, *, sharded_on=None):
    """The setup's policy (LoRA's adapters started away from 0, the same on every rank);
    `sharded_on` = (ctx, mesh): sharded and split as the torchrun strategy does."""
    from leangrpo.distributed.strategy import shard_on_mesh
    from leangrpo.model.policy import build_policy, load_policy

    cfg = config(setup, size)
    torch.manual_seed(0)
    cpu, on_meta = torch.device("cpu"), bool(sharded_on)
    if cfg.model.quantization != "none":  # quantized as it loads, as the trainer does
        policy = load_policy(cfg, None, cpu, reference_on_meta=on_meta)
    else:
        policy = build_policy(copy.deepcopy(base), cfg, None, cpu, reference_on_meta=on_meta)
    g = torch.Generator().manual_seed(1)
    for name, p in sorted(policy.model.named_parameters()):
        if "lora_B" in name:
            p.data.normal_(0, 0.05, generator=g)
    if sharded_on is not None:
        ctx, mesh = sharded_on
        shard_on_mesh(policy, dist_cfg=cfg.distributed, ctx=ctx, mesh=mesh, engine_copy=False)
    return policy


def exact(ctx, mesh, out: Path, names: list[str] | None, built: dict) -> None:
    from transformers import AutoModelForCausalLM

    from leangrpo.distributed.strategy import TorchrunRanks

    base = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    ranks, size = TorchrunRanks(ctx, mesh), mesh.context_size
    results = {}
    for name, setup, sections, multiturn in CASES:
        if names and name not in names:
            continue
        if setup not in built:
            one = build(setup, 1, base) if ctx.is_main else None
            built[setup] = (build(setup, size, base, sharded_on=(ctx, mesh)), one)
        sharded, one = built[setup]
        with ctx.phase("train"):
            got = one_step(sharded, cp_samples(multiturn), config(setup, size, sections), ranks)
        if ctx.is_main:
            want = one_step(one, cp_samples(multiturn), config(setup, 1, sections))
            results[name] = {"sharded": got, "one": want}
    if ctx.is_main:
        torch.save(results, out / "exact.pt")


def kill(ctx, mesh, out: Path, built: dict) -> None:
    """Rank 1 dies in the next step's first attention all-to-all; rank 0 waits in it."""
    from leangrpo.distributed.strategy import TorchrunRanks

    arm_kill(ctx)
    name, setup, sections, multiturn = CASES[0]
    with ctx.phase("train"):
        one_step(built[setup][0], cp_samples(multiturn), config(setup, mesh.context_size, sections),
                 TorchrunRanks(ctx, mesh))  # fmt: skip
    (out / f"finished-{ctx.rank}").write_text("no failure was seen")


def arm_kill(ctx) -> None:
    """Rank 1 dies inside the next forward's attention all-to-all (its peer waits in it)."""
    from leangrpo.ops.context_parallel import exchange

    if ctx.rank != 1:
        return
    real = exchange.GroupExchange.all_to_all

    def dying(self, chunks):
        os.kill(os.getpid(), signal.SIGKILL)
        return real(self, chunks)

    exchange.GroupExchange.all_to_all = dying


def resume(ctx, mesh, out: Path) -> None:
    """Two steps of one batch; the second again after a checkpoint taken between them."""
    from transformers import AutoModelForCausalLM

    from leangrpo.checkpoint.sharded import ShardedCheckpointer
    from leangrpo.contracts import RolloutBatch
    from leangrpo.distributed.strategy import TorchrunRanks
    from leangrpo.train.inflight import BatchInProgress
    from leangrpo.train.passes import attach_old_and_ref
    from leangrpo.train.planning import plan_steps
    from leangrpo.train.step import train_step

    base = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    cfg = config("full", mesh.context_size, {"loss": {"type": "grpo", "mu": 2}})
    ranks = TorchrunRanks(ctx, mesh)
    sampling = cfg.rollout.sampling_params()
    checkpointer = ShardedCheckpointer(out, keep_last=1, ctx=ctx)

    def fresh():
        policy = build("full", mesh.context_size, base, sharded_on=(ctx, mesh))
        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        return policy, optimizer, scheduler

    def take_step(policy, optimizer, work):
        planned, _ = work.take()
        train_step(policy, planned.micro_batches, optimizer, cfg, sampling, ranks)

    policy, optimizer, scheduler = fresh()
    batch = RolloutBatch(cp_samples(), group_size=2)
    steps = plan_steps(batch.samples, cfg, policy, ranks.rank, ranks.world_size)
    attach_old_and_ref(policy, steps, cfg.loss, cfg.logprobs, sampling, ranks)
    work = BatchInProgress(batch, steps, cfg.loss.mu)
    take_step(policy, optimizer, work)
    path = checkpointer.save(1, policy.model, optimizer, scheduler, {"step": 1},
                             extra_files={}, bulky_state={}, inflight=work.state_dict())  # fmt: skip
    take_step(policy, optimizer, work)
    straight = gathered(policy)
    policy, optimizer, scheduler = fresh()
    restored = checkpointer.load(path, policy.model, optimizer, scheduler)
    work = BatchInProgress.from_state(restored.inflight, cfg, policy, ranks.rank, ranks.world_size)
    take_step(policy, optimizer, work)
    resumed = gathered(policy)
    if ctx.is_main:
        torch.save({"straight": straight, "resumed": resumed, "start": dict(base.named_parameters())},
                   out / "resume.pt")  # fmt: skip


def gathered(policy) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from leangrpo.distributed.fsdp import clean_name

    return {
        clean_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in policy.model.named_parameters()
    }


def main() -> None:
    from leangrpo.config.training import DistributedConfig
    from leangrpo.distributed.context import init_distributed
    from leangrpo.distributed.mesh import build_mesh
    from leangrpo.distributed.watch import DistributedError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    scenarios, out, size = sys.argv[1].split("+"), Path(sys.argv[2]), int(sys.argv[3])
    timeout_s = 20.0 if "kill" in scenarios else 120.0
    ctx = init_distributed(DistributedConfig(timeout_s=timeout_s), "cpu")
    built: dict = {}
    try:
        with ctx.phase("setup"):
            mesh = build_mesh(ctx, size)
        for scenario in scenarios:
            kind, _, names = scenario.partition(":")
            if kind == "exact":
                exact(ctx, mesh, out, names.split(",") if names else None, built)
            elif kind == "resume":
                resume(ctx, mesh, out)
            elif kind == "kill":
                kill(ctx, mesh, out, built)
            else:
                raise SystemExit(f"unknown scenario {scenario!r}")
    except (
        DistributedError
    ) as exc:  # as the CLI does: one line, no teardown with gloo ops in flight
        print(f"leangrpo: error: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    ctx.shutdown()


if __name__ == "__main__":
    main()
