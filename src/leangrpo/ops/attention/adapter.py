"""The packed-attention adapter, registered through transformers' attention interface.

One attention function + one mask function are registered under `leangrpo_packed`:

* A forward carrying packed kwargs (`cu_seq_lens_q/k`, `max_length_q/k` from
  `packed_model_kwargs`, or a shared-prefix `leangrpo_prefix` layout) runs a kernel that
  never attends across sequences: flash-attn varlen, torch varlen, flex attention with a
  block-diagonal causal BlockMask, or causal SDPA per segment (the exact CPU fallback);
  the kernels live in `kernels.py`, "auto" takes the first available in that
  order on CUDA and per-segment SDPA on CPU.
  A KV cache together with packed kwargs is refused: a cache would hold a packed row.
* Any other forward (generation with a left-padded batch and a KV cache, a plain padded
  batch) is delegated to transformers' own SDPA function with the standard mask. The mask
  function skips building a mask only for fresh forwards without a padding mask; then
  position ids that restart inside a row get the block-diagonal mask transformers would
  have built (refused with a cache, where transformers' own SDPA leaks across sequences).
* `enable_packed_attention` probes the model with a 5-token packed forward. If the packed
  kwargs never reach the attention function (an architecture outside the interface), a
  padded view is installed with public forward hooks instead: the backbone sees (S, Lmax)
  right-padded rows with an attention mask, and its output is unpadded back to (1, N).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from leangrpo.ops.attention import kernels
from leangrpo.ops.attention.kernels import AttentionSetupError, PackedAttentionError
from leangrpo.ops.attention.layout import GroupSpan, PrefixLayout

logger = logging.getLogger("leangrpo")

ATTENTION_NAME = "leangrpo_packed"
PREFIX_KWARG = "leangrpo_prefix"
# context parallelism: the row split (ops/context_parallel) whose `attend` runs the kernel
CONTEXT_KWARG = "leangrpo_context"
Backend = Literal["auto", "flash_varlen", "torch_varlen", "flex", "sdpa_segments"]
BACKENDS = ("flash_varlen", "torch_varlen", "flex", "sdpa_segments")
PREFIX_BACKENDS = ("flex", "sdpa_segments")  # kernels that implement the shared-prefix layout


@dataclass
class _State:
    backend: str | None = None
    logged: set[str] | None = None


_STATE = _State(logged=set())
_CAPABILITIES: weakref.WeakKeyDictionary[nn.Module, PackedSupport] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class PackedSupport:
    """What the probe forward saw reach the attention function."""

    packed_kwargs: bool  # cu_seq_lens reached it: packed attention runs inside the model
    prefix_kwarg: bool  # the shared-prefix layout reached it
    padded_view: bool  # neither did: forward hooks pad and unpad around the backbone
    # attention calls of one forward that a context-parallel split reached: a row can be
    # split over ranks when that is every decoder layer (each mixes tokens only there)
    context_layers: int = 0


def _log_once(key: str, message: str, level: int = logging.INFO) -> None:
    if key not in _STATE.logged:
        _STATE.logged.add(key)
        logger.log(level, message)


# ------------------------------------------------------------------------ registration


def backend_unavailable_reason(backend: str, device_type: str) -> str | None:
    """None when `backend` can run on `device_type`, else why not (and the fix)."""
    if backend not in BACKENDS:
        return f"unknown attention backend {backend!r}; choose one of auto, {', '.join(BACKENDS)}"
    if backend == "sdpa_segments":
        return None
    if backend == "flex":
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError:
            return "flex attention needs torch >= 2.5 (pip install -U torch)"
        return None
    if device_type != "cuda":
        return f"{backend} needs a CUDA device (this process runs on {device_type})"
    if backend == "flash_varlen":
        try:
            from flash_attn import flash_attn_varlen_func  # noqa: F401
        except Exception:  # missing, or built against another torch (ABI)
            return "flash_varlen needs the flash-attn package (pip install flash-attn)"
        return None
    if backend == "torch_varlen":
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError:
            return "torch_varlen needs torch.nn.attention.varlen (torch >= 2.10)"
        if torch.cuda.get_device_capability()[0] < 8:
            return "torch_varlen needs an Ampere or newer GPU (flash attention kernels)"
        return None


def resolve_backend(backend: str = "auto", device_type: str | None = None) -> str:
    """The backend to use: the first available of BACKENDS for "auto", else the forced one."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if backend != "auto":
        reason = backend_unavailable_reason(backend, device_type)
        if reason is not None:
            raise AttentionSetupError(
                f"packing.attention_backend={backend!r} is unavailable: {reason}; "
                "or set packing.attention_backend=auto."
            )
        return backend
    candidates = BACKENDS if device_type == "cuda" else ("sdpa_segments",)
    return next(b for b in candidates if backend_unavailable_reason(b, device_type) is None)


