"""The hf engine's sampling loop: KV-cached decoding with leangrpo's own sampler.

Algorithm: the left-padded prompts (B, P) are prefilled once into a transformers
`DynamicCache`; for n samples per prompt the cache and the last logits are repeated n
times (prompt-major rows), so a prompt is forwarded once, not n times. Each step then:

1. turns the last logits (b, V) into scores with `sampling.process_logits` (temperature,
   top-k, top-p, min-p, in the order the trainer reproduces);
2. samples one token per row with `torch.multinomial(..., generator=...)` (argmax at
   temperature 0) and records its log-prob, score[token] - logsumexp(scores) (b,): the
   full (b, V) log-softmax is never stored;
3. moves the tokens to the host (the one sync per step: EOS and stop strings are checked
   there), and drops the rows that finished from the batch and the cache, so long tails
   decode with the rows still running;
4. forwards the surviving tokens (b, 1) with the attention mask grown by one column and
   position ids continuing each row's own count (left padding shifts nothing).

Choices:
- Randomness comes only from the generators passed in: the global torch RNG is never read
  or seeded, so a producer thread cannot disturb the trainer's dropout masks (or the
  reverse). With one generator per prompt, a prompt's rows draw from their own stream
  (one `multinomial` per prompt and step), so a group's samples do not depend on which
  prompts share the call: a torchrun rank generating its share of a batch draws what one
  process generating the whole batch draws (given the same logits).
- A row finishes on an EOS id (kept in its ids: the policy must learn to stop), on a stop
  string in its decoded text (the completing token is kept), or at max_new_tokens.
- Stop strings are checked on the whole decoded completion of each running row after
  each step (exact, as vLLM's result; a suffix-only check could miss a string that a
  tokenizer decodes differently in context).
- Log-probs stay on the device until the loop ends, then cross to the host in one copy.
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

__all__ = ["DecodedRow", "decode"]


@dataclass
class DecodedRow:
    """One sampled completion before detokenisation."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stopped: str | None = None  # "eos", "stop" (a stop string), None = max_new_tokens


@dataclass
class _Running:
    """Device-side state of the rows still decoding (b of them)."""

    rows: list[int]  # output row of each running row
    attention_mask: torch.Tensor  # (b, P + t) long
    positions: torch.Tensor  # (b,) position of each row's last token


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
) -> list[DecodedRow]:
    """B * n rows (prompt-major) of at most params.max_new_tokens tokens each.

    `generator`: one stream for the whole call, or one per prompt (B of them).
    """
    cache, cache_kwarg = _new_cache(model), _cache_kwarg(model)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
    logits = _forward(model, cache_kwarg, input_ids, attention_mask, positions, cache)  # (B, V)
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)
        attention_mask = attention_mask.repeat_interleave(n, dim=0)
        positions = positions.repeat_interleave(n, dim=0)
    out = [DecodedRow() for _ in range(logits.shape[0])]
    state = _Running(list(range(len(out))), attention_mask, positions[:, -1])
    steps: list[tuple[list[int], torch.Tensor]] = []  # (rows, log-probs (b,)) per step
    for t in range(params.max_new_tokens):
        tokens, logprobs = _sample_rows(logits, params, generator, state.rows, n)  # (b,), (b,)
        steps.append((state.rows, logprobs))
        host = tokens.tolist()
        keep = [i for i, (row, token) in enumerate(zip(state.rows, host))
                if not _finished(out[row], token, eos_ids, params.stop, stop_text)]  # fmt: skip
        if not keep or t + 1 == params.max_new_tokens:
            break
        if len(keep) < len(state.rows):
            tokens = _drop_finished(state, cache, keep, tokens)
        state.attention_mask = torch.nn.functional.pad(state.attention_mask, (0, 1), value=1)
        state.positions = state.positions + 1
        logits = _forward(
            model,
            cache_kwarg,
            tokens[:, None],
            state.attention_mask,
            state.positions[:, None],
            cache,
        )
    _attach_logprobs(out, steps)
    return out


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, V) logits -> sampled tokens (b,) and their processed log-probs (b,) in float32."""
    scores = process_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    log_z = torch.logsumexp(scores, dim=-1)  # (b,)
    if params.temperature == 0:
        tokens = scores.argmax(dim=-1)
    else:
        probs = (scores - log_z[:, None]).exp_()  # filtered entries are exactly 0
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return tokens, scores.gather(1, tokens[:, None]).squeeze(1) - log_z


def _sample_rows(logits, params, generator, rows: list[int], n: int):
    """sample_next over the running rows, each prompt's rows with that prompt's generator."""
    if generator is None or isinstance(generator, torch.Generator):
        return sample_next(logits, params, generator)
    tokens, logprobs, start = [], [], 0
    for prompt, run in itertools.groupby(rows, key=lambda row: row // n):  # prompt-major
        stop = start + len(list(run))
        t, lp = sample_next(logits[start:stop], params, generator[prompt])
        tokens.append(t)
        logprobs.append(lp)
        start = stop
    return torch.cat(tokens), torch.cat(logprobs)


def _finished(row: DecodedRow, token: int, eos_ids: set[int], stop, stop_text) -> bool:
    """Append `token` to the row; True when the row ends with it."""
    row.ids.append(token)
    if token in eos_ids:
        row.stopped = "eos"
    elif stop and any(s in stop_text(row.ids) for s in stop):
        row.stopped = "stop"
    return row.stopped is not None


def _drop_finished(state: _Running, cache, keep: list[int], tokens: torch.Tensor):
    """Keep only the running rows at indices `keep`, in the batch and in the KV cache."""
    index = torch.tensor(keep, device=tokens.device)
    cache.batch_select_indices(index)
    state.rows = [state.rows[i] for i in keep]
    state.attention_mask = state.attention_mask[index]
    state.positions = state.positions[index]
    return tokens[index]


def _attach_logprobs(out: list[DecodedRow], steps: list[tuple[list[int], torch.Tensor]]) -> None:
    if not steps:
        return
    values = torch.cat([lp for _, lp in steps]).tolist()  # one device -> host copy
    rows = [row for step_rows, _ in steps for row in step_rows]
    for row, value in zip(rows, values):
        out[row].logprobs.append(value)


def _forward(model, cache_kwarg, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
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


def _causal_lm(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=_causal_lm(model).config)  # sliding-window layers as configured


def _cache_kwarg(model) -> str:
    """transformers 5 renamed `past_key_values` to `cache` (the old name is deprecated)."""
    params = inspect.signature(_causal_lm(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"
