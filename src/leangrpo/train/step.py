"""One optimizer step over packed micro-batches: accumulate, clip, update or skip.

Each micro-batch's loss is already divided by normalisers counted over the whole step
(inputs.py), so summing the micro-batches' gradients gives the step's exact gradient.
Targets the trainer's top-k / min-p filter excludes (-inf log-prob) are dropped from the
loss and the IS weights by loss.py and counted in `loss/filtered_tokens`. The step's
figures reach the host in one copy: the loss metrics as means over the step's tokens
(`loss.sums_to_means`), the IS metrics averaged over micro-batches weighted by their
tokens (min/max over them). A non-finite loss or gradient norm skips the update. A
mixture of experts adds its router's auxiliary loss (when asked) to each micro-batch's
loss and logs `moe/*` (routing flips, the aux loss; model/moe/control.py); `loss` stays
the policy objective.

The ranks are a `contracts.StepRanks`, picked at set-up: one process (identities) or
torchrun, where the normaliser counts are all-reduced once, padding micro-batches run a
forward and a zero-gradient backward (never the loss), the gradient norm is global, the
skip decision is all-reduced and the loss metrics are combined over ranks, so every rank
takes the same decision and rank 0 logs global figures.

With distill.objective: jsd each micro-batch first runs the teacher's forward (no_grad,
`model.scoring.teacher_rows`: its final hidden states at the completion-predicting
positions of this rank's row, and its head; a sharded teacher's head copied while
gathered), then the student's scoring pass with the tiled divergence in the same sweep of
its head; the teacher's rows live until that micro-batch's backward is done (padding
micro-batches make the same forwards). See docs/distributed.md
("A step", "Gradients are averaged over ranks").
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from leangrpo.contracts import PackedBatch, SamplingParams, StepRanks
from leangrpo.distributed.dealing import padding_pass
from leangrpo.model.policy import Policy
from leangrpo.model.scoring import eval_mode, score, score_distill, teacher_rows
from leangrpo.train.inputs import loss_inputs, normalisers
from leangrpo.train.loss import compute_loss, sums_to_means
from leangrpo.train.ranks import ONE_PROCESS


@dataclass
class StepResult:
    metrics: dict[str, float]
    updated: bool  # False when a non-finite loss or gradient skipped the update


def train_step(
    policy: Policy,
    micro_batches: list[PackedBatch],
    optimizer: torch.optim.Optimizer,
    cfg,
    sampling: SamplingParams,
    ranks: StepRanks = ONE_PROCESS,
) -> StepResult:
    """Accumulate gradients over the micro-batches, clip, and step unless non-finite.

    `cfg`: the run's Config (its loss, logprobs, rollout and train sections)."""
    real = [mb for mb in micro_batches if not mb.padding]
    norm = normalisers(real, cfg.loss, cfg.model_token_budget(), ranks.processes, ranks.all_reduce)
    on_device = []  # per micro-batch: (loss, loss metrics, IS metrics), 0-d tensors
    sums_offload: dict[str, float] = defaultdict(float)
    jsd = cfg.distill is not None and cfg.distill.objective == "jsd"
    for mb in micro_batches:
        module = policy.scoring_module
        teacher = _teacher_rows(policy, mb, cfg.distill.jsd_beta) if jsd else None
        with _offload_scope(policy):
            if mb.padding:  # torchrun: the same FSDP collectives as the peers, no loss
                padding_pass(module, mb, sampling, cfg.logprobs, backward=True, with_entropy=True,
                             teacher=teacher)  # fmt: skip
                continue
            divergence = None
            if teacher is None:
                logprobs, entropy = score(module, mb, sampling, cfg.logprobs, with_entropy=True)
            else:
                logprobs, entropy, divergence = score_distill(
                    module, mb, sampling, cfg.logprobs, teacher
                )
            inputs, mb_is = loss_inputs(mb, logprobs, entropy, cfg.loss, cfg.distill, divergence)
            out = compute_loss(inputs, norm, cfg.loss)
            policy.routing.loss_with_aux(out.loss, inputs, norm).backward()  # MoE: + aux loss
        on_device.append((out.loss.detach(), out.metrics, mb_is))
        if policy.offloader is not None:  # per micro-batch counts add up to the step's
            for k, v in policy.offloader.metrics().items():
                sums_offload[k] = v if k == "offload/pool_bytes" else sums_offload[k] + v
        del teacher  # its hidden states (and a sharded teacher's head copy) go now
    if jsd:  # the teacher's FSDP root stays gathered after its forwards: reshard it
        ranks.release_gathered(policy)
    total_loss, sums, is_metrics = _sum_on_host(on_device)  # the step's one device sync
    grad_norm = ranks.clip_gradients(policy.trainable_parameters(), cfg.train.max_grad_norm)
    updated = ranks.all_true(math.isfinite(total_loss) and math.isfinite(grad_norm))
    sums, is_metrics, total_loss = _combine_ranks(ranks, sums, is_metrics, total_loss)
    if updated:  # every rank steps, or none does
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = _step_metrics(sums, is_metrics, total_loss, grad_norm)
    moe = policy.routing.step_metrics(ranks)  # routing flips, aux loss (mixtures of experts)
    return StepResult({**metrics, **sums_offload, **moe}, updated)


