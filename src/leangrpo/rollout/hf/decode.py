"""The hf engine's sampling loop: KV-cached decoding with leangrpo's own sampler.

Algorithm: the left-padded prompts (B, P) are prefilled once into a transformers
`DynamicCache` whose full-attention layers are `kv_cache.PreallocatedLayer`s (room for
P + max_new_tokens positions: a step writes one column instead of re-copying the cache);
for n samples per prompt the cache and the last logits are repeated n times (prompt-major
rows), so a prompt is forwarded once, not n times. Each step then:

1. turns the last logits of the running rows (b, V) into scores with
   `sampling.process_logits` (temperature, top-k, top-p, min-p, in the order the trainer
   reproduces);
2. samples one token per running row by inverse CDF with one uniform from the row's
   generator (`sample_categorical`; argmax at temperature 0) and records its log-prob,
   score[token] - logsumexp(scores) (b,): the full (b, V) log-softmax is never stored;
3. moves the tokens to the host (the one sync per step: EOS and stop strings are checked
   there). Finished rows stay in the batch, fed their last token and never sampled, until
   they are COMPACT_FRACTION of it; then they leave the batch and the cache (one copy), so
   long tails decode with the rows still running without a cache copy at every finish;
4. forwards the batch's tokens (b, 1) with the attention mask grown by one column and
   position ids continuing each row's own count (left padding shifts nothing).

Choices:
- Randomness comes only from the generators passed in: the global torch RNG is never read
  or seeded, so a producer thread cannot disturb the trainer's dropout masks (or the
  reverse). With one generator per prompt, a prompt's rows draw from their own stream
  (one draw per prompt and step), so a group's samples do not depend on which
  prompts share the call: a torchrun rank generating its share of a batch draws what one
  process generating the whole batch draws (given the same logits). Only running rows
  draw, in row order, so when finished rows leave the batch changes no draw.
- A row finishes on an EOS id (kept in its ids: the policy must learn to stop), on a stop
  string in its decoded text (the completing token is kept), or at max_new_tokens.
  (Multi-turn turns, each with its own budget, go through turns.py's continuous batch,
  which shares this module's sampler and its stop rule, `append_token`.)
- Stop strings are checked on the whole decoded completion of each running row after
  each step (exact, as vLLM's result; a suffix-only check could miss a string that a
  tokenizer decodes differently in context).
- Log-probs stay on the device until the loop ends, then cross to the host in one copy.
- Routing replay (`routes`: a mixture of experts' `RoutingControl`): after each forward
  the experts every router chose at each row's last position are kept with the rows that
  sample from its logits (repeated n times after the prefill, like the logits), so token
  t's record is the routing of the forward that sampled it; they cross to the host with
  the log-probs, one (tokens, layers, k) tensor per row.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from leangrpo.contracts import SamplingParams
from leangrpo.rollout.sampling import process_logits

__all__ = [
    "DecodedRow",
    "append_token",
    "cache_kwarg_name",
    "causal_lm",
    "decode",
    "forward_last",
    "sample_next",
]


@dataclass
class DecodedRow:
    """One sampled completion before detokenisation."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stopped: str | None = None  # "eos", "stop" (a stop string), None = max_new_tokens
    routes: torch.Tensor | None = None  # (tokens, MoE layers, k) when the engine records routes


@dataclass
class _Running:
    """Device-side state of the batch (b rows: running ones, and finished ones not yet
    dropped, which keep decoding a filler token and are never sampled)."""

    rows: list[int]  # output row of each batch row
    attention_mask: torch.Tensor  # (b, P + t) long
    positions: torch.Tensor  # (b,) position of each row's last token
    tokens: torch.Tensor  # (b,) last token fed per row
    live: list[int]  # batch indices of the running rows, in order
    live_index: torch.Tensor | None = None  # `live` on the device; None when all rows run


# Finished rows leave the batch (and the KV cache: a copy of it) once they are at least
# this fraction of it; until then they ride along. Chosen with benchmarks/hf_decode.py
# --compact (benchmarks/RESULTS.md, "Generation alone").
COMPACT_FRACTION = 0.25


