"""Planning a generation batch: optimizer steps of whole groups, packed micro-batches.

A batch is cut into `train.steps_per_generation` optimizer steps (whole prompt groups
each), every step into micro-batches of at most `train.micro_batch_tokens` real tokens
(`packing.plan_micro_batches`), packed once and reused for all `loss.mu` iterations. With
a shared prefix (`packing.shared_prefix`, 'auto' only where measured faster) a group's
prompt is encoded once per micro-batch it spans (`packing/split_groups` counts groups
over the budget).

Under torchrun every rank holds the whole batch; each step's groups are dealt to ranks
(`distributed.dealing.deal_groups`, by tokens or attention cost), each rank packs only its
share, and every rank's plan is padded with one-token padding micro-batches to the largest
count. Every rank plans every rank's share, so no collective is needed. See
docs/training.md ("One generation batch") and docs/distributed.md ("A step", "Dealing groups").
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from leangrpo.config.training import PackingConfig, TrainConfig
from leangrpo.contracts import PackedBatch, RolloutSample
from leangrpo.distributed.dealing import deal_groups, padding_batch
from leangrpo.model.policy import Policy
from leangrpo.ops.attention.adapter import choose_shared_prefix, packed_support
from leangrpo.train.packing import pack_samples, packing_metrics, plan_micro_batches


@dataclass
class PlannedStep:
    micro_batches: list[PackedBatch]  # this rank's, padding micro-batches included (torchrun)
    metrics: dict[str, float]  # packing metrics of this step (this rank's share)
    versions: list[int] = field(default_factory=list)  # of every sample of the step, all ranks


def plan_steps(
    samples: list[RolloutSample], cfg, policy: Policy, rank: int = 0, world_size: int = 1
) -> list[PlannedStep]:
    """Cut a batch into optimizer steps of whole groups, each into packed micro-batches.

    `cfg`: the run's Config (its train, packing and rollout sections). No samples (every
    reward failed): no steps. With world_size > 1, each step's groups are dealt to ranks
    and this rank's share is planned, padded to the largest count.
    """
    train, packing = cfg.train, cfg.packing
    policy.routing.check_samples(samples)  # route records (MoE routing replay) fit the model
    prefix = use_shared_prefix(samples, packing, cfg.rollout.num_generations, policy)
    steps = []
    for step_samples in split_by_groups(samples, train.steps_per_generation):
        if not step_samples:
            continue
        versions = [s.version for s in step_samples]
        if world_size > 1:
            step_samples, plan, padding, dealt = _rank_share(
                step_samples, train, packing, prefix, rank, world_size
            )
        else:
            plan, padding, dealt = _plan(step_samples, train, packing, prefix), 0, {}
        lengths = [s.num_tokens for s in step_samples]
        micro_batches = [
            pack_samples([step_samples[i] for i in idx], shared_prefix=prefix, device=policy.device)
            for idx in plan
        ]
        metrics = _packing_metrics(lengths, plan, packing, micro_batches)
        metrics["packing/shared_prefix"] = float(prefix)
        metrics["packing/split_groups"] = float(split_groups(step_samples, plan) if prefix else 0)
        micro_batches += [padding_batch(0, policy.device) for _ in range(padding)]
        steps.append(PlannedStep(micro_batches, {**metrics, **dealt}, versions))
    return steps


def _packing_metrics(lengths, plan, packing: PackingConfig, micro_batches) -> dict[str, float]:
    if not plan:  # torchrun: a rank dealt no group in this step (it runs padding only)
        return {"packing/tokens": 0.0, "packing/micro_batches": 0.0}
    tokens = [mb.num_tokens for mb in micro_batches]
    return packing_metrics(lengths, plan, packing.balance, packed_tokens=tokens)


def _plan(
    step_samples: list[RolloutSample], train: TrainConfig, packing: PackingConfig, prefix: bool
) -> list[list[int]]:
    lengths = [s.num_tokens for s in step_samples]
    groups = group_indices(step_samples) if prefix else None
    prompt_lens = [len(step_samples[g[0]].prompt.ids) for g in groups] if prefix else None
    return plan_micro_batches(
        lengths,
        train.micro_batch_tokens,
        packing.balance,
        groups=groups,
        prompt_lens=prompt_lens,
    )


def split_groups(step_samples: list[RolloutSample], plan: list[list[int]]) -> int:
    """Groups whose sequences span more than one micro-batch: a shared-prefix group over
    `train.micro_batch_tokens`, whose prompt is forwarded once per micro-batch it spans."""
    spans: dict[int, set[int]] = defaultdict(set)
    for b, idx in enumerate(plan):
        for i in idx:
            spans[step_samples[i].group_id].add(b)
    return sum(len(bins) > 1 for bins in spans.values())


def _rank_share(step_samples, train, packing, prefix: bool, rank: int, world_size: int):
    """This rank's samples of the step, its plan, the padding micro-batches it needs and
    the dealing metrics. Every rank plans every rank's share (no collective)."""
    groups = group_indices(step_samples)
    lengths = [[step_samples[i].num_tokens for i in g] for g in groups]
    deal = deal_groups(lengths, world_size, packing.balance)
    shares = [
        [step_samples[i] for g in deal.groups[r] for i in groups[g]] for r in range(world_size)
    ]
    plans = [_plan(share, train, packing, prefix) if share else [] for share in shares]
    count = max(len(p) for p in plans)
    dealt = {
        **deal.metrics(),
        "dist/padding_micro_batches": float(sum(count - len(p) for p in plans)),
    }
    return shares[rank], plans[rank], count - len(plans[rank]), dealt


def use_shared_prefix(
    samples: list[RolloutSample], packing: PackingConfig, group_size: int, policy: Policy
) -> bool:
    """packing.shared_prefix: 'auto' turns it on only where it was measured faster."""
    support = packed_support(policy.model)
    if support is None or not support.prefix_kwarg or not samples or not _prompts_shared(samples):
        return False
    prompt_tokens = sum(len(s.prompt.ids) for s in samples)
    stats = {
        "prompt_fraction": prompt_tokens / sum(s.num_tokens for s in samples),
        "group_size": group_size,
    }
    return choose_shared_prefix(packing.shared_prefix, policy.attention_backend, stats)


def _prompts_shared(samples: list[RolloutSample]) -> bool:
    """Every group's samples start from one prompt (an environment whose reset is not a
    function of the row and its seed may give a group's trajectories different ones)."""
    first: dict[int, list[int]] = {}
    return all(first.setdefault(s.group_id, s.prompt.ids) == s.prompt.ids for s in samples)


def group_indices(samples: list[RolloutSample]) -> list[list[int]]:
    """Indices of each group's samples, groups in order of first appearance."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        groups[s.group_id].append(i)
    return list(groups.values())


def split_by_groups(samples: list[RolloutSample], parts: int) -> list[list[RolloutSample]]:
    """`parts` near-equal runs of whole groups (fewer when there are fewer groups)."""
    groups = group_indices(samples)
    parts = max(1, min(parts, len(groups)))
    bounds = [round(i * len(groups) / parts) for i in range(parts + 1)]
    return [[samples[i] for g in groups[a:b] for i in g] for a, b in zip(bounds, bounds[1:])]
