"""Activation offload for non-reentrant gradient checkpointing.

With non-reentrant checkpointing, each decoder layer keeps exactly one activation for the
backward pass: its input hidden state, (1, N, H) per layer. At long context these dominate
activation memory, so we move them to host memory and bring them back just in time.

- Marking: each checkpointed layer calls our checkpoint function (transformers' per-layer
  `_gradient_checkpointing_func` attribute, set through its public checkpointing switch);
  it names the layer's input tensor and index, then calls
  `torch.utils.checkpoint.checkpoint(use_reentrant=False)`, which saves that input through
  our `saved_tensors_hooks`. Only marked tensors move; everything else (chunked log-prob
  state, norms, parameters) passes through untouched. Nothing is monkeypatched.
- Forward: the copy to a host buffer runs on a side stream after it waits for the compute
  stream; the device tensor is held until the copy's event has completed, then dropped.
  The last `keep_on_device` layers stay on the device: backward needs them first.
- Backward: when layer i is recomputed (its input unpacked), the input of layer i-1 is
  copied back on the side stream, overlapping layer i's recompute and backward; the
  compute stream waits on that copy's event before using it. The compute stream is looked
  up at every use (`torch.cuda.current_stream()`), never captured once: backward runs on
  autograd's device threads and under user streams.
- Host buffers come from a pool (pinned for CUDA), best fit by size, returned once every
  saver has unpacked the tensor and the last copy has completed; buffers left idle for a
  few steps are freed, so the pool tracks the working set without re-pinning churn.
- `mode="all"` offloads every saved non-parameter tensor >= min_tensor_bytes (a tensor
  saved by several ops is moved once) and restores on demand: the simple comparison point.
- On CPU the same path runs with plain host buffers and synchronous copies (tests).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

OffloadMode = Literal["none", "hidden_states", "all"]
MODES: tuple[str, ...] = ("none", "hidden_states", "all")


@dataclass
class OffloadStats:
    """Counters of one `step()` (see `ActivationOffloader.total` for the running sum)."""

    marked: int = 0  # layer inputs seen by the pack hook
    marked_bytes: int = 0
    offloaded: int = 0  # distinct tensors copied off the device
    offloaded_bytes: int = 0
    restored: int = 0  # tensors copied back to the device
    prefetched: int = 0  # ... of which the copy started ahead of use (look-ahead)
    kept_on_device: int = 0  # marked inputs of the last layers, left in place
    skipped: int = 0  # candidates left in place: smaller than min_tensor_bytes, or strided
    deduplicated: int = 0  # saves of a tensor already offloaded in this step

    def add(self, other: OffloadStats) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


class HostBufferPool:
    """Reusable uint8 host buffers, pinned when they back CUDA copies; best fit by size.

    A buffer serves requests of up to `max_oversize` times less than its size; one left
    free for `max_idle_steps` consecutive trims (steps) is freed, so a short micro-batch
    between long ones does not make the pool drop and re-pin its large buffers.
    """

    def __init__(self, max_oversize: float = 2.0, max_idle_steps: int = 4):
        self.max_oversize, self.max_idle_steps = max_oversize, max_idle_steps
        self._free: dict[bool, list[Tensor]] = {False: [], True: []}
        self._buffers: dict[int, Tensor] = {}  # id -> every buffer owned
        self._pinned: dict[int, bool] = {}
        self._idle: dict[int, int] = {}  # id -> trims since it was last acquired

    def acquire(self, nbytes: int, pin: bool) -> Tensor:
        free = self._free[pin]
        fits = [b for b in free if nbytes <= b.numel() <= max(nbytes * self.max_oversize, 1)]
        if fits:
            buf = min(fits, key=Tensor.numel)
            self._free[pin] = [b for b in free if b is not buf]  # list.remove would use ==
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            self._buffers[id(buf)], self._pinned[id(buf)] = buf, pin
        self._idle[id(buf)] = 0
        return buf

    def release(self, buf: Tensor) -> None:
        if id(buf) not in self._buffers:
            raise ValueError("HostBufferPool.release: this buffer was not acquired from the pool")
        self._free[self._pinned[id(buf)]].append(buf)

    def trim(self) -> None:
        """End of a step: age the free buffers, free those idle for too long."""
        for pin, free in self._free.items():
            for buf in free:
                self._idle[id(buf)] += 1
            expired = [b for b in free if self._idle[id(b)] > self.max_idle_steps]
            self._free[pin] = [b for b in free if self._idle[id(b)] <= self.max_idle_steps]
            for buf in expired:
                del self._buffers[id(buf)], self._pinned[id(buf)], self._idle[id(buf)]

    @property
    def size(self) -> int:
        return len(self._buffers)

    @property
    def bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    @property
    def in_use(self) -> int:
        return self.size - sum(len(f) for f in self._free.values())


class _Copier:
    """Host<->device copies: a side stream + events on CUDA, synchronous copies elsewhere."""

    def __init__(self) -> None:
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    def _streams(self, device: torch.device) -> tuple[Any, Any]:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device)
        # Looked up now, not cached: the caller's stream differs between forward and backward.
        return torch.cuda.current_stream(device), self._side[device]

    def to_host(self, src: Tensor, dst: Tensor) -> Any:  # returns the copy's event or None
        if src.device.type != "cuda":
            dst.copy_(src)
            return None
        compute, side = self._streams(src.device)
        side.wait_stream(compute)  # src is produced on the compute stream
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return event

    def to_device(self, src: Tensor, device: torch.device) -> tuple[Tensor, Any]:
        if device.type != "cuda":
            return src.to(device, copy=True), None
        compute, side = self._streams(device)
        dst = torch.empty(src.shape, dtype=src.dtype, device=device)  # on the compute stream
        side.wait_stream(compute)  # the block may still be read by queued compute work
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        dst.record_stream(side)
        return dst, event

    @staticmethod
    def wait(event: Any, device: torch.device) -> None:
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)

    @staticmethod
    def done(event: Any) -> bool:
        return event is None or event.query()

    @staticmethod
    def synchronize(event: Any) -> None:
        if event is not None:
            event.synchronize()


@dataclass(eq=False)  # identity, never element-wise tensor comparison
class _Kept:
    """A marked layer input left on the device; kept in the chain that drives prefetch."""

    tensor: Tensor
    layer: int
    seq: int  # position in forward order among the marked inputs of this step


class _Offloaded:
    """A saved tensor whose data lives in a host buffer until backward needs it."""

    def __init__(self, t: Tensor, buffer: Tensor, layer: int, seq: int):
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.buffer = buffer  # uint8 (nbytes,) from the pool
        self.host = buffer[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        self.on_device: Tensor | None = t  # held until the copy to host has completed
        self.copy_event: Any = None
        self.restored: Tensor | None = None  # device copy brought back (maybe prefetched)
        self.restore_event: Any = None
        self.layer, self.seq = layer, seq  # layer = -1 for unmarked tensors ("all" mode)
        self.refs, self.unpacks, self.released = 1, 0, False


def _tensor_key(t: Tensor) -> tuple:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


class ActivationOffloader:
    """Moves saved activations to host memory during forward, back during backward.

    Wrap each training forward+backward in `with offloader.step():`. Outside a step
    nothing is intercepted (plain checkpointing). `stats` counts the last step, `total`
    every step so far, `pool` holds the host buffers (size, bytes, in_use), `metrics()`
    gives the flat `offload/*` keys.
    """

    def __init__(
        self,
        model: nn.Module,
        mode: OffloadMode = "hidden_states",
        keep_on_device: int = 1,
        min_tensor_bytes: int = 1 << 20,
    ):
        _check_args(mode, keep_on_device, min_tensor_bytes)
        if mode == "none":
            raise ValueError("ActivationOffloader(mode='none') does nothing; do not build one")
        self.model, self.mode = model, mode
        self.keep_on_device, self.min_tensor_bytes = keep_on_device, min_tensor_bytes
        self.num_layers = 0  # checkpointed layers, set by enable_gradient_checkpointing
        self.pool = HostBufferPool()
        self.stats, self.total = OffloadStats(), OffloadStats()
        self._copier = _Copier()
        self._active = False
        self._pending_mark: tuple[Tensor, int] | None = None
        self._reset_step_state()

    def _reset_step_state(self) -> None:
        self._chain: list[_Kept | _Offloaded] = []  # marked inputs in forward order
        self._by_key: dict[tuple, tuple[StorageWeakRef, _Offloaded]] = {}  # dedup, this step
        self._records: list[_Offloaded] = []
        self._copying: list[_Offloaded] = []  # copy to host in flight, device tensor held
        self._releasing: list[tuple[Any, Tensor]] = []  # (event, buffer) back to the pool
        self._param_ptrs: set[int] = set()

    @contextlib.contextmanager
    def step(self) -> Iterator[ActivationOffloader]:
        """Intercept saved tensors for one micro-batch's forward + backward."""
        if self._active:
            raise RuntimeError("ActivationOffloader.step() is already active; do not nest it")
        self._active, self.stats = True, OffloadStats()
        if self.mode == "all":  # hidden_states mode only ever moves the tensors it marked
            tensors = [*self.model.parameters(), *self.model.buffers()]
            self._param_ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._active = False
            self._end_step()

    @contextlib.contextmanager
    def marking(self, hidden: Tensor | None, layer: int) -> Iterator[None]:
        """Name `hidden` as the input of checkpointed layer `layer` while it is saved."""
        if not self._active or self.mode != "hidden_states" or hidden is None:
            yield
            return
        self._pending_mark = (hidden, layer)
        try:
            yield
        finally:
            self._pending_mark = None

    def metrics(self) -> dict[str, float]:
        """Flat metrics of the last step, for the metrics logger."""
        return {
            "offload/bytes": float(self.stats.offloaded_bytes),
            "offload/tensors": float(self.stats.offloaded),
            "offload/prefetched": float(self.stats.prefetched),
            "offload/pool_bytes": float(self.pool.bytes),
        }

    # -- forward: pack -------------------------------------------------------------------

    def _pack(self, t: Tensor) -> Any:
        self._drain()
        if self.mode == "hidden_states":
            layer = self._take_mark(t)
            return t.detach() if layer is None else self._pack_marked(t, layer)
        if self._is_parameter(t):
            return t.detach()
        return self._offload_or_skip(t, layer=-1)

    def _take_mark(self, t: Tensor) -> int | None:
        if self._pending_mark is None:
            return None
        hidden, layer = self._pending_mark
        if t is hidden or _tensor_key(t) == _tensor_key(hidden):
            self._pending_mark = None
            return layer
        return None

    def _pack_marked(self, t: Tensor, layer: int) -> Any:
        self.stats.marked += 1
        self.stats.marked_bytes += t.numel() * t.element_size()
        seq = len(self._chain)
        if layer >= self.num_layers - self.keep_on_device:
            self.stats.kept_on_device += 1
            handle: Any = _Kept(t.detach(), layer, seq)
        else:
            handle = self._offload_or_skip(t, layer, seq)
            if isinstance(handle, Tensor):  # too small or strided: stays, still in the chain
                handle = _Kept(handle, layer, seq)
        self._chain.append(handle)
        return handle

    def _is_parameter(self, t: Tensor) -> bool:
        if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return True
        return t.untyped_storage().data_ptr() in self._param_ptrs

    def _offload_or_skip(self, t: Tensor, layer: int, seq: int = -1) -> Any:
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_tensor_bytes or not t.is_contiguous() or t.is_sparse:
            self.stats.skipped += 1
            return t.detach()
        key = _tensor_key(t)
        seen = self._by_key.get(key)
        if seen is not None and not seen[0].expired() and not seen[1].released:
            seen[1].refs += 1
            self.stats.deduplicated += 1
            return seen[1]
        record = _Offloaded(t.detach(), self.pool.acquire(nbytes, pin=t.is_cuda), layer, seq)
        record.copy_event = self._copier.to_host(t.detach(), record.host)
        self._by_key[key] = (StorageWeakRef(t.untyped_storage()), record)
        self._records.append(record)
        self._copying.append(record)
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += nbytes
        self._drain()  # synchronous copies (CPU) complete at once: drop the device tensor now
        return record

    def _drain(self) -> None:
        """Drop device tensors whose copy to host is done; recycle buffers whose copy back is."""
        while self._copying and self._copier.done(self._copying[0].copy_event):
            self._copying.pop(0).on_device = None
        while self._releasing and self._copier.done(self._releasing[0][0]):
            self.pool.release(self._releasing.pop(0)[1])

    # -- backward: unpack ----------------------------------------------------------------

    def _unpack(self, handle: Any) -> Tensor:
        if isinstance(handle, Tensor):
            return handle
        self._drain()
        if isinstance(handle, _Kept):
            self._prefetch_before(handle)
            return handle.tensor
        return self._unpack_offloaded(handle)

    def _unpack_offloaded(self, record: _Offloaded) -> Tensor:
        if record.released:
            raise RuntimeError(
                "an offloaded activation was used after ActivationOffloader.step() exited "
                "(or twice, as with retain_graph=True); run backward inside the step context"
            )
        if record.on_device is not None:  # the copy to host is still in flight: use the original
            tensor = record.on_device
        else:
            if record.restored is None:
                self._start_restore(record)
            self._copier.wait(record.restore_event, record.device)
            tensor = record.restored
        self._prefetch_before(record)
        record.unpacks += 1
        if record.unpacks == record.refs:
            self._release(record)
        return tensor

    def _prefetch_before(self, handle: _Kept | _Offloaded) -> None:
        """Start bringing back the input of the layer that backward recomputes next."""
        if handle.layer <= 0 or handle.seq <= 0:
            return
        previous = self._chain[handle.seq - 1]
        if (
            isinstance(previous, _Offloaded)
            and previous.layer == handle.layer - 1
            and not previous.released
            and previous.restored is None
            and previous.on_device is None
        ):
            self._start_restore(previous)
            self.stats.prefetched += 1

    def _start_restore(self, record: _Offloaded) -> None:
        record.restored, record.restore_event = self._copier.to_device(record.host, record.device)
        self.stats.restored += 1

    def _release(self, record: _Offloaded) -> None:
        """Every saver has its tensor: the buffer goes back once the last copy completes."""
        last_copy = record.restore_event if record.restore_event is not None else record.copy_event
        record.released, record.restored = True, None
        self._releasing.append((last_copy, record.buffer))
        self._drain()

    def _end_step(self) -> None:
        """Wait for copies in flight, return every buffer, forget this step's tensors."""
        for record in self._records:
            if not record.released:
                self._release(record)
        for event, buf in self._releasing:
            self._copier.synchronize(event)
            self.pool.release(buf)
        for record in self._copying:
            self._copier.synchronize(record.copy_event)
            record.on_device = None
        for record in self._records:
            record.buffer = record.host = (
                None  # a late unpack fails clearly, never reads reused memory
            )
        self.pool.trim()
        self.total.add(self.stats)
        self._reset_step_state()


