"""Data parallelism across torchrun processes: the context, collectives that cannot hang
silently, and a phase tracker.

- `init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR, MASTER_PORT). World size 1 creates no process group and every collective
  below returns at once: a single process has nothing that can hang.
- Every collective runs under the process group's timeout (`distributed.timeout_s`): gloo
  raises when it expires or a peer's connection drops; NCCL's watchdog aborts it.
- Phases (setup, generate, score, train, sync, checkpoint) name what a rank is doing. A
  failure leaving `ctx.phase(...)` becomes one line on every rank naming the rank that
  failed and its phase, and is fatal even when a collective would block the exit: the
  heartbeats, failure records and backstop that do this are in watch.py.
`reduce_dict_over_ranks` reduces a metrics dict element-wise over ranks. See
docs/distributed.md ("World size 1 is untouched", "Timeouts").
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from leangrpo.distributed.watch import DistributedError, _Watch

PHASES = ("setup", "generate", "score", "train", "sync", "checkpoint", "shutdown")


# ---------------------------------------------------------------------------- the context


@dataclass
class DistContext:
    """Where this process sits among the trainer ranks, and the collectives it may call.

    Every rank must call each collective method in the same order. At world size 1 they
    return their input (there is no process group).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    timeout_s: float = 600.0
    wait_s: float = 0.0  # seconds spent in this context's collectives (mostly waiting)
    _watch: _Watch | None = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def comm_device(self) -> torch.device:
        """Where collective tensors live: the GPU for NCCL, the host for gloo."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run a block as phase `name`; a failure inside becomes one clear line on every rank."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; one of {PHASES}")
        if self._watch is None:
            yield
            return
        outer = self._watch.enter(name)
        try:
            yield
        except DistributedError:
            raise
        except Exception as exc:
            if getattr(exc, "_leangrpo_reported", False):  # an inner phase handled it
                raise
            error = self._watch.failure(name, exc)
            if error is not None:
                raise error from exc
            with contextlib.suppress(AttributeError):
                exc._leangrpo_reported = True  # type: ignore[attr-defined]
            raise
        finally:
            self._watch.leave(outer)

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - start

    def all_reduce(self, values: Sequence[float], op: str = "sum", group: Any = None) -> list[float]:
        """Element-wise sum / max / min of `values` over ranks (float64); over `group`'s
        ranks when given (a group of the mesh, distributed/mesh.py)."""
        if not self.distributed:
            return [float(v) for v in values]
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.comm_device)
        with self._timed():
            dist.all_reduce(t, op=ops[op], group=group)
        return t.tolist()

    def all_true(self, flag: bool) -> bool:
        """True on every rank iff `flag` is True on every rank (e.g. the finite-update check)."""
        return bool(self.all_reduce([1.0 if flag else 0.0], op="min")[0])

    def max_int(self, value: int) -> int:
        return int(self.all_reduce([value], op="max")[0])

    def barrier(self) -> float:
        """Wait for every rank; returns (and adds to `wait_s`) the seconds spent waiting."""
        if not self.distributed:
            return 0.0
        start = time.perf_counter()
        self.all_reduce([0.0])  # a tiny all-reduce: a barrier that honours the timeout everywhere
        return time.perf_counter() - start

    def all_gather_object(self, obj: Any, group: Any = None) -> list[Any]:
        """Every rank's `obj` (of `group`'s ranks when given), in rank order."""
        if not self.distributed:
            return [obj]
        size = self.world_size if group is None else dist.get_world_size(group)
        out: list[Any] = [None] * size
        with self._timed():
            dist.all_gather_object(out, obj, group=group)
        return out

    def gather_to_main(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (in rank order); None on the other ranks."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        with self._timed():
            dist.gather_object(obj, out, dst=0)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        with self._timed():
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def new_group(self) -> Any:
        """Another process group over every rank, on the host (gloo), with the timeout: for
        collectives another thread runs (the async producer's sample exchange), which
        must not share a sequence of operations with the main thread's. Every rank calls it."""
        if not self.distributed:
            return None
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))

    def shutdown(self) -> None:
        """Leave the group: the last collective, then the process group goes away."""
        if self._watch is None:
            return
        with self.phase("shutdown"):
            self._watch.stop()
            self.barrier()
        dist.destroy_process_group()
        self._watch = None


def reduce_dict_over_ranks(ctx: DistContext, metrics: dict[str, float], op: str = "mean") -> dict:
    """Reduce a metrics dict over ranks (every rank must pass the same keys in any order)."""
    if not ctx.distributed:
        return dict(metrics)
    keys = sorted(metrics)
    if op == "mean":
        values = ctx.all_reduce([metrics[k] for k in keys], "sum")
        return {k: v / ctx.world_size for k, v in zip(keys, values)}
    return dict(zip(keys, ctx.all_reduce([metrics[k] for k in keys], op)))


def init_distributed(dist_cfg, device_setting: str = "auto") -> DistContext:
    """The context from torchrun's environment; a process group only when WORLD_SIZE > 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device_setting == "cuda" or (device_setting == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if world_size == 1:
        return DistContext(device=device, timeout_s=dist_cfg.timeout_s)
    backend = dist_cfg.backend if dist_cfg.backend != "auto" else ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ValueError("distributed.backend is 'nccl' but the ranks run on CPU; use gloo")
    if cuda:
        torch.cuda.set_device(device)
    if backend == "nccl":  # a timed-out NCCL op raises in Python instead of tearing down
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    # CPU-offloaded shards live in host memory: their gathers (weight sync, norms) need gloo
    spec = "cpu:gloo,cuda:nccl" if backend == "nccl" and dist_cfg.cpu_offload else backend
    dist.init_process_group(
        spec,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=dist_cfg.timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    ctx = DistContext(rank, world_size, local_rank, device, backend, dist_cfg.timeout_s)
    ctx._watch = _Watch(rank, world_size, dist_cfg.timeout_s, _store_client(dist_cfg.timeout_s))
    with ctx.phase("setup"):
        ctx.barrier()  # every heartbeat key exists before anyone reads them
    return ctx


def _store_client(timeout_s: float) -> dist.Store:
    """A connection of our own to the rendezvous store (torchrun's agent store, or rank 0's)."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=min(timeout_s, 30.0)),
    )
