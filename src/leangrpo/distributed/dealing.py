"""Dealing prompt groups to ranks: whole groups, heaviest first to the least loaded rank
(LPT), by tokens or attention cost; deterministic, so every rank computes the same deal
without a collective. Plans are padded to one micro-batch count over ranks, since every
forward and backward gathers parameters with all of them: a rank short of micro-batches
runs one-token padding batches (`padding_batch`, marked `PackedBatch.padding`) through a
forward and a zero-gradient backward (`padding_pass`), never the loss. See
docs/distributed.md ("A step", "Equal micro-batch counts").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from leangrpo.contracts import PackedBatch
from leangrpo.distributed.context import DistContext


@dataclass
class GroupDeal:
    """Which prompt groups each rank trains on, and how even the split is."""

    groups: list[list[int]]  # per rank, indices into the groups passed in (ascending)
    tokens: list[int]  # per rank
    cost: list[float]  # per rank, in the balance unit (tokens or sum of squared lengths)

    @property
    def imbalance(self) -> float:
        """Slowest rank's tokens / fastest rank's (inf when a rank got nothing)."""
        low, high = min(self.tokens), max(self.tokens)
        if high == 0:
            return 1.0
        return high / low if low > 0 else float("inf")

    def metrics(self) -> dict[str, float]:
        return {"dist/imbalance": self.imbalance, "dist/max_rank_tokens": float(max(self.tokens))}


def group_cost(lengths: Sequence[int], balance: str) -> float:
    """Work of one group: its tokens, or the sum of squared sequence lengths (attention)."""
    if balance == "tokens":
        return float(sum(lengths))
    if balance == "attention":
        return float(sum(n * n for n in lengths))
    raise ValueError(f"balance must be 'tokens' or 'attention', got {balance!r}")


def deal_groups(
    group_lengths: Sequence[Sequence[int]], world_size: int, balance: str = "tokens"
) -> GroupDeal:
    """Deal whole groups to `world_size` ranks: heaviest first to the least loaded rank.

    `group_lengths[g]` holds the token count (prompt + completion) of each sample of group
    g. Deterministic (ties broken by index), so every rank computes the same deal.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    costs = [group_cost(lengths, balance) for lengths in group_lengths]
    tokens = [sum(lengths) for lengths in group_lengths]
    order = sorted(range(len(costs)), key=lambda g: (-costs[g], -tokens[g], g))
    deal = GroupDeal([[] for _ in range(world_size)], [0] * world_size, [0.0] * world_size)
    for g in order:
        rank = min(range(world_size), key=lambda r: (deal.cost[r], deal.tokens[r], r))
        deal.groups[rank].append(g)
        deal.cost[rank] += costs[g]
        deal.tokens[rank] += tokens[g]
    for groups in deal.groups:
        groups.sort()
    return deal


def pad_plan(plan: list[list[int]], count: int) -> list[list[int]]:
    """A micro-batch plan grown to `count` entries with empty micro-batches ([])."""
    if count < len(plan):
        raise ValueError(f"cannot pad a plan of {len(plan)} micro-batches down to {count}")
    return [*plan, *([] for _ in range(count - len(plan)))]


def equal_micro_batch_plan(ctx: DistContext, plan: list[list[int]]) -> list[list[int]]:
    """This rank's plan padded to the largest micro-batch count over ranks (one all-reduce)."""
    return pad_plan(plan, ctx.max_int(len(plan)))


# ----------------------------------------------------------------- padding micro-batches


def padding_batch(token_id: int, device: torch.device | str = "cpu") -> PackedBatch:
    """A one-token micro-batch for a rank with fewer real ones than its peers.

    Every rank must run the same number of forwards and backwards, since each one gathers
    and reduce-scatters parameters with the others. The padding batch runs both (see
    `padding_pass`) and contributes exactly zero gradient.
    """
    ints = {
        name: torch.tensor(value, dtype=torch.int64, device=device)
        for name, value in {
            "input_ids": [[token_id]],
            "position_ids": [[0]],
            "cu_seqlens": [0, 1],
            "completion_index": [0],
            "targets": [token_id],
            "token_seq": [0],
            "completion_lens": [1],
            "sample_index": [-1],
        }.items()
    }
    return PackedBatch(
        max_seqlen=1,
        padding=True,
        advantages=torch.zeros(1, device=device),
        truncated=torch.zeros(1, dtype=torch.bool, device=device),
        behaviour_logprobs=torch.zeros(1, device=device),
        **ints,
    )


def padding_pass(
    scorer: nn.Module,
    batch: PackedBatch,
    sampling,
    logprob_cfg,
    *,
    backward: bool,
    with_entropy: bool = False,
    teacher=None,
) -> None:
    """Forward (and backward with a zero upstream gradient) through every unit; with
    `teacher` (contracts.TeacherRows, distill.objective: jsd) the divergence's pass."""
    if teacher is None:
        outputs = scorer(batch, sampling, logprob_cfg, with_entropy=with_entropy)
    else:
        outputs = scorer(batch, sampling, logprob_cfg, with_entropy=True, teacher=teacher)
    if backward and torch.is_grad_enabled():
        outputs = [t for t in outputs if t is not None and t.requires_grad]
        torch.autograd.backward(outputs, [torch.zeros_like(t) for t in outputs])


def is_padding(batch: PackedBatch) -> bool:
    return batch.padding
