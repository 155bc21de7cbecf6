"""A packed row laid over a context-parallel group, and the split of one process.

The row of N real tokens is padded to C x ceil(N / C) tokens and cut into C contiguous
shards of equal length; rank c holds shard c. The padding is a segment of its own (token
id 0, positions from 0): in the plain layout one more `cu_seqlens` boundary, in the
shared-prefix layout one more group with a prompt and no completion, so its tokens attend
only to each other, no real token attends to them, and none is ever predicted. A row
shorter than C leaves whole shards of padding; every rank still holds >= 1 token, so
every rank runs every layer (and every collective inside it).

A rank scores the completion tokens whose *predicting* position lies in its shard: the
hidden state at position p predicts the target at p + 1, which may lie in the next shard
(a shard's last token predicts the next shard's first); the targets come from the whole
row, which every rank of the group holds, so a boundary needs no exchange.

`contracts.LocalRow` is what the scoring forward runs on (model/scoring.py): the shard's ids and
positions, the whole row's attention kwargs (the kernels attend over the whole row, see
ulysses.py), this rank's completion positions and targets, and which of the row's T
completion tokens they are. `WHOLE_ROW` is the split of one process: the row itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from leangrpo.contracts import LocalRow, PackedBatch
from leangrpo.ops.attention.adapter import packed_model_kwargs
from leangrpo.ops.attention.layout import GroupSpan, PrefixLayout

PAD_TOKEN_ID = 0  # every vocabulary has an id 0; padding is never predicted


@dataclass(frozen=True)
class RowShards:
    """N real tokens over `size` ranks: equal contiguous shards of a padded row."""

    tokens: int  # real tokens in the row
    size: int  # ranks in the context-parallel group

    @property
    def per_rank(self) -> int:
        return max(1, -(-self.tokens // self.size))

    @property
    def padded(self) -> int:
        return self.per_rank * self.size

    @property
    def padding(self) -> int:
        return self.padded - self.tokens

    def bounds(self, rank: int) -> tuple[int, int]:
        """[start, end) of shard `rank` in the padded row."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a context-parallel group of {self.size}")
        return rank * self.per_rank, (rank + 1) * self.per_rank


def whole_row(batch: PackedBatch) -> LocalRow:
    """A process's own row: nothing split."""
    return LocalRow(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        model_kwargs=packed_model_kwargs(batch),
        completion_index=batch.completion_index,
        targets=batch.targets,
        tokens=None,
        num_targets=batch.num_completion_tokens,
        routes=batch.routes,
        sequences_per_position=_sequences_per_position(batch, 0, batch.num_tokens),
    )


def _sequences_per_position(batch: PackedBatch, start: int, end: int) -> Tensor | None:
    """Positions [start, end) of a shared-prefix row: sequences each belongs to; None for
    the plain layout (one each)."""
    layout = getattr(batch, "prefix", None)
    if layout is None:
        return None
    return layout.sequences_per_position(batch.input_ids.device)[start:end]


class WholeRow:
    """The split of one process (and of a context-parallel group of one): the whole row,
    log-probs as computed. `contracts.RowSplit`."""

    size = 1

    def local_row(self, batch: PackedBatch) -> LocalRow:
        return whole_row(batch)

    def gather(
        self, logprobs: Tensor, entropy: Tensor | None, row: LocalRow
    ) -> tuple[Tensor, Tensor | None]:
        return logprobs, entropy

    def sum_over_group(self, values: Tensor) -> Tensor:
        return values


WHOLE_ROW = WholeRow()


def padded_row_kwargs(batch: PackedBatch, shards: RowShards) -> dict[str, Any]:
    """The packed-attention kwargs of the padded row (padding as a segment of its own)."""
    kwargs = packed_model_kwargs(batch)
    pad = shards.padding
    if not pad:
        return kwargs
    layout = getattr(batch, "prefix", None)
    if layout is not None:
        spans = (*layout.groups, GroupSpan(shards.tokens, pad, (), ()))
        return packed_model_kwargs(_Prefixed(PrefixLayout(spans, shards.padded)))
    cu = batch.cu_seqlens
    cu = torch.cat([cu, cu.new_tensor([shards.padded])])
    longest = max(batch.max_seqlen, pad)
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


@dataclass(frozen=True)
class _Prefixed:
    """What packed_model_kwargs reads of a shared-prefix batch: its layout."""

    prefix: PrefixLayout


def shard_row(
    batch: PackedBatch, shards: RowShards, rank: int, extra_kwargs: dict[str, Any]
) -> LocalRow:
    """Rank `rank`'s shard of `batch` (laid out by `shards`), with the whole row's
    attention kwargs plus `extra_kwargs` (the split's own, read by the attention)."""
    start, end = shards.bounds(rank)
    ids, positions = _padded_slice(batch, shards, start, end)
    index = batch.completion_index
    mine = torch.nonzero((index >= start) & (index < end)).squeeze(1)
    return LocalRow(
        input_ids=ids,
        position_ids=positions,
        model_kwargs={**padded_row_kwargs(batch, shards), **extra_kwargs},
        completion_index=index[mine] - start,
        targets=batch.targets[mine],
        tokens=mine,
        num_targets=batch.num_completion_tokens,
        routes=None if batch.routes is None else batch.routes[mine],
        real_tokens=max(0, min(end, shards.tokens) - start),
        sequences_per_position=_sequences_per_position(batch, start, min(end, shards.tokens)),
    )


def _padded_slice(batch: PackedBatch, shards: RowShards, start: int, end: int):
    """(1, end - start) ids and positions of the padded row."""
    real = shards.tokens
    ids = batch.input_ids[:, start : min(end, real)]
    positions = batch.position_ids[:, start : min(end, real)]
    if end <= real:
        return ids, positions
    first = max(start, real) - real  # offset of this slice's padding in the padding segment
    count = end - max(start, real)
    pad_pos = torch.arange(first, first + count, device=ids.device, dtype=positions.dtype)
    pad_ids = torch.full((count,), PAD_TOKEN_ID, device=ids.device, dtype=ids.dtype)
    return (
        torch.cat([ids, pad_ids.view(1, -1)], dim=1),
        torch.cat([positions, pad_pos.view(1, -1)], dim=1),
    )
