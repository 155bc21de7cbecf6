"""One optimizer step on packed micro-batches, and the no-grad passes that precede it.

A generation batch is cut into `steps_per_generation` optimizer steps (whole groups each),
every step into micro-batches of at most `micro_batch_tokens` real tokens, packed once and
reused for all `mu` iterations. Before the first update, the no-grad passes fill in what
the loss needs beyond the current log-probs:

- old log-probs (the ratio's denominator): a separate pass only when the weights will have
  moved before a micro-batch is trained on (mu > 1 or several steps per batch); otherwise
  they are the detached current log-probs and cost nothing. In `bypass` mode the
  behaviour log-probs from the engine stand in for them.
- reference log-probs, only when beta > 0: unfiltered (temperature only, see
  `model.reference_logprobs`), so the KL never meets a reference that excludes a token.

Targets the trainer's top-k / min-p filter excludes (-inf log-prob) are dropped from the
loss and the IS weights by `loss.py` and counted in `loss/filtered_tokens`. IS metrics are
averaged over micro-batches weighted by their tokens (min/max over them).

The loss of each micro-batch is already divided by normalisers counted over the whole
step, so summing micro-batch gradients gives the step's exact gradient.

A batch being trained on is a `BatchInProgress`: its planned steps (old/reference
log-probs attached) and how many of its mu x steps optimizer steps are done. A checkpoint
taken inside a batch saves it whole, so a resume continues with the same micro-batches
and never recomputes old or reference log-probs with weights that have moved since.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from leangrpo.attention import choose_shared_prefix, packed_support
from leangrpo.checkpoint import sample_from_state, sample_state
from leangrpo.contracts import (
    LossInputs,
    LossNormalisers,
    PackedBatch,
    RolloutBatch,
    RolloutSample,
)
from leangrpo.errors import RunError
from leangrpo.loss import compute_loss, importance_weights
from leangrpo.model import Policy, eval_mode, reference_logprobs, score
from leangrpo.packing import pack_samples, packing_metrics, plan_micro_batches


@dataclass
class StepResult:
    metrics: dict[str, float]
    updated: bool  # False when a non-finite loss or gradient skipped the update


@dataclass
class PlannedStep:
    micro_batches: list[PackedBatch]
    metrics: dict[str, float]  # packing metrics of this step


# what the no-grad passes attach to a micro-batch: a checkpoint inside a batch keeps them
NO_GRAD_FIELDS = ("old_logprobs", "ref_logprobs")


@dataclass
class BatchInProgress:
    """A generation batch being trained on: mu iterations over its planned steps."""

    batch: RolloutBatch
    steps: list[PlannedStep]
    iterations: int  # loss.mu
    done: int = 0  # optimizer steps taken on it, over all iterations
    metrics: dict[str, float] = field(default_factory=dict)  # logged with its next step

    @property
    def remaining(self) -> int:
        return self.iterations * len(self.steps) - self.done

    def take(self) -> tuple[PlannedStep, dict[str, float]]:
        """The next step to train (iteration-major order) and the metrics to log with it."""
        planned = self.steps[self.done % len(self.steps)]
        metrics, self.metrics = {**self.metrics, **planned.metrics}, {}
        self.done += 1
        return planned, metrics

    def state_dict(self) -> dict:
        """The samples (re-planned identically on load) and the no-grad passes' tensors."""
        attached = [
            [{k: _cpu(getattr(mb, k)) for k in NO_GRAD_FIELDS} for mb in step.micro_batches]
            for step in self.steps
        ]
        return {
            "samples": [sample_state(s) for s in self.batch.samples],
            "group_size": self.batch.group_size,
            "attached": attached,
            "iterations": self.iterations,
            "done": self.done,
        }

    @classmethod
    def from_state(cls, state: dict, cfg, policy: Policy) -> BatchInProgress:
        batch = RolloutBatch([sample_from_state(s) for s in state["samples"]], state["group_size"])
        steps = plan_steps([s for s in batch.samples if s.reward is not None], cfg, policy)
        micro_batches = [mb for step in steps for mb in step.micro_batches]
        attached = [fields for step in state["attached"] for fields in step]
        fits = len(attached) == len(micro_batches) and all(
            v is None or v.numel() == mb.num_completion_tokens
            for mb, fields in zip(micro_batches, attached)
            for v in fields.values()
        )
        if not fits:
            raise RunError(
                "the checkpoint's batch in progress does not re-plan into the micro-batches "
                "it was saved with; resume with its packing and train settings"
            )
        for mb, fields in zip(micro_batches, attached):
            for name, value in fields.items():
                setattr(mb, name, None if value is None else value.to(policy.device))
        return cls(batch, steps, state["iterations"], state["done"])


