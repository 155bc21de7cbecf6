"""Per-token log-probs through the lm_head: the entry points the trainer and tests call.

- `chunked_logprobs` never materialises the (N, V) logits: it walks (row_tile x vocab_tile)
  tiles with an online log-sum-exp forward and a recomputing backward (tiles.py holds the
  algorithm, its choices and the autograd.Function).
- `naive_logprobs` is the reference, with the same signature: full logits, /T, the same
  top-k / min-p filters, log_softmax, gather.
- `token_logprobs` is the trainer's switch between them (config `logprobs.chunked`).
- Both validate their inputs first (shapes, dtypes, one device, target ids in range,
  temperature, filters, tiles), raising one sentence that names the argument.
- Default tiles per device (`DEFAULT_TILES`, both 8M logits = 32 MiB in fp32): CPU 4096 rows x
  2048 vocab, chosen over 1024 x 8192 by measurement (tall tiles make the weight-gradient
  matmul deeper and walk the fp32 weight-grad buffer fewer times); CUDA 1024 x 8192. The
  figures are in benchmarks/RESULTS.md (`## logprob_memory`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from leangrpo.ops.logprobs.tiles import (
    _ChunkedLogprobs,
    _dtypes,
    _forward,
    _matmul_dtype,
    _no_autocast,
    _Spec,
)

__all__ = ["DEFAULT_TILES", "chunked_logprobs", "naive_logprobs", "token_logprobs"]

# (row_tile, vocab_tile) by device type when the caller passes None; others use "cuda"'s
DEFAULT_TILES: dict[str, tuple[int, int]] = {"cpu": (4096, 2048), "cuda": (1024, 8192)}


def _check_tensors(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"logprobs: hidden must be (N, H) and weight (V, H); got hidden {tuple(hidden.shape)}"
            f" and weight {tuple(weight.shape)} (flatten hidden to (N, H) first)"
        )
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise TypeError(
            f"logprobs: hidden and weight must be floating point, got "
            f"{hidden.dtype} and {weight.dtype}"
        )
    if targets.shape != (hidden.shape[0],) or targets.is_floating_point() or targets.is_complex():
        raise ValueError(
            f"logprobs: targets must be an integer tensor of shape ({hidden.shape[0]},)"
            f" matching hidden's rows; got {targets.dtype} {tuple(targets.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(
            f"logprobs: bias must have shape ({weight.shape[0]},) = (V,); got {tuple(bias.shape)}"
        )
    devices = {t.device for t in (hidden, weight, targets, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(
            f"logprobs: all inputs must be on one device; got {sorted(map(str, devices))}"
        )
    if targets.numel():
        low, high = torch.stack(torch.aminmax(targets)).tolist()  # one device read
        if low < 0 or high >= weight.shape[0]:
            raise ValueError(
                f"logprobs: targets must be token ids in [0, {weight.shape[0]}); got range "
                f"[{low}, {high}] (drop padding/ignore ids first)"
            )


def _validate(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    temperature: float,
    top_k: int,
    min_p: float,
    with_entropy: bool,
    row_tile: int | None,
    vocab_tile: int | None,
) -> _Spec:
    _check_tensors(hidden, weight, targets, bias)
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise ValueError(
            f"logprobs: temperature must be a finite number > 0, got {temperature} "
            "(greedy decoding has no log-probs to train on)"
        )
    if top_k < 0:
        raise ValueError(f"logprobs: top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 <= min_p < 1.0:
        raise ValueError(f"logprobs: min_p must be in [0, 1) (0 disables it), got {min_p}")
    default_rows, default_vocab = DEFAULT_TILES.get(hidden.device.type, DEFAULT_TILES["cuda"])
    row_tile = default_rows if row_tile is None else row_tile
    vocab_tile = default_vocab if vocab_tile is None else vocab_tile
    if row_tile <= 0 or vocab_tile <= 0:
        raise ValueError(
            f"logprobs: row_tile and vocab_tile must be > 0, got {row_tile}, {vocab_tile}"
        )
    top_k = 0 if top_k >= weight.shape[0] else int(top_k)
    compute = _matmul_dtype(hidden, weight)
    return _Spec(
        float(temperature), top_k, float(min_p), bool(with_entropy), row_tile, vocab_tile, compute
    )


def chunked_logprobs(
    hidden: Tensor,  # (N, H) any float dtype
    weight: Tensor,  # (V, H) lm_head, may be tied to the embeddings, may be frozen
    targets: Tensor,  # (N,) integer token ids
    bias: Tensor | None = None,  # (V,)
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    with_entropy: bool = False,
    row_tile: int | None = None,  # None = DEFAULT_TILES for hidden's device
    vocab_tile: int | None = None,
    compile: bool | str = False,  # True = torch.compile (inductor); or a backend name
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (N,) of `targets` under softmax(filter(lm_head(hidden) / temperature)).

    Returns (logprobs, entropy or None), fp32 (float64 for float64 inputs). Never builds the
    (N, V) logits; differentiable in hidden, weight and bias (and through the entropy).
    """
    spec = _validate(
        hidden, weight, targets, bias, temperature, top_k, min_p, with_entropy, row_tile, vocab_tile
    )
    if compile:
        spec = replace(spec, compile="inductor" if compile is True else str(compile))
    targets = targets.long()
    needs_graph = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    if not needs_graph:
        with _no_autocast(hidden.device):
            logprobs, _, _, entropy = _forward(hidden, weight, targets, bias, spec)
        return logprobs, entropy
    logprobs, entropy = _ChunkedLogprobs.apply(hidden, weight, targets, bias, spec)
    return logprobs, (entropy if spec.with_entropy else None)


