"""Data parallelism across torchrun processes: the context, collectives that cannot hang
silently, a phase tracker, and the dealing of prompt groups to ranks.

- `init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR, MASTER_PORT). World size 1 creates no process group and every collective
  below returns at once: a single process has nothing that can hang.
- Every collective runs under the process group's timeout (`distributed.timeout_s`): gloo
  raises when it expires or a peer's connection drops; NCCL's watchdog aborts it.
- Phases (setup, generate, score, train, sync, checkpoint) name what a rank is doing. Each
  rank publishes a heartbeat (a counter and its current phase) in the rendezvous store from
  a daemon thread. When an exception leaves `ctx.phase(...)`, the rank either is the origin
  (it records "rank R failed during P: error" in the store and re-raises its own error) or
  it is a victim of a collective that failed: it then raises `DistributedError` with one
  line naming the rank that failed and its phase, read from the store: a recorded failure,
  a rank whose heartbeat stopped (killed, or stuck outside Python), or the ranks still in
  another phase when a collective timed out.
- Backstop: the heartbeat thread also watches the others. If a peer recorded a failure or
  its heartbeat has not moved for timeout_s / 2, and this process is still alive a grace
  period later (its main thread stuck in a collective that will not return), the thread
  prints the one line and exits the process with status 1. A failure leaving
  `ctx.phase` is fatal the same way: the process exits within the grace period even if
  the interpreter's own exit blocks on a collective still pending (which it does until
  the peer goes away).
- `deal_groups` hands whole prompt groups to ranks, heaviest first to the least loaded
  rank (LPT), by tokens or attention cost, the same on every rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

PHASES = ("setup", "generate", "score", "train", "sync", "checkpoint", "shutdown")
DONE = "done"  # the heartbeat's phase once a rank has shut down
_COMM_ERROR_HINTS = (
    "gloo",
    "nccl",
    "connection closed",
    "connection reset",
    "broken pipe",
    "timed out",
    "timeout",
    "processgroup",
    "socket",
)


class DistributedError(RuntimeError):
    """Another rank failed or stopped answering; str() is the one line to print."""


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

    def all_reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """Element-wise sum / max / min of `values` over ranks (float64)."""
        if not self.distributed:
            return [float(v) for v in values]
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.comm_device)
        with self._timed():
            dist.all_reduce(t, op=ops[op])
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

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._timed():
            dist.all_gather_object(out, obj)
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


def reduce_metrics(ctx: DistContext, metrics: dict[str, float], op: str = "mean") -> dict:
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


# ---------------------------------------------------------------- heartbeats and failures


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def looks_like_comm_error(exc: BaseException) -> bool:
    """A collective that failed (peer gone, timeout), as opposed to this rank's own bug."""
    if isinstance(exc, dist.DistError | TimeoutError | ConnectionError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(hint in text for hint in _COMM_ERROR_HINTS)


def _cause(records: list[dict]) -> str:
    """The first failure other ranks recorded: an origin's error, else a victim's line."""
    first = next((r for r in records if r["origin"]), records[0])
    if first["origin"]:
        return f"rank {first['rank']} failed during {first['phase']}: {first['error']}"
    return first["error"]


class _Watch:
    """Heartbeats and failure records in the rendezvous store, under namespace `prefix`.

    Keys: `beat/<rank>` = "<counter> <phase>", rewritten every `interval` seconds by a
    daemon thread, and "<counter> done" once the rank shut down; `failures` = JSON lines
    appended by failing ranks ({"rank", "phase", "error", "origin"}).
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float, store: dist.Store):
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        self.prefix = f"leangrpo/{run}/{attempt}/"
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.interval = min(max(timeout_s / 20, 0.2), 2.0)
        self.stall_s = max(timeout_s / 2, 3 * self.interval)
        self.grace_s = max(min(timeout_s / 4, 30.0), 2 * self.interval)
        self.phase, self._count = "setup", 0
        self._store, self._lock = store, threading.Lock()
        self._stop = threading.Event()
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (last beat, when it changed)
        # backstop: exit at this monotonic time, printing the line unless already shown
        self._exit_at: float | None = None
        self._exit_line: str | None = None
        self._beat()
        self._thread = threading.Thread(target=self._run, name="leangrpo-heartbeat", daemon=True)
        self._thread.start()

    # -- main thread ---------------------------------------------------------------------

    def enter(self, phase: str) -> str:
        outer, self.phase = self.phase, phase
        return outer

    def leave(self, outer: str) -> None:
        self.phase = outer

    def failure(self, phase: str, exc: Exception) -> DistributedError | None:
        """The error a victim raises, or None when this rank is the origin (re-raise exc).

        Either way the failure is fatal: the process exits within `grace_s` even if the
        exception is caught, or the interpreter's exit blocks on a pending collective.
        """
        self._schedule_exit(None)
        self._exit_line = None  # the main thread shows the error (a traceback, or the line)
        try:
            others = [r for r in self._failures() if r["rank"] != self.rank]
            if not others and not looks_like_comm_error(exc):
                self._record(phase, _first_line(exc), origin=True)
                line = f"leangrpo: rank {self.rank} failed during {phase}: {_first_line(exc)}"
                print(line, file=sys.stderr, flush=True)
                return None
            line = self._explain(phase, exc, others)
            self._record(phase, line, origin=False)
            return DistributedError(line)
        except Exception:  # the store itself is gone: its host (rank 0 or the agent) died
            return DistributedError(
                f"rank {self.rank} stops during {phase}: lost the rendezvous store (rank 0 "
                f"or torchrun's agent is gone); {_first_line(exc)}"
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval)
        self.phase = DONE
        with contextlib.suppress(Exception):
            self._beat()

    # -- explaining a failure ------------------------------------------------------------

    def _explain(self, phase: str, exc: Exception, others: list[dict]) -> str:
        me = f"rank {self.rank} stops during {phase}"
        if others:
            return f"{me}: {_cause(others)}"
        dead = self._stalled_peers(wait_s=2.5 * self.interval)
        if dead:
            who = ", ".join(f"rank {r} (in {p})" for r, p in dead)
            return f"{me}: {who} stopped answering (killed, or stuck outside Python); {_first_line(exc)}"
        elsewhere = [(r, p) for r, p in self._peer_phases() if p != phase]
        if elsewhere:
            who = ", ".join(f"rank {r} in {p}" for r, p in elsewhere)
            return (
                f"{me}: a collective gave up after distributed.timeout_s={self.timeout_s:g} s "
                f"waiting for {who}; {_first_line(exc)}"
            )
        return f"{me}: a collective failed and no rank reported why; {_first_line(exc)}"

    def _failures(self) -> list[dict]:
        key = f"{self.prefix}failures"
        with self._lock:
            if not self._store.check([key]):
                return []
            text = self._store.get(key).decode()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def _record(self, phase: str, error: str, origin: bool) -> None:
        line = json.dumps({"rank": self.rank, "phase": phase, "error": error, "origin": origin})
        with self._lock:
            self._store.append(f"{self.prefix}failures", line + "\n")

    def _beats(self) -> dict[int, tuple[str, bool]]:
        """peer -> (beat value "<counter> <phase>", whether it has shut down)."""
        peers = [r for r in range(self.world_size) if r != self.rank]
        with self._lock:
            values = self._store.multi_get([f"{self.prefix}beat/{r}" for r in peers])
        beats = [v.decode() for v in values]
        return {r: (v, v.endswith(" " + DONE)) for r, v in zip(peers, beats)}

    def _peer_phases(self) -> list[tuple[int, str]]:
        return [(r, v.split(" ", 1)[1]) for r, (v, done) in self._beats().items() if not done]

    def _stalled_peers(self, wait_s: float) -> list[tuple[int, str]]:
        before = self._beats()
        time.sleep(wait_s)
        after = self._beats()
        return [
            (r, after[r][0].split(" ", 1)[1])
            for r in before
            if before[r][0] == after[r][0] and not after[r][1]
        ]

    # -- the heartbeat thread ------------------------------------------------------------

    def _beat(self) -> None:
        self._count += 1
        with self._lock:
            self._store.set(f"{self.prefix}beat/{self.rank}", f"{self._count} {self.phase}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                if self._exit_at is None:
                    self._watch_peers()
            except Exception as exc:  # the store is gone: its host died
                self._schedule_exit(
                    f"rank {self.rank} stops during {self.phase}: lost the rendezvous store "
                    f"(rank 0 or torchrun's agent is gone): {_first_line(exc)}"
                )
            if self._exit_at is not None and time.monotonic() > self._exit_at:
                if self._stop.is_set():
                    return
                if self._exit_line is not None:
                    print(f"leangrpo: error: {self._exit_line}", file=sys.stderr, flush=True)
                os._exit(1)

    def _watch_peers(self) -> None:
        now = time.monotonic()
        others = [r for r in self._failures() if r["rank"] != self.rank]
        if others:
            self._schedule_exit(f"rank {self.rank} stops during {self.phase}: {_cause(others)}")
        for peer, (value, done) in self._beats().items():
            last = self._seen.get(peer)
            if last is None or last[0] != value:
                self._seen[peer] = (value, now)
            elif not done and now - last[1] > self.stall_s:
                self._schedule_exit(
                    f"rank {self.rank} stops during {self.phase}: rank {peer} (in "
                    f"{value.split(' ', 1)[1]}) has not answered for {now - last[1]:.0f} s "
                    "(killed, or stuck outside Python)"
                )

    def _schedule_exit(self, line: str | None) -> None:
        """Exit `grace_s` from now (the first call wins); print `line` then, if given."""
        if self._exit_at is None:
            self._exit_line = line
            self._exit_at = time.monotonic() + self.grace_s


# ----------------------------------------------------------------------- dealing groups


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
