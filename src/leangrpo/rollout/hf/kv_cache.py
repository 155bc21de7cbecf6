"""A KV-cache layer for the hf engine's decode loop that does not re-copy itself each step.

transformers' `DynamicLayer` grows by `torch.cat([keys, new])`: every decode step copies
the whole cache (O(length) per step, O(length^2) per completion). This layer
keeps keys and values in buffers with room for `capacity` positions (prompt width + max
new tokens, known before the prefill) and exposes `keys` / `values` as views of the
filled part; a step writes one column. Repeating rows (n samples per prompt) and
selecting rows (finished rows leave the batch) copy the buffers whole (one copy; the
unfilled part is never read). Used only for full-attention layers (sliding-window layers keep
transformers' own classes); the loop never crops the cache.
"""

from __future__ import annotations

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