def _check_args(mode: str, keep_on_device: int, min_tensor_bytes: int) -> None:
    if mode not in MODES:
        raise ValueError(f"offload mode must be one of {MODES}, got {mode!r}")
    if not isinstance(keep_on_device, int) or keep_on_device < 0:
        raise ValueError(f"keep_on_device must be an int >= 0 (layers), got {keep_on_device!r}")
    if not isinstance(min_tensor_bytes, int) or min_tensor_bytes < 0:
        raise ValueError(f"min_tensor_bytes must be an int >= 0, got {min_tensor_bytes!r}")


class _LayerCheckpoint:
    """The checkpoint function one decoder layer calls: marks its input, then checkpoints."""

    def __init__(self, offloader: ActivationOffloader, layer: int):
        self.offloader, self.layer = offloader, layer

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args and isinstance(args[0], Tensor) else None
        with self.offloader.marking(hidden, self.layer):
            return checkpoint(function, *args, use_reentrant=False, **kwargs)


def _pretrained(model: nn.Module) -> nn.Module:
    """The outermost transformers model inside `model` (itself, or under a peft wrapper)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(
        f"{type(model).__name__} holds no transformers PreTrainedModel; "
        "gradient checkpointing needs a transformers model (optionally peft-wrapped)"
    )


def _checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [
        m
        for m in model.modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]


def enable_gradient_checkpointing(
    model: nn.Module,
    *,
    offload: str = "none",
    keep_on_device: int = 1,
    min_tensor_bytes: int = 1 << 20,
) -> ActivationOffloader | None:
    """Non-reentrant checkpointing of every decoder layer, plus activation offload if asked.

    offload: "none" (returns None), "hidden_states" (the checkpointed layer inputs, all but
    the last `keep_on_device` layers), or "all" (every saved tensor >= min_tensor_bytes).
    Works on a transformers model or a peft model wrapping one. Wrap each training
    forward+backward in `with offloader.step():`.
    """
    _check_args(offload, keep_on_device, min_tensor_bytes)
    pretrained = _pretrained(model)
    if not getattr(pretrained, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(pretrained).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(pretrained, "activation_checkpointing_enable"):  # transformers >= 5.2x
        pretrained.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        pretrained.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if offload == "none":
        return None
    offloader = ActivationOffloader(model, offload, keep_on_device, min_tensor_bytes)
    layers = _checkpointed_layers(pretrained)
    if offload == "hidden_states":
        if not layers:
            raise ValueError(
                f"{type(pretrained).__name__} has no GradientCheckpointingLayer; "
                "offload='hidden_states' needs transformers >= 4.56 decoder layers "
                "(use offload='all' instead)"
            )
        for index, layer in enumerate(layers):
            # transformers' documented per-layer hook: the layer calls this function
            layer._gradient_checkpointing_func = _LayerCheckpoint(offloader, index)
    offloader.num_layers = len(layers)
    return offloader
