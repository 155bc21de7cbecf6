"""The sampling transformation shared by rollout engines and the trainer's reference path.

An engine samples token t from softmax(process_logits(logits_t)); the log-prob it reports
for t, and the one the trainer recomputes, is log_softmax(process_logits(logits_t))[t].
Both sides applying the same transformation is what makes the importance ratio 1 when the
policies match.

Order (transformers' order for these warpers; all in float32, filtered entries = -inf):

1. temperature: logits / T. T == 0 means greedy decoding; its log-probs are defined as
   the unfiltered temperature-1 ones (greedy completions are for evaluation, not training).
2. top-k: keep logits >= the k-th largest (ties at the threshold are kept); k = 0 is off.
3. top-p (nucleus): sort ascending, drop the tokens whose cumulative probability is
   <= 1 - top_p, always keep the most likely token; 1.0 is off. Only the hf engine offers
   it (the trainer's chunked lm_head refuses it; see docs/training.md).
4. min-p: keep tokens with p >= min_p * p_max, p from the filtered row; 0 is off.

Top-k and min-p are thresholds on the same ordering and commute; top-p does not commute
with them, hence the fixed order.
"""

from __future__ import annotations

import torch

from leangrpo.contracts import SamplingParams


def check_sampling(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    """One clear error for a value no engine can honour."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p}")


def process_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 processed logits, filtered entries set to -inf."""
    check_sampling(temperature, top_k, top_p, min_p)
    scores = logits.float()
    if temperature == 0:  # greedy: report the model's own distribution
        return scores
    if temperature != 1.0:
        scores = scores / temperature
    if top_k > 0:
        scores = _top_k(scores, top_k)
    if top_p < 1.0:
        scores = _top_p(scores, top_p)
    if min_p > 0.0:
        scores = _min_p(scores, min_p)
    return scores


def processed_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """Log-probs (...,) of token_ids (...,) under the processed distribution of logits (..., V)."""
    scores = process_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    logprobs = torch.log_softmax(scores, dim=-1)
    return logprobs.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    k = min(k, scores.shape[-1])
    kth_largest = torch.topk(scores, k, dim=-1).values[..., -1:]
    return scores.masked_fill(scores < kth_largest, float("-inf"))


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= (1 - top_p)
    drop_sorted[..., -1:] = False  # the most likely token always stays
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = scores.softmax(dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    drop = probs < threshold
    drop.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)  # the most likely token stays
    return scores.masked_fill(drop, float("-inf"))
