"""The shared-prefix row layout the attention kernels read: where each group's prompt and
its completions sit in a packed row (`GroupSpan`), and the whole row's segmentation
(`PrefixLayout`, host-side, with per-device caches of the segment tensors flex needs).
train/packing.py builds it; ops/attention reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class GroupSpan:
    """Where one group's shared prompt and its completions sit in the packed row."""

    prompt_start: int
    prompt_len: int
    completion_starts: tuple[int, ...]
    completion_lens: tuple[int, ...]


@dataclass
class PrefixLayout:
    """Host-side segmentation of a shared-prefix row (read by the attention adapter)."""

    groups: tuple[GroupSpan, ...]
    num_tokens: int
    _device_cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def max_segment_len(self) -> int:
        return max(max(g.prompt_len, *g.completion_lens) for g in self.groups)

    def sequences_per_position(self, device: torch.device) -> Tensor:
        """(N,) float: how many sequences each position belongs to, a group's prompt
        positions to each of its completions, a completion's to one (what the plain layout
        would hold of it); cached per device. MoE statistics weigh positions by it."""
        key = ("sequences", str(device))
        if key not in self._device_cache:
            counts, lens = [], []
            for g in self.groups:
                counts += [len(g.completion_lens)] + [1] * len(g.completion_lens)
                lens += [g.prompt_len, *g.completion_lens]
            per = torch.tensor(counts, dtype=torch.float32).repeat_interleave(torch.tensor(lens))
            self._device_cache[key] = per.to(device)
        return self._device_cache[key]

    def segment_ids(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """(group_of, segment_of, is_prompt), each (N,), cached per device; used by flex."""
        key = ("segments", str(device))
        if key not in self._device_cache:
            self._device_cache[key] = _segment_tensors(self.groups, device)
        return self._device_cache[key]


def _segment_tensors(groups: tuple[GroupSpan, ...], device) -> tuple[Tensor, Tensor, Tensor]:
    seg_lens = [n for g in groups for n in (g.prompt_len, *g.completion_lens)]
    seg_group = [i for i, g in enumerate(groups) for _ in range(1 + len(g.completion_lens))]
    seg_prompt = [j == 0 for g in groups for j in range(1 + len(g.completion_lens))]
    lens = torch.tensor(seg_lens)
    group_of = torch.repeat_interleave(torch.tensor(seg_group, dtype=torch.int32), lens)
    segment_of = torch.repeat_interleave(torch.arange(len(seg_lens), dtype=torch.int32), lens)
    is_prompt = torch.repeat_interleave(torch.tensor(seg_prompt), lens)
    return group_of.to(device), segment_of.to(device), is_prompt.to(device)