def register_packed_attention(backend: Backend = "auto", device_type: str | None = None) -> str:
    """Register (idempotently) the adapter under ATTENTION_NAME with `backend`; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    chosen = resolve_backend(backend, device_type)
    AttentionInterface.register(ATTENTION_NAME, packed_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, packed_attention_mask)
    if _STATE.backend != chosen:
        _STATE.backend = chosen
        logger.info("packed attention: backend %s (asked for %s)", chosen, backend)
    return ATTENTION_NAME


def current_backend() -> str:
    if _STATE.backend is None:
        raise PackedAttentionError(
            "packed attention is not registered; call register_packed_attention()."
        )
    return _STATE.backend


def enable_packed_attention(
    model: nn.Module, backend: Backend = "auto", device_type: str | None = None
) -> str:
    """Switch a loaded (possibly peft-wrapped) model to the adapter; returns the backend.
    `device_type`: where the model will run, when it is still elsewhere (a torchrun
    teacher staged in host memory, moved to the GPU as it is sharded): the backend is
    chosen for that device, and the probe runs where the model is, with a kernel that
    runs there (what the probe learns, which kwargs reach the attention, is the model's)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    device = next(lm.parameters()).device
    name = register_packed_attention(backend, device_type or device.type)
    if hasattr(lm, "set_attn_implementation"):
        lm.set_attn_implementation(name)
    support = _probe(lm, device)
    _CAPABILITIES[lm] = support
    if support.padded_view:
        _install_padded_view(_backbone(lm))
        logger.warning(
            "packed attention: %s does not pass packed kwargs to its attention function; "
            "using a padded view inside the adapter (exact, but pays for padding).",
            type(lm).__name__,
        )
    return current_backend()


def packed_support(model: nn.Module) -> PackedSupport | None:
    """The probe's verdict for a model passed to enable_packed_attention (None if never)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _CAPABILITIES.get(lm)


def packed_model_kwargs(batch: Any) -> dict[str, Any]:
    """Kwargs for the backbone forward (with input_ids, position_ids, use_cache=False)."""
    prefix = getattr(batch, "prefix", None)
    if prefix is not None:  # cu_seq_lens are left out so that no other kernel can misread the row
        return {PREFIX_KWARG: prefix}
    return {
        "cu_seq_lens_q": batch.cu_seqlens,
        "cu_seq_lens_k": batch.cu_seqlens,
        "max_length_q": batch.max_seqlen,
        "max_length_k": batch.max_seqlen,
    }


def choose_shared_prefix(setting: str, backend: str, stats: dict[str, float] | None = None) -> bool:
    """Whether to pack with a shared prompt prefix.

    `stats`: "prompt_fraction" (prompt tokens / plain packed tokens) and "group_size".
    "auto" is on only where the layout was measured faster: the sdpa_segments backend with
    prompts >= AUTO_MIN_PROMPT_FRACTION of the tokens and groups of >= 2, as measured with
    the batched kernels by benchmarks/prefix_rule.py (benchmarks/RESULTS.md, "Layout rules
    measured"). flex implements it but has no measurement yet (use "on"). "on"
    with a backend that cannot take the layout falls back to plain packing with a log.
    """
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"packing.shared_prefix must be auto, on or off (got {setting!r}).")
    if setting == "off":
        return False
    if backend not in PREFIX_BACKENDS:
        if setting == "on":
            _log_once(
                f"prefix-{backend}",
                f"shared prefix: backend {backend} has no shared-prefix "
                "kernel; packing plainly (use flex or sdpa_segments).",
            )
        return False
    if setting == "on":
        return True
    stats = stats or {}
    return (
        backend in MEASURED_PREFIX_BACKENDS
        and stats.get("prompt_fraction", 0.0) >= AUTO_MIN_PROMPT_FRACTION
        and stats.get("group_size", 1) >= 2
    )


AUTO_MIN_PROMPT_FRACTION = 0.1
MEASURED_PREFIX_BACKENDS = ("sdpa_segments",)  # where auto may turn the prefix on


# ------------------------------------------------------------------ mask and attention


def packed_attention_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """transformers' sdpa mask, except no (N, N) mask for a fresh forward without padding."""
    from transformers.masking_utils import sdpa_mask

    fresh = (
        kwargs.get("attention_mask") is None
        and isinstance(kwargs.get("q_offset", 0), int)
        and kwargs.get("q_offset", 0) == 0
        and isinstance(kwargs.get("kv_offset", 0), int)
        and kwargs.get("kv_offset", 0) == 0
        and kwargs.get("q_length") == kwargs.get("kv_length")
    )
    return None if fresh else sdpa_mask(*args, **kwargs)


def packed_attention_forward(
    module: nn.Module,
    query: Tensor,  # (B, H, Lq, D)
    key: Tensor,  # (B, KVH, Lk, D)
    value: Tensor,  # (B, KVH, Lk, D)
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Packed attention when packed kwargs are present, transformers' SDPA otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = kwargs.pop(PREFIX_KWARG, None)
    split = kwargs.pop(CONTEXT_KWARG, None)
    cu = kwargs.get("cu_seq_lens_q")
    _PROBE.record(cu is not None, layout is not None, split is not None)
    if split is PROBE_SPLIT:
        split = None
    if layout is not None or cu is not None:
        _check_packed_call(module, query, key, attention_mask, is_causal, kwargs, layout)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        max_len = kwargs.get("max_length_q")

        def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return _run_packed(q, k, v, cu, max_len, layout, scale, dropout)

        return (run(query, key, value) if split is None else split.attend(query, key, value, run)), None
    if split is not None:
        raise PackedAttentionError(
            "a context-parallel split reached attention without packed kwargs; "
            "score packed batches only (model.scoring.score)."
        )
    if attention_mask is None and query.shape[2] == key.shape[2] and query.shape[2] > 1:
        attention_mask = _implicit_mask(kwargs.get("position_ids"), query, kwargs)
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


def _check_packed_call(module, query, key, attention_mask, is_causal, kwargs, layout) -> None:
    if kwargs.get("use_cache"):
        raise PackedAttentionError(
            "packed kwargs were passed with use_cache=True: a KV cache would store a packed row "
            "and later tokens would attend across sequences; call the model with use_cache=False."
        )
    if key.shape[2] != query.shape[2]:
        raise PackedAttentionError(
            f"packed forward got {key.shape[2]} keys for {query.shape[2]} queries (a KV cache "
            "holds tokens); packed forwards must run without past_key_values."
        )
    if query.shape[0] != 1:
        raise PackedAttentionError(
            f"packed forward got batch size {query.shape[0]}; pack all sequences into one (1, N) row."
        )
    if attention_mask is not None:
        raise PackedAttentionError(
            "packed forward got an attention_mask; packed rows hold only real tokens, drop the mask."
        )
    if kwargs.get("s_aux") is not None:
        raise AttentionSetupError(
            f"{type(module).__name__} adds attention sinks (s_aux: gpt-oss), which leangrpo's "
            "packed attention kernels do not implement, so its log-probs would be wrong; this "
            "architecture cannot be trained yet"
        )
    if is_causal is False or not getattr(module, "is_causal", True):
        raise AttentionSetupError(
            "packed attention is causal only; this attention layer is bidirectional."
        )
    window = kwargs.get("sliding_window")
    longest = _longest_span(layout) if layout is not None else kwargs.get("max_length_q")
    if window is not None and (longest is None or longest > window):
        raise AttentionSetupError(
            f"a packed sequence ({longest} tokens) exceeds the model's sliding window ({window}); "
            "the packed kernels implement full causal attention only: shorten sequences."
        )


def _longest_span(layout: PrefixLayout) -> int:
    """Tokens the last query of a sequence attends over: in the shared-prefix layout a
    completion token sees its group's prompt and its own completion (P + R, not max(P, R))."""
    return max(g.prompt_len + max(g.completion_lens, default=0) for g in layout.groups)


def _run_packed(q, k, v, cu, max_len, layout, scale, dropout) -> Tensor:
    """(1, N, H, D) output of the registered backend on a packed row."""
    backend = current_backend()
    if layout is not None:
        if backend == "flex":
            return kernels.flex_prefix(q, k, v, layout, scale, dropout)
        if backend != "sdpa_segments":
            _log_once(
                f"prefix-run-{backend}",
                f"shared prefix: {backend} has no shared-prefix "
                "kernel; running this forward with per-segment SDPA.",
                logging.WARNING,
            )
        return kernels.batched_prefix(q, k, v, layout, scale, dropout)
    if max_len is None:
        max_len = int((cu[1:] - cu[:-1]).max())
    if backend in ("flash_varlen", "torch_varlen") and q.dtype not in (
        torch.float16,
        torch.bfloat16,
    ):
        _log_once(
            "varlen-fp32",
            f"{backend} needs fp16/bf16; fp32 forwards use per-segment SDPA.",
            logging.WARNING,
        )
        backend = "sdpa_segments"
    if backend == "flash_varlen":
        return kernels.flash_varlen(q, k, v, cu, max_len, scale, dropout)
    if backend == "torch_varlen":
        return kernels.torch_varlen(q, k, v, cu, max_len, scale, dropout)
    if backend == "flex":
        return kernels.flex_plain(q, k, v, cu, scale, dropout)
    return kernels.batched_segments(q, k, v, cu, scale, dropout)


# ------------------------------------------- implicit packing (position ids, no kwargs)


_IMPLICIT_CACHE: dict[str, Any] = {}


def _implicit_mask(position_ids: Tensor | None, query: Tensor, kwargs: dict) -> Tensor | None:
    """The block-diagonal causal mask transformers builds when position ids restart in a row."""
    if position_ids is None:
        return None
    cached = _IMPLICIT_CACHE.get("ids")
    if cached is not None and cached[0]() is position_ids:
        mask = cached[1]
    else:
        pos = position_ids.expand(query.shape[0], -1)
        seq = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)  # (B, L)
        mask = None
        if bool(seq[:, -1].any()):
            causal = torch.ones(
                pos.shape[1], pos.shape[1], dtype=torch.bool, device=pos.device
            ).tril()
            mask = ((seq[:, :, None] == seq[:, None, :]) & causal)[:, None]  # (B, 1, L, L)
        _IMPLICIT_CACHE["ids"] = (weakref.ref(position_ids), mask)
    if mask is not None and kwargs.get("use_cache"):
        raise PackedAttentionError(
            "position ids restart inside a row (packed sequences) while use_cache=True; "
            "transformers' SDPA would attend across sequences here. Call with use_cache=False."
        )
    return mask


# -------------------------------------------------------- the probe and the padded view


class _Probe:
    """Records, during enable_packed_attention's probe forward only, what reached attention."""

    def __init__(self) -> None:
        self.active, self.saw_cu, self.saw_prefix = False, False, False
        self.split_calls = 0  # attention calls that received the probe's split marker

    def record(self, saw_cu: bool, saw_prefix: bool, saw_split: bool = False) -> None:
        if self.active:
            self.saw_cu |= saw_cu
            self.saw_prefix |= saw_prefix
            self.split_calls += saw_split


_PROBE = _Probe()
PROBE_SPLIT = object()  # the probe's stand-in for a context-parallel split (never attends)


def _backbone(lm: nn.Module) -> nn.Module:
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    return decoder if isinstance(decoder, nn.Module) else lm


def _probe(lm: nn.Module, device: torch.device) -> PackedSupport:
    """Run two sequences (2 + 3 tokens) packed, plainly (with the split marker) and with a
    shared prefix."""
    backbone = _backbone(lm)
    ids = torch.zeros(1, 5, dtype=torch.long, device=device)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    plain = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 3, "max_length_k": 3}
    layout = PrefixLayout((GroupSpan(0, 2, (2, 4), (2, 1)),), 5)
    runs = [(torch.tensor([[0, 1, 0, 1, 2]], device=device), {**plain, CONTEXT_KWARG: PROBE_SPLIT})]
    if current_backend() in PREFIX_BACKENDS:
        runs.append((torch.tensor([[0, 1, 2, 3, 2]], device=device), {PREFIX_KWARG: layout}))
    _PROBE.active, _PROBE.saw_cu, _PROBE.saw_prefix, _PROBE.split_calls = True, False, False, 0
    chosen = _STATE.backend
    if chosen is not None and backend_unavailable_reason(chosen, device.type) is not None:
        _STATE.backend = resolve_backend("auto", device.type)  # the model is not there yet
    try:
        with torch.no_grad():
            for position_ids, extra in runs:
                backbone(input_ids=ids, position_ids=position_ids, use_cache=False, **extra)
    finally:
        _PROBE.active = False
        _STATE.backend = chosen
    return PackedSupport(
        _PROBE.saw_cu,
        _PROBE.saw_prefix,
        padded_view=not _PROBE.saw_cu,
        context_layers=_PROBE.split_calls,
    )


class _PaddedView:
    """Per-backbone state of the padded view: the real-token masks of calls in flight.

    Kept on the module instance (never in a closure), so a deep copy of the model (the
    async hf engine's) gets its own list: one thread's forward can never pop another's mask.
    """

    def __init__(self) -> None:
        self.pending: list[Tensor] = []  # (S, Lmax) bool of real tokens, per call in flight


_VIEW_ATTR = "_leangrpo_padded_view"


def _install_padded_view(backbone: nn.Module) -> None:
    """Forward hooks: packed (1, N) in -> (S, Lmax) right-padded + mask -> (1, N) out."""
    setattr(backbone, _VIEW_ATTR, _PaddedView())
    backbone.register_forward_pre_hook(_pad_packed_call, with_kwargs=True)
    backbone.register_forward_hook(_unpad_packed_output, with_kwargs=True)


def _pad_packed_call(module, args, kwargs):
    if kwargs.get(PREFIX_KWARG) is not None:
        raise AttentionSetupError(
            f"{type(module).__name__} cannot take the shared-prefix layout (its attention "
            "does not receive packed kwargs); set packing.shared_prefix=off."
        )
    cu = kwargs.pop("cu_seq_lens_q", None)
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)
    if cu is None:
        return None
    lens = (cu[1:] - cu[:-1]).long()
    width = int(lens.max())
    offsets = torch.arange(width, device=cu.device)
    real = offsets[None, :] < lens[:, None]  # (S, Lmax)
    gather = (cu[:-1, None].long() + offsets[None, :]).clamp(max=int(cu[-1]) - 1)
    for name in ("input_ids", "inputs_embeds"):
        if kwargs.get(name) is not None:
            kwargs[name] = kwargs[name][0][gather]
    kwargs["position_ids"] = offsets[None, :].expand(lens.numel(), -1)
    kwargs["attention_mask"] = real.long()
    getattr(module, _VIEW_ATTR).pending.append(real)
    return args, kwargs


def _unpad_packed_output(module, args, kwargs, output):
    pending = getattr(module, _VIEW_ATTR).pending
    if not pending:
        return None
    real = pending.pop()
    for name in ("last_hidden_state", "logits"):
        if getattr(output, name, None) is not None:
            setattr(output, name, getattr(output, name)[real].unsqueeze(0))
    return output
