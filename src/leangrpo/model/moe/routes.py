"""Route records: the experts an engine routed each model token's predicting position to.

A completion's record (`Completion.routes`) is a CPU tensor (model tokens, MoE layers, k)
of expert indices, aligned with its behaviour log-probs: row t holds, for every MoE layer,
the k experts of the position whose hidden state predicted model token t (the last
prompt token for the first one; then each fed token), as the forward that sampled token t
routed it. Packing concatenates the records in the (T,) order of every other per-token
tensor (`PackedBatch.routes`), so whatever keeps log-probs aligned (multi-turn segments,
shared prefixes, context-parallel shards, micro-batches) keeps routes aligned too.

Indices are uint8 when the model has at most 256 experts, int16 otherwise (vLLM's own
choice is the same), so a record costs layers x k bytes a token. Every record is checked
before a forward uses it (`check_routes`): its shape against the model's `RouterSpec`,
integer values in [0, experts) and k distinct experts per row; anything else is refused in
one sentence naming the sample, never used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from leangrpo.model.moe.routers import RouterSpec, RoutingError

INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def route_dtype(experts: int) -> torch.dtype:
    return torch.uint8 if experts <= 256 else torch.int16


def check_routes(routes: object, tokens: int, spec: RouterSpec, where: str) -> None:
    """Refuse (RoutingError) a record that does not fit `tokens` model tokens of a model
    with `spec`; `where` names the sample in the message."""
    problem = _problem(routes, tokens, spec)
    if problem is not None:
        raise RoutingError(
            f"{where}: its route record {problem}; it is refused, not replayed (the engine "
            f"must report one row of {spec.top_k} distinct experts in [0, {spec.experts}) "
            f"per MoE layer ({spec.layers}) for each of its {tokens} model tokens)"
        )


def _problem(routes: object, tokens: int, spec: RouterSpec) -> str | None:
    if not isinstance(routes, Tensor):
        return f"is a {type(routes).__name__}, not a tensor"
    if routes.dtype not in INTEGER_DTYPES:
        return f"holds {routes.dtype} values, not integers"
    want = (tokens, spec.layers, spec.top_k)
    if tuple(routes.shape) != want:
        return f"has shape {tuple(routes.shape)} instead of (tokens, layers, k) = {want}"
    if routes.numel() == 0:
        return None
    wide = routes.to(torch.int64)
    low, high = int(wide.min()), int(wide.max())
    if low < 0 or high >= spec.experts:
        return f"names expert {low if low < 0 else high}, outside [0, {spec.experts})"
    if spec.top_k > 1:
        ordered = wide.sort(dim=-1).values
        if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
            return "names one expert twice in a token's row"
    return None


def packed_routes(records: list[Tensor | None], where: Callable[[int], str]) -> Tensor | None:
    """The records of a micro-batch's samples in (T,) order (None when no sample has one);
    a mix of samples with and without records is refused."""
    present = [r is not None for r in records]
    if not any(present):
        return None
    if not all(present):
        missing = where(present.index(False))
        raise RoutingError(
            f"{missing} has no route record while others of its micro-batch have one; every "
            "sample of a routing-replay run must come from an engine that reports routes"
        )
    dtypes = {r.dtype for r in records}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.int16
    return torch.cat([r.to(dtype) for r in records])