@torch.no_grad()
def decode(
    model,
    input_ids: torch.Tensor,  # (B, P) left-padded
    attention_mask: torch.Tensor,  # (B, P), 1 = real token
    params: SamplingParams,
    n: int,
    *,
    eos_ids: set[int],
    generator: torch.Generator | Sequence[torch.Generator] | None,
    stop_text=None,  # callable(ids) -> decoded text, needed when params.stop
    routes=None,  # a RoutingControl recording (routing replay), or None
) -> list[DecodedRow]:
    """B * n rows (prompt-major) of at most params.max_new_tokens tokens each.

    `generator`: one stream for the whole call, or one per prompt (B of them).
    """
    longest = params.max_new_tokens
    capacity = input_ids.shape[1] + longest
    cache, cache_kwarg = _new_cache(model, capacity), cache_kwarg_name(model)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
    logits = forward_last(model, cache_kwarg, input_ids, attention_mask, positions, cache)  # (B, V)
    routed = _last_routes(routes, input_ids)  # (B, layers, k) or None
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)
        attention_mask = attention_mask.repeat_interleave(n, dim=0)
        positions = positions.repeat_interleave(n, dim=0)
        routed = None if routed is None else routed.repeat_interleave(n, dim=0)
    out = [DecodedRow() for _ in range(logits.shape[0])]
    rows = list(range(len(out)))
    state = _Running(rows, attention_mask, positions[:, -1], input_ids[:0, 0], list(rows))
    steps: list[tuple[list[int], torch.Tensor]] = []  # (rows, log-probs) per step
    step_routes: list[torch.Tensor] = []  # (live, layers, k) per step, when recording
    for t in range(longest):
        live_logits = logits if state.live_index is None else logits[state.live_index]
        live_rows = [state.rows[i] for i in state.live]
        tokens, logprobs = _sample_rows(live_logits, params, generator, live_rows, n)  # (live,)
        steps.append((live_rows, logprobs))
        if routed is not None:
            step_routes.append(routed if state.live_index is None else routed[state.live_index])
        host = tokens.tolist()
        if host and min(host) < 0:
            raise RuntimeError("the model's logits are not finite: no token can be sampled")
        running = [i for i, token in zip(state.live, host)
                   if not append_token(out[state.rows[i]], token, eos_ids, params.stop, stop_text)
                   and len(out[state.rows[i]].ids) < longest]  # fmt: skip
        if not running or t + 1 == longest:
            break
        _advance(state, cache, tokens, running)
        logits = forward_last(
            model,
            cache_kwarg,
            state.tokens[:, None],
            state.attention_mask,
            state.positions[:, None],
            cache,
        )
        routed = _last_routes(routes, state.tokens[:, None])
    _attach_logprobs(out, steps)
    _attach_routes(out, steps, step_routes)
    return out


def _last_routes(routes, input_ids: torch.Tensor) -> torch.Tensor | None:
    """(rows, layers, k): the routers' experts at each row's last position of the last
    forward (None when not recording)."""
    if routes is None:
        return None
    return routes.last_routes(input_ids.shape[0], input_ids.shape[1])


def _attach_routes(out: list[DecodedRow], steps, step_routes: list[torch.Tensor]) -> None:
    """Each row's (tokens, layers, k) record, in one device -> host copy."""
    if not step_routes:
        return
    every = torch.cat(step_routes).cpu()
    where: dict[int, list[int]] = {}
    for i, row in enumerate(row for step_rows, _ in steps for row in step_rows):
        where.setdefault(row, []).append(i)
    for row, positions in where.items():
        out[row].routes = every[positions]


def _advance(state: _Running, cache, tokens: torch.Tensor, running: list[int]) -> None:
    """Feed the sampled tokens (finished rows repeat their last one), drop finished rows
    when they reach COMPACT_FRACTION of the batch, grow the mask by one column."""
    if state.live_index is None:
        state.tokens = tokens
    else:
        state.tokens = state.tokens.index_put((state.live_index,), tokens)
    if len(running) < len(state.live):
        state.live = running
        if len(state.rows) - len(running) >= COMPACT_FRACTION * len(state.rows):
            index = torch.tensor(running, device=tokens.device)
            cache.batch_select_indices(index)
            state.rows = [state.rows[i] for i in running]
            state.attention_mask = state.attention_mask[index]
            state.positions = state.positions[index]
            state.tokens = state.tokens[index]
            state.live = list(range(len(running)))
        full = len(state.live) == len(state.rows)
        state.live_index = None if full else torch.tensor(state.live, device=tokens.device)
    state.attention_mask = torch.nn.functional.pad(state.attention_mask, (0, 1), value=1)
    state.positions = state.positions + 1


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | Sequence[torch.Generator] | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, V) logits -> sampled tokens (b,) and their processed log-probs (b,) in float32.

    `generator`: one stream for every row, or one per row (each row draws one uniform from
    its own, as it would alone). `uniforms` (b, 1) float64: the rows' draws, already taken
    (then `generator` is unused)."""
    scores = process_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    if params.temperature == 0:
        tokens = scores.argmax(dim=-1)
        return tokens, scores.gather(1, tokens[:, None]).squeeze(1) - scores.logsumexp(-1)
    peak = scores.amax(dim=-1, keepdim=True)  # (b, 1)
    weights = (scores - peak).exp_()  # (b, V) in (0, 1], filtered entries exactly 0
    tokens, total = sample_categorical(weights, generator, uniforms)  # (b,), (b,) float64
    log_z = peak.squeeze(1) + total.log().float()
    return tokens, scores.gather(1, tokens.clamp(min=0)[:, None]).squeeze(1) - log_z


def sample_categorical(
    weights: torch.Tensor,
    generator: torch.Generator | Sequence[torch.Generator] | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row from unnormalised weights (b, V) >= 0, by inverse CDF in float64.

    Two levels, so no (b, V) float64 tensor is built: block sums (b, V / BLOCK) pick the
    block, a cumulative sum inside that block picks the token. A zero weight is never
    drawn (the CDF does not rise there) and one uniform per row is the only randomness,
    where `torch.multinomial` draws V exponentials per row (on CPU most of a large-vocab
    decode step). Returns the tokens (b,), -1 for a row whose weights are not finite, and
    the weight totals (b,). `uniforms` (b, 1) in [0, 1): the rows' draws when the caller
    took them (one generator per prompt: `_sample_rows`).
    """
    b, vocab = weights.shape
    padded = torch.nn.functional.pad(weights, (0, -vocab % BLOCK)) if vocab % BLOCK else weights
    blocks = padded.reshape(b, -1, BLOCK)  # (b, nb, BLOCK), zero weights in the padding
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # (b, nb)
    total = block_cdf[:, -1:]  # (b, 1)
    u = uniforms if uniforms is not None else _uniforms(b, generator, weights.device)
    x = torch.minimum(u * total, total * _BELOW_ONE)  # (b, 1) in [0, total)
    block = torch.searchsorted(block_cdf, x, right=True)  # (b, 1): the first cdf > x
    block = block.clamp_(max=block_cdf.shape[1] - 1)  # reached only by a NaN row
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner = blocks.gather(1, block[:, :, None].expand(b, 1, BLOCK)).squeeze(1)  # (b, BLOCK)
    inner_cdf = inner.cumsum(-1, dtype=torch.float64)
    rest = torch.minimum((x - before).clamp(min=0), inner_cdf[:, -1:] * _BELOW_ONE)
    offset = torch.searchsorted(inner_cdf, rest, right=True)  # (b, 1), < BLOCK
    tokens = torch.where(torch.isfinite(total), block * BLOCK + offset, -1)  # -1: NaN/inf row
    return tokens.squeeze(1), total.squeeze(1)


