"""The loss's inputs for one micro-batch, and the step's normalisers.

- `token_mask`: the tokens in the loss (truncated completions out when
  `loss.mask_truncated_completions`).
- `normalisers`: sequence and token counts over the whole optimizer step, counted before
  its first micro-batch, so that each micro-batch's loss is already its exact share and
  summed gradients are the step's. Under torchrun the counts are summed over ranks once
  and each rank divides by its share, global / W (FSDP averages the ranks' gradients).
- `loss_inputs`: the off-policy correction `loss.is_correction` chooses: decoupled (the
  old pass's log-probs, behaviour IS weights), bypass (the behaviour log-probs as old, no
  weights) or none.

See docs/training.md ("Loss normalisers", "Bypass mode has no IS weights").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from leangrpo.config.distill import DistillConfig
from leangrpo.config.training import LossConfig
from leangrpo.contracts import LossInputs, LossNormalisers, PackedBatch
from leangrpo.distill.advantages import distill_advantages
from leangrpo.train.loss import build_mask, importance_weights


def _summed_here(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values]


def normalisers(
    micro_batches: list[PackedBatch],
    loss: LossConfig,
    max_completion_length: int,
    world_size: int = 1,
    sum_over_ranks: Callable[[list[float]], list[float]] = _summed_here,
) -> LossNormalisers:
    """Counts over the whole optimizer step (`micro_batches`: its real ones, no padding).

    `sum_over_ranks` (`StepRanks.all_reduce`, called once) makes the counts global, each
    data-parallel share counted once, and each rank gets its share, global / world_size
    (world_size: the W processes whose gradients FSDP averages), so the gradients of the
    W processes add up to W times one process's. Under context parallelism every rank of
    a share holds the share's whole micro-batches and the same normalisers; its gradients
    cover its own tokens, and the share's ranks together the share's loss once
    (ops/context_parallel/ulysses.py). One process: the counts themselves.
    """
    sequences = sum(mb.num_sequences for mb in micro_batches)
    tokens = _loss_tokens(micro_batches, loss)
    global_sequences, global_tokens = sum_over_ranks([float(sequences), float(tokens)])
    return LossNormalisers(
        sequences=global_sequences / world_size,
        tokens=max(global_tokens, 1.0) / world_size,
        global_tokens=int(max(global_tokens, 1.0)),
        world_size=world_size,
        max_completion_length=max_completion_length,
    )


def _loss_tokens(micro_batches: list[PackedBatch], loss: LossConfig) -> int:
    """Tokens in the loss over the step: host counts, or one device sum when truncated
    completions are masked. No micro-batch (a torchrun rank dealt no group in this step,
    which then trains on padding only): 0 tokens."""
    if not loss.mask_truncated_completions:
        return sum(mb.num_completion_tokens for mb in micro_batches)
    counts = [token_mask(mb, loss).sum() for mb in micro_batches]
    return int(torch.stack(counts).sum().item()) if counts else 0


def token_mask(mb: PackedBatch, loss: LossConfig) -> torch.Tensor:
    """(T,) 1.0 for tokens in the loss; truncated completions drop out when asked."""
    return build_mask(mb.token_seq, mb.truncated, loss.mask_truncated_completions)


def loss_inputs(
    mb: PackedBatch,
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    loss: LossConfig,
    distill: DistillConfig | None = None,
    divergence: torch.Tensor | None = None,
) -> tuple[LossInputs, dict[str, torch.Tensor]]:
    """The loss's view of a micro-batch, with the off-policy correction chosen in config
    (and its IS metrics, 0-d tensors on the device); `distill`: the run's distill section
    (None: no teacher); `divergence`: the (T,) divergence to the teacher (objective jsd)."""
    mask = token_mask(mb, loss)
    behaviour = mb.behaviour_logprobs
    old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach().float()
    weights, metrics = None, {}
    if loss.is_correction == "bypass":
        old = behaviour
    elif loss.is_correction == "decoupled":
        # tokens the current pass filtered out leave the loss: keep them out of the metrics
        in_loss = torch.where(torch.isneginf(logprobs.detach()), 0.0, mask)
        weights, metrics = importance_weights(
            old,
            behaviour,
            mb.token_seq,
            mb.num_sequences,
            in_loss,
            mode=loss.is_mode,
            cap=loss.is_cap,
            min_weight=loss.is_min,
        )
    inputs = LossInputs(
        logprobs=logprobs.float(),
        old_logprobs=old,
        advantages=token_advantages(mb, old, distill),
        mask=mask,
        token_seq=mb.token_seq,
        num_sequences=mb.num_sequences,
        ref_logprobs=mb.ref_logprobs,
        is_weights=weights,
        entropy=entropy,
        teacher_logprobs=mb.teacher_logprobs,
        divergence=divergence,
        divergence_weight=0.0 if divergence is None else distill.weight,
    )
    return inputs, metrics


def token_advantages(
    mb: PackedBatch, old: torch.Tensor, distill: DistillConfig | None
) -> torch.Tensor:
    """(T,) A_t: the sequence's reward advantage, plus distill.weight x the discounted
    reverse-KL rewards against the teacher when there is one (`old`: the student's
    log-probs of the sampled tokens, the ratio's denominator)."""
    advantages = mb.advantages[mb.token_seq]
    if distill is None or distill.objective != "sampled":  # jsd: a loss term of its own
        return advantages
    if mb.teacher_logprobs is None:
        raise RuntimeError("distill is set but no teacher log-probs were attached to the batch")
    kl = distill_advantages(
        old, mb.teacher_logprobs, mb.token_seq, distill.weight, distill.discount
    )
    return advantages.float() + kl
