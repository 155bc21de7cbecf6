"""The collectives a context-parallel split runs among the ranks of its group.

`Exchange` is what ulysses.py needs: an all-to-all of equal chunks and a sum. `GroupExchange`
runs them on a torch.distributed process group (gloo on CPU, NCCL on GPUs), created with
the run's `distributed.timeout_s` (distributed/mesh.py), so a peer that dies or hangs
inside an exchange makes this rank raise within the timeout like any other collective.
Tests put a thread-backed exchange in its place to run a group's ranks in one process.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class Exchange(Protocol):
    """Collectives over one context-parallel group; every rank calls each, in one order."""

    def all_to_all(self, chunks: Tensor) -> Tensor:
        """(C, ...) in, chunk i sent to rank i; (C, ...) out, chunk i received from rank i."""
        ...

    def all_reduce_sum(self, values: Tensor) -> Tensor:
        """The element-wise sum over the group (may work in place)."""
        ...


class GroupExchange:
    """`Exchange` on a torch.distributed process group."""

    def __init__(self, group: Any):
        self.group = group

    def all_to_all(self, chunks: Tensor) -> Tensor:
        out = torch.empty_like(chunks)
        dist.all_to_all_single(out, chunks.contiguous(), group=self.group)
        return out

    def all_reduce_sum(self, values: Tensor) -> Tensor:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
        return values