def _uniforms(rows: int, generator, device) -> torch.Tensor:
    """(rows, 1) float64 uniforms: from one stream, or one from each row's own."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(rows, 1, generator=generator, dtype=torch.float64, device=device)
    return torch.cat(
        [torch.rand(1, 1, generator=g, dtype=torch.float64, device=device) for g in generator]
    )


BLOCK = 256  # tokens per first-level block of sample_categorical
_BELOW_ONE = 1.0 - 2.0**-52  # keeps a draw strictly below its total despite rounding


def _sample_rows(logits, params, generator, rows: list[int], n: int):
    """sample_next over the running rows, each prompt's rows drawing from that prompt's
    generator: the uniforms are taken per prompt (exactly the draws a call per prompt
    would take), the rest runs once over the batch. A call per prompt cost as much as
    the forward itself on a small model (multi-turn turns: one generator per row)."""
    if generator is None or isinstance(generator, torch.Generator) or params.temperature == 0:
        return sample_next(logits, params, generator)
    draws = [
        _uniforms(len(list(run)), generator[prompt], logits.device)
        for prompt, run in itertools.groupby(rows, key=lambda row: row // n)  # prompt-major
    ]
    return sample_next(logits, params, None, torch.cat(draws))


def append_token(row: DecodedRow, token: int, eos_ids: set[int], stop, stop_text) -> bool:
    """Append `token` to the row; True when the row ends with it."""
    row.ids.append(token)
    if token in eos_ids:
        row.stopped = "eos"
    elif stop and any(s in stop_text(row.ids) for s in stop):
        row.stopped = "stop"
    return row.stopped is not None


def _attach_logprobs(out: list[DecodedRow], steps: list[tuple[list[int], torch.Tensor]]) -> None:
    if not steps:
        return
    values = torch.cat([lp for _, lp in steps]).tolist()  # one device -> host copy
    rows = [row for step_rows, _ in steps for row in step_rows]
    for row, value in zip(rows, values):
        out[row].logprobs.append(value)


def forward_last(
    model, cache_kwarg, input_ids, attention_mask, position_ids, cache
) -> torch.Tensor:
    """Logits (b, V) at the last position; `cache` is extended in place."""
    kwargs: dict[str, Any] = {cache_kwarg: cache}
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
        **kwargs,
    )
    return out.logits[:, -1]


def causal_lm(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _new_cache(model, capacity: int):
    """A DynamicCache whose full-attention layers hold `capacity` positions preallocated."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from leangrpo.rollout.hf.kv_cache import PreallocatedLayer

    cache = DynamicCache(config=causal_lm(model).config)  # sliding-window layers as configured
    cache.layers = [
        PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache


def cache_kwarg_name(model) -> str:
    """transformers 5 renamed `past_key_values` to `cache` (the old name is deprecated)."""
    params = inspect.signature(causal_lm(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"
