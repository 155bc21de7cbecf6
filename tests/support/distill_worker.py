"""One rank of the 2-process CPU (gloo) distillation test (tests/distill/test_torchrun.py).

Run as `python tests/support/distill_worker.py SCENARIOS TEACHER_DIR OUT_DIR` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; SCENARIOS `+`-separated, run in one launch.
The trainer's pieces on the demo: the policy and the teacher (load_teacher) sharded by
`shard_policy`, the rank's groups planned, `attach_old_and_ref`, one `train_step`.
- teacher (objective sampled, the teacher's pass through its FSDP root): rank 0 writes
  OUT_DIR/teacher.pt: per rank, the teacher log-probs of each sample it scored (by its
  completion ids), the teacher parameters held whole after the passes (none may be), and
  the step's loss.
- jsd (objective jsd: the teacher's forward in the step through its FSDP root, its head
  copied while gathered; 5 groups in small micro-batches, so one rank runs a padding
  micro-batch, the teacher's forward included): rank 0 writes OUT_DIR/jsd.pt: the step's
  metrics and gathered gradients on the 2 ranks and in one process on all the samples,
  and the teacher parameters held whole after the step (none may be).
- gathered TEACHER_DIR OUT_DIR SHARDING (alone, its own launch): how much of the teacher
  its passes hold gathered under that sharding (OUT_DIR/gathered.pt).
- load TEACHER_DIR OUT_DIR staged|whole (alone, its own launch): what a rank holds of the
  teacher while it loads and shards (OUT_DIR/load.pt).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))  # run as a script: this checkout's leangrpo ...
sys.path.insert(0, str(REPO / "tests"))  # ... and the support package


def distill_run(teacher: str, out: Path) -> dict:
    """The distillation config both the ranks and the one-process reference use."""
    from support.configs import demo_config

    raw = demo_config(out / "unused", "full_sync", 2, distill={"teacher": teacher})
    raw["loss"]["beta"] = 0.0
    return raw


def teacher_ranks(ctx, teacher: str, out: Path) -> None:
    from leangrpo.config import config_from_dict
    from leangrpo.distill.teacher import load_teacher
    from leangrpo.distributed.fsdp import shard_policy
    from leangrpo.distributed.strategy import TorchrunRanks
    from leangrpo.model.policy import load_policy
    from leangrpo.train.packing import unpack_per_sample
    from leangrpo.train.passes import attach_old_and_ref
    from leangrpo.train.planning import plan_steps
    from leangrpo.train.step import train_step
    from support.dist_worker import batches, unsharded_parameters

    cfg = config_from_dict(distill_run(teacher, out))
    samples = [s for g in batches()[0] for s in g]
    for s in samples:
        s.reward = 0.0
    policy = load_policy(cfg, None, torch.device("cpu"))
    policy.teacher = load_teacher(cfg, torch.device("cpu"), staged=True)  # as the trainer
    shard_policy(policy, cfg.distributed, ctx)
    sampling, ranks = cfg.rollout.sampling_params(), TorchrunRanks(ctx)
    steps = plan_steps(samples, cfg, policy, ctx.rank, ctx.world_size)
    attach_old_and_ref(policy, steps, cfg.loss, cfg.logprobs, sampling, ranks)
    seen = {"whole": unsharded_parameters(policy.teacher), "logprobs": {}}
    for mb in (mb for step in steps for mb in step.micro_batches if not mb.padding):
        completions = unpack_per_sample(mb.targets, mb)  # each sequence's ids: its key
        for ids, values in zip(completions, unpack_per_sample(mb.teacher_logprobs, mb)):
            seen["logprobs"][tuple(ids.tolist())] = values.clone()
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-4)
    result = train_step(policy, steps[0].micro_batches, opt, cfg, sampling, ranks)
    seen["loss"], seen["reverse_kl"] = (
        result.metrics["loss"],
        result.metrics["loss/distill/reverse_kl"],
    )
    gathered = ctx.gather_to_main(seen)
    if ctx.is_main:
        torch.save(gathered, out / "teacher.pt")


def jsd_run(teacher: str, out: Path) -> dict:
    raw = distill_run(teacher, out)
    raw["distill"].update(objective="jsd", jsd_beta=0.5, weight=0.5)
    raw["train"]["micro_batch_tokens"] = 24  # more micro-batches: the ranks' counts differ
    return raw


def jsd_ranks(ctx, teacher: str, out: Path) -> None:
    from leangrpo.config import config_from_dict
    from leangrpo.distill.teacher import load_teacher
    from leangrpo.distributed.fsdp import shard_policy
    from leangrpo.distributed.strategy import TorchrunRanks
    from leangrpo.model.policy import load_policy
    from support.context import one_step
    from support.dist_worker import batches, unsharded_parameters

    cfg = config_from_dict(jsd_run(teacher, out))
    samples = [s for g in batches()[0][:5] for s in g]  # 5 groups: one rank gets fewer
    for s in samples:
        s.reward = 0.0

    def loaded():
        torch.manual_seed(0)
        policy = load_policy(cfg, None, torch.device("cpu"))
        policy.teacher = load_teacher(cfg, torch.device("cpu"))
        return policy

    sharded = loaded()
    shard_policy(sharded, cfg.distributed, ctx)
    got = one_step(sharded, samples, cfg, TorchrunRanks(ctx))
    got["whole"] = ctx.gather_to_main(unsharded_parameters(sharded.teacher))
    if ctx.is_main:
        want = one_step(loaded(), samples, cfg)
        torch.save({"ranks": got, "one": want}, out / "jsd.pt")


def held_whole(module) -> int:
    """Bytes of `module`'s parameters held whole (gathered) right now."""
    from torch.distributed.tensor import DTensor

    return sum(p.numel() * p.element_size() for p in module.parameters() if not isinstance(p, DTensor))


