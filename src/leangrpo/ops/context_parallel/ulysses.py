"""Ulysses: context parallelism by an all-to-all around attention (DeepSpeed-Ulysses).

Each rank of a group of C holds 1/C of a packed row's tokens (shards.py) for everything
that works token by token (embeddings, projections, norms, MLP, the lm_head). Attention
alone needs the whole row, so around it the layout switches from sequence shards to head
shards and back:

    q (1, H, n, D), k, v (1, K, n, D)   this rank's n tokens, every head
      -- all-to-all -->  (1, H/C, N, D) and (1, K'/C, N, D): the whole row, 1/C of the heads
      -- the packed kernel the run registered (plain, shared prefix, multi-turn alike) -->
    (1, N, H/C, D)  -- all-to-all -->  (1, n, H, D)

q, k and v travel in one all-to-all (each destination's heads of the three, flattened),
the output in another; their backward is the same exchange run on the gradients. With
fewer key/value heads than C (K % C != 0) each key/value head is repeated r = lcm(K, C) / K
times first, which keeps grouped-query attention's query-to-key mapping on every rank
(query head h reads key head h // (H / K')); the repeat's backward sums the copies. H must
be a multiple of C (checked before the run starts; a ring strategy would lift it).

Every rank attends over the whole row for its heads: the attention work is the same on
every rank whatever the shard boundaries, so equal token counts balance the rest (the
causal imbalance of contiguous shards, which zigzag layouts fix for ring attention, does
not arise here).

Log-probs: each rank scores the completion tokens its shard predicts; `gather` puts them
back into the row's (T,) order on every rank of the group (one sum over the group, exact:
every entry has one contributor, the others add 0). Every rank then computes the same
loss over the whole micro-batch; the gather's backward hands each rank the gradient of
its own entries only, so the group's gradients add up to the micro-batch's gradient once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from leangrpo.ops.attention.adapter import CONTEXT_KWARG
from leangrpo.ops.attention.kernels import AttentionSetupError
from leangrpo.ops.context_parallel.exchange import Exchange
from leangrpo.ops.context_parallel.shards import RowShards, shard_row

if TYPE_CHECKING:
    from leangrpo.contracts import LocalRow, PackedBatch


def kv_repeats(kv_heads: int, size: int) -> int:
    """How many times each key/value head is repeated so that C ranks split them evenly."""
    return math.lcm(kv_heads, size) // kv_heads


class Ulysses:
    """`contracts.RowSplit` of rank `rank` in a context-parallel group of `size`."""

    def __init__(self, exchange: Exchange, rank: int, size: int):
        if size < 2:
            raise ValueError(f"Ulysses needs a group of >= 2 ranks, got {size}")
        self.exchange, self.rank, self.size = exchange, rank, size

    def local_row(self, batch: PackedBatch) -> LocalRow:
        shards = RowShards(batch.num_tokens, self.size)
        return shard_row(batch, shards, self.rank, {CONTEXT_KWARG: self})

    def gather(
        self, logprobs: Tensor, entropy: Tensor | None, row: LocalRow
    ) -> tuple[Tensor, Tensor | None]:
        """This rank's (T_c,) log-probs (and entropies) -> the row's (T,) on every rank."""
        parts = [logprobs] if entropy is None else [logprobs, entropy.to(logprobs.dtype)]
        full = _GatherTokens.apply(torch.stack(parts), row.tokens, row.num_targets, self.exchange)
        # rows of their own (a view of the stacked rows would be the FSDP root's output)
        values = [v.clone() for v in full]
        return values[0], (None if entropy is None else values[1])

    def sum_over_group(self, values: Tensor) -> Tensor:
        """The element-wise sum of `values` over the group (no gradient: figures, counts)."""
        return self.exchange.all_reduce_sum(values.detach().clone())

    def attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        run: Callable[[Tensor, Tensor, Tensor], Tensor],
    ) -> Tensor:
        """(1, n, H, D) attention output of this rank's tokens; `run(q, k, v)` is the packed
        kernel over the whole row, (1, h, N, D) in and (1, N, h, D) out."""
        c, heads = self.size, query.shape[1]
        if heads % c:
            raise AttentionSetupError(
                f"Ulysses splits attention heads over the context-parallel group: {heads} query "
                f"heads cannot be split over {c} ranks; choose a distributed.context_parallel_size "
                f"that divides {heads}"
            )
        repeats = kv_repeats(key.shape[1], c)
        if repeats > 1:
            key = key.repeat_interleave(repeats, dim=1)
            value = value.repeat_interleave(repeats, dim=1)
        q, k, v = _to_heads([query, key, value], c, self.exchange)
        out = run(q, k, v)  # (1, N, H / C, D)
        return _to_tokens(out, c, self.exchange)


def _to_heads(tensors: list[Tensor], c: int, exchange: Exchange) -> list[Tensor]:
    """(1, h, n, D) per tensor, this rank's tokens -> (1, h / C, C n, D), the whole row."""
    n = tensors[0].shape[2]
    chunks = [t[0].reshape(c, t.shape[1] // c, n, t.shape[3]) for t in tensors]
    sizes = [x[0].numel() for x in chunks]
    flat = torch.cat([x.reshape(c, -1) for x in chunks], dim=1)
    received = _AllToAll.apply(flat, exchange)  # (C, sum of sizes): chunk i from rank i
    out = []
    for x, part in zip(chunks, received.split(sizes, dim=1)):
        h, d = x.shape[1], x.shape[3]
        whole = part.reshape(c, h, n, d).permute(1, 0, 2, 3).reshape(1, h, c * n, d)
        out.append(whole)
    return out


def _to_tokens(out: Tensor, c: int, exchange: Exchange) -> Tensor:
    """(1, C n, h, D), the whole row for this rank's heads -> (1, n, C h, D), its tokens."""
    _, length, h, d = out.shape
    n = length // c
    received = _AllToAll.apply(out[0].reshape(c, n * h * d), exchange)  # chunk j: rank j's heads
    return received.reshape(c, n, h, d).permute(1, 0, 2, 3).reshape(1, n, c * h, d)


class _AllToAll(torch.autograd.Function):
    """Chunk i to rank i; the backward sends each chunk's gradient back where it came from
    (the same exchange on the gradients)."""

    @staticmethod
    def forward(ctx, chunks: Tensor, exchange: Exchange) -> Tensor:
        ctx.exchange = exchange
        return exchange.all_to_all(chunks.contiguous())

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.exchange.all_to_all(grad.contiguous()), None


class _GatherTokens(torch.autograd.Function):
    """(k, T_c) values of this rank's tokens -> (k, T) for the whole row, on every rank."""

    @staticmethod
    def forward(ctx, local: Tensor, tokens: Tensor, total: int, exchange: Exchange) -> Tensor:
        ctx.save_for_backward(tokens)
        full = local.new_zeros(local.shape[0], total)
        full[:, tokens] = local
        return exchange.all_reduce_sum(full)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # every rank computes the same loss from the same (T,) values: each takes the
        # gradient of its own entries, so the group's sum is the micro-batch's gradient
        (tokens,) = ctx.saved_tensors
        return grad[:, tokens], None, None, None
