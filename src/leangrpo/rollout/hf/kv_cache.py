"""KV caches of the hf engine: the decode loop's layer, and the continuous batch's slots.

`PreallocatedLayer` (decode.py, single-turn): a layer that does not re-copy itself each step.

transformers' `DynamicLayer` grows by `torch.cat([keys, new])`: every decode step copies
the whole cache (O(length) per step, O(length^2) per completion). This layer
keeps keys and values in buffers with room for `capacity` positions (prompt width + max
new tokens, known before the prefill) and exposes `keys` / `values` as views of the
filled part; a step writes one column. Repeating rows (n samples per prompt) and
selecting rows (finished rows leave the batch) copy the buffers whole (one copy; the
unfilled part is never read). Used only for full-attention layers (sliding-window layers keep
transformers' own classes); the loop never crops the cache.

`SlotCache`, `Kept`, `KeptCaches` (turns.py, multi-turn): the rows of a continuous batch
that sequences join and leave between decode steps, and each trajectory's cache kept
between its turns (least recently used first, for eviction under a budget).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """`DynamicLayer` semantics (keys/values (b, heads, length, D)) on preallocated buffers."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.buffers: list[torch.Tensor] | None = None  # keys, values: (b, heads, size, D)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self.buffers is None or end > self.buffers[0].shape[-2]:  # first call, or full
            size = max(end, self.capacity if self.buffers is None else 2 * end)
            self.buffers = [self._grown(old, new, size) for old, new in zip(
                self.buffers or (None, None), (key_states, value_states))]  # fmt: skip
        for buffer, new in zip(self.buffers, (key_states, value_states)):
            buffer[:, :, self.length : end].copy_(new)
        self.length = end
        return self._views()

    def _grown(self, old: torch.Tensor | None, new: torch.Tensor, size: int) -> torch.Tensor:
        """An empty (b, heads, size, D) buffer holding `old`'s filled part."""
        buffer = new.new_empty(new.shape[0], new.shape[1], size, new.shape[3])
        if old is not None:
            buffer[:, :, : self.length] = old[:, :, : self.length]
        return buffer

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Rows repeated; the whole buffers are copied (one copy, capacity ~ the final size)."""
        if self.buffers is not None:
            self.buffers = [b.repeat_interleave(repeats, dim=0) for b in self.buffers]
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.buffers is not None:
            self.buffers = [b.index_select(0, indices) for b in self.buffers]
            self._views()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("leangrpo's decode loop never crops its cache")

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = (b[:, :, : self.length] for b in self.buffers)
        return self.keys, self.values


class SlotCache:
    """The continuous batch's KV cache (rollout/hf/turns.py): per layer one K and one V
    buffer (rows, kv heads, width, head dim), grown by doubling; row i holds sequence i
    from position 0, right-padded to the batch's width (each row has its own mask row).

    Before each forward the caller says where the new tokens go (`prepare`): rows
    [first, first + count) of the buffers, and for each real token its row and position.
    `update` (what transformers' attention layers call) writes the layer's new keys and
    values there and returns views of rows [first, first + count) up to `width`. Padding
    tokens of a forward (left padding of a batched prefill) are never written.
    """

    def __init__(self, num_layers: int):
        self.buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.rows = 0  # rows and width every allocated buffer has
        self.width = 0
        self._first = self._count = self._view_width = self._query_offset = 0
        self._where: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    @property
    def allocated(self) -> int:
        """KV positions the buffers hold room for (rows x width)."""
        return self.rows * self.width if any(b is not None for b in self.buffers) else 0

    def resize(self, rows: int, width: int) -> None:
        """Room for `rows` x `width` positions; what buffers hold within both is kept (the
        caller never shrinks below a row or position in use)."""
        if (rows, width) == (self.rows, self.width):
            return
        for i, pair in enumerate(self.buffers):
            if pair is not None:
                self.buffers[i] = tuple(_regrown(b, rows, width) for b in pair)
        self.rows, self.width = rows, width

    def prepare(
        self,
        first: int,
        count: int,
        width: int,
        rows: torch.Tensor,  # (T,) buffer row of each real token
        positions: torch.Tensor,  # (T,) its position
        real: torch.Tensor | None = None,  # (count * q_len,) bool: which tokens are real; None: all
        query_offset: int = 0,  # position of the first query (a forward without a mask)
    ) -> None:
        self._first, self._count, self._view_width = first, count, width
        self._where = (rows, positions, real)
        self._query_offset = query_offset

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write the forward's new keys/values (count, heads, q_len, D); return the views."""
        pair = self.buffers[layer_idx]
        if pair is None:
            pair = self.buffers[layer_idx] = tuple(
                s.new_zeros(self.rows, s.shape[1], self.width, s.shape[3])
                for s in (key_states, value_states)
            )
        rows, positions, real = self._where
        for buffer, new in zip(pair, (key_states, value_states)):
            tokens = new.transpose(1, 2).reshape(-1, new.shape[1], new.shape[3])  # (count*q, H, D)
            buffer[rows, :, positions] = tokens if real is None else tokens[real]
        end = self._first + self._count
        return tuple(b[self._first : end, :, : self._view_width] for b in pair)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    # transformers builds the mask from these when a forward passes none (every row of the
    # forward attends its whole width: plain causal)
    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._query_offset

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._view_width, 0

    def read_row(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of row `row`'s first `length` positions, (1, heads, length, D) per layer."""
        return [
            tuple(b[row : row + 1, :, :length].clone() for b in pair)
            for pair in self.buffers
            if pair is not None
        ]

    def load_row(self, row: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy kept keys/values (one (1, heads, length, D) pair per layer) into row `row`."""
        for i, (keys, values) in enumerate(layers):
            if self.buffers[i] is None:
                self.buffers[i] = tuple(
                    t.new_zeros(self.rows, t.shape[1], self.width, t.shape[3])
                    for t in (keys, values)
                )
            for buffer, kept in zip(self.buffers[i], (keys, values)):
                buffer[row, :, : kept.shape[2]] = kept[0]

    def move_row(self, source: int, target: int) -> None:
        for pair in self.buffers:
            if pair is not None:
                for buffer in pair:
                    buffer[target] = buffer[source]


def _regrown(old: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    new = old.new_zeros(rows, old.shape[1], width, old.shape[3])
    keep_rows, keep_width = min(rows, old.shape[0]), min(width, old.shape[2])
    new[:keep_rows, :, :keep_width] = old[:keep_rows, :, :keep_width]
    return new


@dataclass
class Kept:
    """A trajectory's KV cache between two turns: the keys/values of `ids`, per layer
    (1, heads, len(ids), D)."""

    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]


class KeptCaches:
    """Kept caches by trajectory key, least recently used first."""

    def __init__(self) -> None:
        self._entries: OrderedDict[int, Kept] = OrderedDict()
        self.tokens = 0

    def put(self, key: int, kept: Kept) -> None:
        self.drop(key)
        self._entries[key] = kept
        self.tokens += len(kept.ids)

    def take(self, key: int) -> Kept | None:
        kept = self._entries.pop(key, None)
        if kept is not None:
            self.tokens -= len(kept.ids)
        return kept

    def drop(self, key: int) -> bool:
        return self.take(key) is not None

    def evict_oldest(self) -> bool:
        """Forget the least recently used cache; False when none is left."""
        if not self._entries:
            return False
        self.take(next(iter(self._entries)))
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0