def _keep_mask(z: Tensor, spec: _Spec) -> Tensor | None:
    """Reference filter on full logits (N, V): True = kept."""
    if not spec.filtered:
        return None
    thr = torch.full_like(z[:, 0], -math.inf)
    if spec.top_k:
        thr = z.topk(spec.top_k, dim=1).values[:, -1]
    if spec.min_p > 0.0:
        thr = torch.maximum(thr, z.amax(dim=1) + math.log(spec.min_p))
    return z >= thr[:, None]


def naive_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    with_entropy: bool = False,
    row_tile: int | None = None,  # accepted for signature parity, unused
    vocab_tile: int | None = None,  # accepted for signature parity, unused
) -> tuple[Tensor, Tensor | None]:
    """The reference: full logits (N, V) -> /T -> filters -> log_softmax -> gather."""
    spec = _validate(
        hidden, weight, targets, bias, temperature, top_k, min_p, with_entropy, row_tile, vocab_tile
    )
    compute, acc = _dtypes(spec)
    with _no_autocast(hidden.device):
        logits = torch.nn.functional.linear(
            hidden.to(compute), weight.to(compute), None if bias is None else bias.to(compute)
        )
    z = logits.to(acc) / spec.temperature
    keep = _keep_mask(z, spec)
    if keep is not None:
        z = z.masked_fill(~keep, -math.inf)
    logp = z.log_softmax(dim=-1)  # (N, V)
    logprobs = logp.gather(1, targets.long()[:, None]).squeeze(1)
    if not spec.with_entropy:
        return logprobs, None
    logp_kept = logp if keep is None else logp.masked_fill(~keep, 0.0)  # no 0 * -inf
    entropy = -(logp.exp() * logp_kept).sum(dim=-1)
    return logprobs, entropy


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    chunked: bool = True,
    compile: bool = False,  # chunked path only
    **kw,
) -> tuple[Tensor, Tensor | None]:
    """The trainer's entry point: chunked (default) or the full-logits reference."""
    if chunked:
        return chunked_logprobs(hidden, weight, targets, bias, compile=compile, **kw)
    return naive_logprobs(hidden, weight, targets, bias, **kw)