def _cpu(value):
    return value.cpu() if value is not None else None


def plan_steps(samples: list[RolloutSample], cfg, policy: Policy) -> list[PlannedStep]:
    """Cut a batch into optimizer steps of whole groups, each into packed micro-batches.

    No samples (every reward failed): no steps.
    """
    prefix = use_shared_prefix(samples, cfg, policy)
    steps = []
    for step_samples in _split_by_groups(samples, cfg.train.steps_per_generation):
        if not step_samples:
            continue
        lengths = [s.num_tokens for s in step_samples]
        groups = _group_indices(step_samples) if prefix else None
        prompt_lens = [len(step_samples[g[0]].prompt.ids) for g in groups] if prefix else None
        plan = plan_micro_batches(
            lengths,
            cfg.train.micro_batch_tokens,
            cfg.packing.balance,
            groups=groups,
            prompt_lens=prompt_lens,
        )
        micro_batches = [
            pack_samples([step_samples[i] for i in idx], shared_prefix=prefix, device=policy.device)
            for idx in plan
        ]
        metrics = packing_metrics(
            lengths,
            plan,
            cfg.packing.balance,
            packed_tokens=[mb.num_tokens for mb in micro_batches],
        )
        metrics["packing/shared_prefix"] = float(prefix)
        steps.append(PlannedStep(micro_batches, metrics))
    return steps


def use_shared_prefix(samples: list[RolloutSample], cfg, policy: Policy) -> bool:
    """packing.shared_prefix: 'auto' turns it on only where it was measured faster."""
    support = packed_support(policy.model)
    if support is None or not support.prefix_kwarg or not samples:
        return False
    prompt_tokens = sum(len(s.prompt.ids) for s in samples)
    stats = {
        "prompt_fraction": prompt_tokens / sum(s.num_tokens for s in samples),
        "group_size": cfg.rollout.num_generations,
    }
    return choose_shared_prefix(cfg.packing.shared_prefix, policy.attention_backend, stats)


def _group_indices(samples: list[RolloutSample]) -> list[list[int]]:
    groups: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        groups[s.group_id].append(i)
    return list(groups.values())


def _split_by_groups(samples: list[RolloutSample], parts: int) -> list[list[RolloutSample]]:
    groups = _group_indices(samples)
    parts = max(1, min(parts, len(groups)))
    bounds = [round(i * len(groups) / parts) for i in range(parts + 1)]
    return [[samples[i] for g in groups[a:b] for i in g] for a, b in zip(bounds, bounds[1:])]


def needs_old_pass(cfg, num_steps: int) -> bool:
    reused = cfg.loss.mu > 1 or num_steps > 1
    return cfg.loss.is_correction != "bypass" and reused


@torch.no_grad()
def attach_old_and_ref(policy: Policy, steps: list[PlannedStep], cfg, sampling) -> None:
    """Fill in old and reference log-probs on every micro-batch before the first update."""
    want_old = needs_old_pass(cfg, len(steps))
    want_ref = cfg.loss.beta > 0
    if not (want_old or want_ref):
        return
    with eval_mode(policy.model):
        for mb in (mb for step in steps for mb in step.micro_batches):
            if want_old:
                mb.old_logprobs = score(policy.model, mb, sampling, cfg.logprobs)[0].float()
            if want_ref:
                mb.ref_logprobs = reference_logprobs(policy, mb, sampling, cfg.logprobs).float()


def normalisers(
    micro_batches: list[PackedBatch],
    cfg,
    world_size: int = 1,
    sum_over_ranks: Callable[[list[float]], list[float]] | None = None,
) -> LossNormalisers:
    """Counts over the whole optimizer step.

    With `sum_over_ranks` (e.g. `DistContext.all_reduce`, called once) the counts are
    global and each rank gets its share, global / world_size: FSDP averages the ranks'
    gradients, so the ranks' losses must add up to W times the loss of one process.
    """
    sequences = sum(mb.num_sequences for mb in micro_batches)
    tokens = _loss_tokens(micro_batches, cfg)
    if sum_over_ranks is None:
        return LossNormalisers(
            sequences=sequences,
            tokens=max(tokens, 1),
            global_tokens=max(tokens, 1) * world_size,  # single process: local == global
            world_size=world_size,
            max_completion_length=cfg.rollout.max_new_tokens,
        )
    global_sequences, global_tokens = sum_over_ranks([float(sequences), float(tokens)])
    return LossNormalisers(
        sequences=global_sequences / world_size,
        tokens=max(global_tokens, 1.0) / world_size,
        global_tokens=int(max(global_tokens, 1.0)),
        world_size=world_size,
        max_completion_length=cfg.rollout.max_new_tokens,
    )


