"""Plain computations that the packed, chunked and sampling paths are checked against:
one sequence at a time, one ordinary forward, full logits."""

from __future__ import annotations

import torch

from leangrpo.contracts import RolloutSample, SamplingParams
from leangrpo.rollout.sampling import processed_logprobs


def per_sequence_logprobs(
    model, samples: list[RolloutSample], temperature: float = 1.0
) -> torch.Tensor:
    """Every sample's completion log-probs under a full log-softmax of logits / temperature,
    concatenated in sample order: (total completion tokens,)."""
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt.ids + s.completion.ids])
        logits = model(input_ids=ids, use_cache=False).logits[0] / temperature
        p = len(s.prompt.ids)
        logp = torch.log_softmax(logits[p - 1 : -1], -1)
        out.append(logp.gather(1, torch.tensor(s.completion.ids)[:, None])[:, 0])
    return torch.cat(out)


def teacher_forced_logprobs(
    model, prompt_ids: list[int], completion_ids: list[int], params: SamplingParams
) -> torch.Tensor:
    """The log-probs a sampler must report for this completion: the completion fed in after
    its prompt, then the sampling transformation the engines share: (completion tokens,)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0]  # (P + L, V)
    targets = torch.tensor(completion_ids)
    return processed_logprobs(logits[len(prompt_ids) - 1 : -1], targets, params)