def _sum_on_host(on_device: list[tuple]) -> tuple[float, dict[str, float], list[dict]]:
    """The step's loss, summed loss metrics and per-micro-batch IS metrics, as floats."""
    total_loss, sums, is_metrics = 0.0, defaultdict(float), []
    for loss, mb_metrics, mb_is in _to_host(on_device):
        total_loss += loss
        for k, v in mb_metrics.items():
            sums[k] += v
        if mb_is:
            is_metrics.append(mb_is)
    return total_loss, sums, is_metrics


def _to_host(per_micro_batch: list[tuple]) -> list[tuple[float, dict, dict]]:
    """(loss, metrics, IS metrics) of every micro-batch as floats, in one device -> host
    copy (float64: each value is exactly what float() of its tensor gives)."""
    flat = [t for loss, m, i in per_micro_batch for t in (loss, *m.values(), *i.values())]
    if not flat:
        return []
    values = iter(torch.stack([t.reshape(()).to(torch.float64) for t in flat]).tolist())
    return [
        (next(values), {k: next(values) for k in m}, {k: next(values) for k in i})
        for _, m, i in per_micro_batch
    ]


def _teacher_rows(policy: Policy, mb: PackedBatch, beta: float):
    """The teacher's rows of `mb` for the jsd objective: its forward under no_grad, in eval
    mode (it always is), one micro-batch at a time."""
    if policy.teacher is None:
        raise RuntimeError("distill.objective: jsd needs the teacher loaded (policy.teacher)")
    with eval_mode(policy.teacher):
        return teacher_rows(policy.teacher, mb, beta)


def _offload_scope(policy: Policy):
    return policy.offloader.step() if policy.offloader is not None else contextlib.nullcontext()


def _combine_ranks(ranks: StepRanks, sums, is_metrics, total_loss):
    """Loss-metric sums added over the shares, IS metrics pooled, the loss averaged: each
    share's loss carries the normaliser share global / W (W processes), so their sum over
    the shares, divided by W, is the step's loss (one process: the figures themselves).
    Under context parallelism the ranks of a share computed the same loss and metrics on
    the same (T,) vectors: each share counts once."""
    gathered = ranks.all_gather_object((dict(sums), is_metrics, total_loss))
    combined: dict[str, float] = defaultdict(float)
    for rank_sums, _, _ in gathered:
        for k, v in rank_sums.items():
            combined[k] += v
    pooled = [m for _, rank_is, _ in gathered for m in rank_is]
    return combined, pooled, sum(loss for _, _, loss in gathered) / ranks.processes


def _step_metrics(sums, is_metrics, total_loss, grad_norm) -> dict[str, float]:
    metrics = {f"loss/{k}": v for k, v in sums_to_means(dict(sums)).items()}
    metrics.update(reduce_is_metrics(is_metrics))
    metrics.update({"loss": total_loss, "grad_norm": grad_norm})
    return metrics


def reduce_is_metrics(per_micro_batch: list[dict[str, float]]) -> dict[str, float]:
    """IS metrics of the step: token-weighted means, min of mins, max of maxes.

    Each entry holds one micro-batch's means and its `is/tokens`; micro-batches without a
    token in the loss carry no value (their 0 placeholders would drag a min down).
    """
    counted = [m for m in per_micro_batch if m["is/tokens"] > 0]
    names = [k for k in (per_micro_batch[0] if per_micro_batch else {}) if k != "is/tokens"]
    tokens = sum(m["is/tokens"] for m in counted)
    out = {}
    for name in names:
        if not counted:
            out[name] = 0.0
        elif name.endswith("_min"):
            out[name] = min(m[name] for m in counted)
        elif name.endswith("_max"):
            out[name] = max(m[name] for m in counted)
        else:
            out[name] = sum(m[name] * m["is/tokens"] for m in counted) / tokens
    return out