def gathered_ranks(teacher: str, out: Path, sharding: str) -> None:
    """The teacher's no-grad passes under distributed.sharding = `sharding`: the most of
    its parameters held gathered at once (sampled before and after every module's
    forward), and what stays gathered after the passes. Rank 0 writes OUT/gathered.pt."""
    from leangrpo.config import config_from_dict
    from leangrpo.distill.teacher import load_teacher
    from leangrpo.distributed.context import init_distributed
    from leangrpo.distributed.fsdp import shard_policy
    from leangrpo.distributed.strategy import TorchrunRanks
    from leangrpo.model.policy import load_policy
    from leangrpo.train.passes import attach_old_and_ref
    from leangrpo.train.planning import plan_steps
    from support.dist_worker import batches, dist_cfg

    ctx = init_distributed(dist_cfg(sharding=sharding), "cpu")
    raw = distill_run(teacher, out)
    raw["distributed"] = {**raw.get("distributed", {}), "sharding": sharding}
    cfg = config_from_dict(raw)
    samples = [s for g in batches()[0] for s in g]
    for s in samples:
        s.reward = 0.0
    policy = load_policy(cfg, None, torch.device("cpu"))
    policy.teacher = load_teacher(cfg, torch.device("cpu"))
    shard_policy(policy, cfg.distributed, ctx)
    seen = {"peak": 0}

    def sample(*_):
        seen["peak"] = max(seen["peak"], held_whole(policy.teacher))

    for module in policy.teacher.modules():
        module.register_forward_pre_hook(sample)
        module.register_forward_hook(sample)
    steps = plan_steps(samples, cfg, policy, ctx.rank, ctx.world_size)
    ranks = TorchrunRanks(ctx)
    attach_old_and_ref(policy, steps, cfg.loss, cfg.logprobs, cfg.rollout.sampling_params(), ranks)
    seen["after"] = held_whole(policy.teacher)
    gathered = ctx.gather_to_main(seen)
    if ctx.is_main:
        torch.save(gathered, out / "gathered.pt")
    ctx.shutdown()


def file_mappings(directory: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of files in `directory`."""
    import os

    root, ranges = os.path.realpath(directory), []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and os.path.realpath(parts[5]).startswith(root + os.sep):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((start, end))
    return ranges


def own_bytes(module, mapped: list[tuple[int, int]]) -> int:
    """Bytes of the distinct storages of `module`'s parameters (a shard's local tensor for
    a DTensor) that are memory of this process's own, not views into mapped files."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for p in module.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        s = t.untyped_storage()
        if t.is_meta or any(a <= s.data_ptr() < b for a, b in mapped):
            continue
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def load_ranks(teacher: str, out: Path, staged: bool) -> None:
    """The trainer's set-up of a teacher under torchrun: load_teacher (staged as the
    trainer asks), then shard_policy. Samples, after the load and around every
    `fully_shard` call, the teacher's parameter bytes this rank holds in memory of its
    own (not file-mapped); rank 0 writes OUT/load.pt with each rank's peak, the whole
    teacher's bytes, its largest FSDP unit (a decoder layer or the embeddings) and its
    shards once sharded."""
    from leangrpo.config import config_from_dict
    from leangrpo.distill.teacher import load_teacher
    from leangrpo.distributed import fsdp
    from leangrpo.distributed.context import init_distributed
    from leangrpo.model.policy import load_policy
    from support.dist_worker import dist_cfg

    ctx = init_distributed(dist_cfg(), "cpu")
    cfg = config_from_dict(distill_run(teacher, out))
    policy = load_policy(cfg, None, torch.device("cpu"))
    model = load_teacher(cfg, torch.device("cpu"), staged=staged)
    mapped = file_mappings(Path(teacher))
    units = [*fsdp.decoder_layers(model), model.get_input_embeddings()]
    seen = {
        "whole": sum(p.numel() * p.element_size() for p in model.parameters()),
        "unit": max(sum(p.numel() * p.element_size() for p in u.parameters()) for u in units),
        "peak": own_bytes(model, mapped),
    }
    policy.teacher = model
    real = fsdp.fully_shard

    def sampled(module, *args, **kwargs):
        seen["peak"] = max(seen["peak"], own_bytes(model, mapped))
        result = real(module, *args, **kwargs)
        seen["peak"] = max(seen["peak"], own_bytes(model, mapped))
        return result

    fsdp.fully_shard = sampled
    try:
        fsdp.shard_policy(policy, cfg.distributed, ctx)
    finally:
        fsdp.fully_shard = real
    seen["shards"] = own_bytes(model, mapped)
    gathered = ctx.gather_to_main(seen)
    if ctx.is_main:
        torch.save(gathered, out / "load.pt")
    ctx.shutdown()


def main() -> None:
    from leangrpo.distributed.context import init_distributed
    from support.dist_worker import dist_cfg

    torch.set_num_threads(1)
    scenarios, arg, out = sys.argv[1].split("+"), sys.argv[2], Path(sys.argv[3])
    if scenarios == ["gathered"]:  # each sets its process group up itself
        return gathered_ranks(arg, out, sys.argv[4])
    if scenarios == ["load"]:
        return load_ranks(arg, out, sys.argv[4] == "staged")
    unknown = set(scenarios) - {"teacher", "jsd"}
    if unknown:
        raise SystemExit(f"unknown scenario(s) {sorted(unknown)}")
    ctx = init_distributed(dist_cfg(), "cpu")
    if "teacher" in scenarios:
        teacher_ranks(ctx, arg, out)
    if "jsd" in scenarios:
        jsd_ranks(ctx, arg, out)
    ctx.shutdown()


if __name__ == "__main__":
    main()
