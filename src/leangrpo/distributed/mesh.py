"""The data-parallel x context-parallel mesh of a torchrun run.

W processes form a D x C mesh (C = `distributed.context_parallel_size`, D = W / C):
process r sits at (d, c) = (r // C, r % C), so a context-parallel group is C consecutive
ranks (on one node, where its all-to-alls are cheapest) and a data-parallel group the D
ranks with the same c.

- The C ranks of a context group ("a share") train on the same micro-batches, each on its
  1/C of every row (ops/context_parallel); the row's all-to-alls and the log-prob gather
  run on `context_group`.
- Whole prompt groups are dealt to the D shares (`data_rank` of `data_size`); the loss
  normalisers and the step's loss metrics are reduced over `data_group`, which counts each
  share once (its C ranks hold the same counts).
- FSDP2 shards parameters, gradients and optimizer state over all W ranks (the mesh
  flattened: the default group, in rank order) and averages gradients over W; the
  gradient norm, the skip decision and stop signals are reduced over all W.

Every group is created on every rank, in one order, with `distributed.timeout_s`. With C = 1
no group is created: the data group is the default one. See
docs/context-parallel.md ("The mesh").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from leangrpo.contracts import RowSplit
from leangrpo.distributed.context import DistContext
from leangrpo.errors import UserError
from leangrpo.model.scoring import causal_lm
from leangrpo.ops.attention.adapter import packed_support
from leangrpo.ops.context_parallel.exchange import GroupExchange
from leangrpo.ops.context_parallel.shards import WHOLE_ROW
from leangrpo.ops.context_parallel.ulysses import Ulysses, kv_repeats

log = logging.getLogger("leangrpo")


@dataclass(frozen=True)
class ParallelMesh:
    """Where this process sits in the D x C mesh, and the groups of its row and column."""

    data_size: int  # D: shares of each step's groups
    context_size: int  # C: ranks that split one row
    data_rank: int  # d
    context_rank: int  # c
    data_group: Any = None  # the D ranks with this c (None: the default group, C = 1)
    context_group: Any = None  # the C ranks of this share (None: C = 1)

    @property
    def world_size(self) -> int:
        return self.data_size * self.context_size

    def split(self) -> RowSplit:
        """How this rank's scoring forward splits a row: Ulysses over its context group."""
        if self.context_size == 1:
            return WHOLE_ROW
        return Ulysses(GroupExchange(self.context_group), self.context_rank, self.context_size)

    def share_leaders(self, per_rank: list[Any]) -> list[Any]:
        """From one entry per process (rank order), the entries of each share's first rank."""
        return per_rank[:: self.context_size]


def build_mesh(ctx: DistContext, context_size: int) -> ParallelMesh:
    """The mesh of `ctx`'s processes with context groups of `context_size` (every rank
    calls it: the groups are created collectively)."""
    world = ctx.world_size
    if context_size < 1 or world % context_size:
        raise ValueError(
            f"distributed.context_parallel_size ({context_size}) must divide the number of "
            f"processes ({world})"
        )
    data_size = world // context_size
    d, c = divmod(ctx.rank, context_size)
    if context_size == 1:
        return ParallelMesh(data_size, 1, d, c)
    timeout = timedelta(seconds=ctx.timeout_s)
    contexts = [
        dist.new_group([k * context_size + j for j in range(context_size)], timeout=timeout)
        for k in range(data_size)
    ]
    datas = [
        dist.new_group([k * context_size + j for k in range(data_size)], timeout=timeout)
        for j in range(context_size)
    ]
    return ParallelMesh(data_size, context_size, d, c, datas[c], contexts[d])


class ContextParallelError(UserError):
    """The model's attention cannot be split over a context-parallel group."""


def check_splittable(model, mesh: ParallelMesh, key: str | None = None) -> str:
    """Refuse, in one sentence, a model whose rows Ulysses cannot split over the context
    group; else the log line saying how they are split. `model`: the loaded policy model
    (or a distillation teacher, named by its config `key`), its packed attention enabled
    (which probed what reaches its attention function)."""
    lm = causal_lm(model)
    name, config, c = type(lm).__name__, lm.config, mesh.context_size
    name = f"{name} ({key})" if key else name
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    layers = config.num_hidden_layers
    support = packed_support(model)
    fix = "train it with distributed.context_parallel_size: 1"
    if heads % c:
        why = f"its {heads} query heads cannot be split over {c} ranks (Ulysses gives each rank H / C heads); choose a distributed.context_parallel_size that divides {heads}, or"
    elif support is None or support.padded_view:
        why = "its attention does not receive leangrpo's packed kwargs (it runs on a padded view), so the attention cannot be told to gather the whole row;"
    elif support.context_layers != layers:
        why = f"only {support.context_layers} of its {layers} decoder layers mix tokens through the attention function, so the other layers would see this rank's shard of the row only;"
    else:
        return describe_split(mesh, heads, kv_heads)
    raise ContextParallelError(f"{name} cannot be context-parallel: {why} {fix}.")


def describe_split(mesh: ParallelMesh, heads: int, kv_heads: int) -> str:
    """The log line of a context-parallel run: the mesh and what each rank holds."""
    text = (
        f"context parallelism: {mesh.world_size} processes as {mesh.data_size} data-parallel "
        f"x {mesh.context_size} context-parallel (Ulysses); each rank holds 1/{mesh.context_size} "
        f"of every row and attends over the whole row for {heads // mesh.context_size} of "
        f"{heads} query heads"
    )
    repeats = kv_repeats(kv_heads, mesh.context_size)
    if repeats > 1:
        how = "are fewer than" if kv_heads < mesh.context_size else "do not divide evenly over"
        text += (
            f"; the model's {kv_heads} key/value heads {how} the {mesh.context_size} ranks, "
            f"so each is replicated {repeats}x across the group"
        )
    return text
