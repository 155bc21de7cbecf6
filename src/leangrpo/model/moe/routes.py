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

import base64
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
    low, high = torch.aminmax(wide)
    low, high = int(low), int(high)
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


# -- on the wire (leangrpo serve) and from vLLM ---------------------------------------------

WIRE_DTYPES = {"uint8": torch.uint8, "int16": torch.int16}
MAX_WIRE_BYTES = 1 << 30


def routes_to_wire(routes: Tensor) -> dict:
    """A record as JSON: its shape, dtype and bytes (base64)."""
    dtype = "uint8" if routes.dtype == torch.uint8 else "int16"
    data = routes.to(WIRE_DTYPES[dtype]).contiguous().numpy().tobytes()
    return {"shape": list(routes.shape), "dtype": dtype, "data": base64.b64encode(data).decode()}


def routes_from_wire(obj: object) -> Tensor:
    """A record from JSON a server sent (untrusted: shape, dtype and size checked; its
    values are checked against the model before any use, `check_routes`)."""
    if not isinstance(obj, dict) or set(obj) != {"shape", "dtype", "data"}:
        raise RoutingError("a route record on the wire must be {shape, dtype, data}")
    shape, dtype, data = obj["shape"], obj["dtype"], obj["data"]
    if (
        not isinstance(shape, list)
        or len(shape) != 3
        or not all(type(n) is int and 0 <= n < MAX_WIRE_BYTES for n in shape)
        or dtype not in WIRE_DTYPES
        or not isinstance(data, str)
    ):
        raise RoutingError(f"a route record on the wire has shape {shape!r} and dtype {dtype!r}")
    raw = base64.b64decode(data, validate=True)
    width = torch.empty((), dtype=WIRE_DTYPES[dtype]).element_size()
    if len(raw) != shape[0] * shape[1] * shape[2] * width:
        raise RoutingError("a route record on the wire holds more or fewer bytes than its shape")
    return torch.frombuffer(bytearray(raw), dtype=WIRE_DTYPES[dtype]).view(shape).clone()


def routes_from_vllm(routed: object, tokens: int) -> Tensor:
    """vLLM's `CompletionOutput.routed_experts` of a request asked with
    `routed_experts_prompt_start` = its prompt's length - 1: (tokens, layers, k), one row
    per position from the prompt's last (the one that predicted the first token)."""
    if routed is None:
        raise RoutingError(
            "vLLM returned no routed experts for a completion although routing replay asked for them (enable_return_routed_experts)"
        )
    array = torch.as_tensor(routed.astype("int16") if hasattr(routed, "astype") else routed)
    if array.dim() != 3 or array.shape[0] != tokens:
        raise RoutingError(
            f"vLLM returned routed experts of shape {tuple(array.shape)} for a completion of {tokens} tokens; expected ({tokens}, layers, k)"
        )
    small = array.numel() == 0 or (int(array.min()) >= 0 and int(array.max()) < 256)
    return array.to(torch.uint8 if small else torch.int16)