def _loss_tokens(micro_batches: list[PackedBatch], cfg) -> int:
    """Tokens in the loss over the step: host counts, or one device sum when truncated
    completions are masked."""
    if not cfg.loss.mask_truncated_completions:
        return sum(mb.num_completion_tokens for mb in micro_batches)
    counts = [token_mask(mb, cfg).sum() for mb in micro_batches]
    return int(torch.stack(counts).sum().item())


def token_mask(mb: PackedBatch, cfg) -> torch.Tensor:
    """(T,) 1.0 for tokens in the loss; truncated completions drop out when asked."""
    mask = torch.ones_like(mb.behaviour_logprobs, dtype=torch.float32)
    if cfg.loss.mask_truncated_completions:
        mask = mask * (~mb.truncated).float()[mb.token_seq]
    return mask


def loss_inputs(
    mb: PackedBatch, logprobs, entropy, cfg
) -> tuple[LossInputs, dict[str, torch.Tensor]]:
    """The loss's view of a micro-batch, with the off-policy correction chosen in config
    (and its IS metrics, 0-d tensors on the device)."""
    mask = token_mask(mb, cfg)
    behaviour = mb.behaviour_logprobs
    old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach().float()
    weights, metrics = None, {}
    if cfg.loss.is_correction == "bypass":
        old = behaviour
    elif cfg.loss.is_correction == "decoupled":
        # tokens the current pass filtered out leave the loss: keep them out of the metrics
        in_loss = torch.where(torch.isneginf(logprobs.detach()), 0.0, mask)
        weights, is_metrics = importance_weights(
            old,
            behaviour,
            mb.token_seq,
            mb.num_sequences,
            in_loss,
            mode=cfg.loss.is_mode,
            cap=cfg.loss.is_cap,
            min_weight=cfg.loss.is_min,
        )
        metrics = is_metrics
    inputs = LossInputs(
        logprobs=logprobs.float(),
        old_logprobs=old,
        advantages=mb.advantages[mb.token_seq],
        mask=mask,
        token_seq=mb.token_seq,
        num_sequences=mb.num_sequences,
        ref_logprobs=mb.ref_logprobs,
        is_weights=weights,
        entropy=entropy,
    )
    return inputs, metrics


def train_step(
    policy: Policy, micro_batches: list[PackedBatch], optimizer, cfg, sampling, loss_cfg
) -> StepResult:
    """Accumulate gradients over the micro-batches, clip, and step unless non-finite."""
    norm = normalisers(micro_batches, cfg)
    on_device = []  # per micro-batch: (loss, loss metrics, IS metrics), 0-d tensors
    sums_offload: dict[str, float] = defaultdict(float)
    for mb in micro_batches:
        with _offload_scope(policy):
            logprobs, entropy = score(policy.model, mb, sampling, cfg.logprobs, with_entropy=True)
            inputs, mb_is = loss_inputs(mb, logprobs, entropy, cfg)
            out = compute_loss(inputs, norm, loss_cfg)
            out.loss.backward()
        on_device.append((out.loss.detach(), out.metrics, mb_is))
        if policy.offloader is not None:  # per micro-batch counts add up to the step's
            for k, v in policy.offloader.metrics().items():
                sums_offload[k] = v if k == "offload/pool_bytes" else sums_offload[k] + v
    total_loss, sums, is_metrics = 0.0, defaultdict(float), []
    for loss, mb_metrics, mb_is in _to_host(on_device):  # the step's one device sync
        total_loss += loss
        for k, v in mb_metrics.items():
            sums[k] += v
        if mb_is:
            is_metrics.append(mb_is)
    grad_norm = _clip_gradients(policy, cfg.train.max_grad_norm)
    updated = math.isfinite(total_loss) and math.isfinite(grad_norm)
    if updated:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = _step_metrics(sums, is_metrics, total_loss, grad_norm, micro_batches)
    return StepResult({**metrics, **sums_offload}, updated)


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


def _offload_scope(policy: Policy):
    import contextlib

    return policy.offloader.step() if policy.offloader is not None else contextlib.nullcontext()


def _clip_gradients(policy: Policy, max_norm: float | None) -> float:
    params = [p for p in policy.trainable_parameters() if p.grad is not None]
    if not params:
        return 0.0
    limit = max_norm if max_norm is not None else float("inf")
    return float(torch.nn.utils.clip_grad_norm_(params, limit))


def _step_metrics(sums, is_metrics, total_loss, grad_norm, micro_batches) -> dict[str, float]:
    from leangrpo.loss import reduce_metrics

    metrics = {f"loss/{k}": v for k, v in reduce_metrics(dict(sums)).items()}
    metrics.update(reduce_is_metrics(is_metrics))
    metrics.update(
        {
            "loss": total_loss,
            "grad_norm": grad_norm,
        }
    )
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
