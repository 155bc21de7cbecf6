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

Under torchrun (world_size > 1) every rank holds the whole generation batch; each step's
groups are dealt to ranks (`distributed.deal_groups`, by tokens or attention cost), each
rank packs only its share, and every rank's plan is padded with one-token padding
micro-batches to the largest count (computed locally: every rank can plan every rank's
share), since each forward and backward gathers parameters with all ranks. A padding
micro-batch runs forward and a zero-gradient backward (`fsdp.padding_pass`), never the
loss. After the no-grad passes every FSDP unit of the policy and the reference is
resharded (`fsdp.reshard`): with no backward to follow, FSDP2 would keep the root (and
under shard_grad_op every unit) gathered. Normalisers are all-reduced once per step, the gradient norm is global, the
non-finite-skip decision is all-reduced and the step's loss metrics are combined over
ranks, so every rank takes the same decision and rank 0 logs global figures.

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

from leangrpo.checkpoint.local import sample_from_state, sample_state
from leangrpo.contracts import LossInputs, LossNormalisers, PackedBatch, RolloutBatch, RolloutSample
from leangrpo.errors import RunError
from leangrpo.model.policy import Policy
from leangrpo.model.scoring import eval_mode, reference_logprobs, score
from leangrpo.ops.attention.adapter import choose_shared_prefix, packed_support
from leangrpo.train.loss import compute_loss, importance_weights
from leangrpo.train.packing import pack_samples, packing_metrics, plan_micro_batches


@dataclass
class StepResult:
    metrics: dict[str, float]
    updated: bool  # False when a non-finite loss or gradient skipped the update


@dataclass
class PlannedStep:
    micro_batches: list[PackedBatch]  # this rank's, padding micro-batches included (torchrun)
    metrics: dict[str, float]  # packing metrics of this step (this rank's share)
    versions: list[int] = field(default_factory=list)  # of every sample of the step, all ranks


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
    def from_state(
        cls, state: dict, cfg, policy: Policy, rank: int = 0, world_size: int = 1
    ) -> BatchInProgress:
        """`state["attached"]` must be this rank's (the trainer keeps one list per rank)."""
        batch = RolloutBatch([sample_from_state(s) for s in state["samples"]], state["group_size"])
        scored = [s for s in batch.samples if s.reward is not None]
        steps = plan_steps(scored, cfg, policy, rank, world_size)
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


def plan_steps(
    samples: list[RolloutSample], cfg, policy: Policy, rank: int = 0, world_size: int = 1
) -> list[PlannedStep]:
    """Cut a batch into optimizer steps of whole groups, each into packed micro-batches.

    No samples (every reward failed): no steps. With world_size > 1, each step's groups
    are dealt to ranks and this rank's share is planned, padded to the largest count.
    """
    prefix = use_shared_prefix(samples, cfg, policy)
    steps = []
    for step_samples in _split_by_groups(samples, cfg.train.steps_per_generation):
        if not step_samples:
            continue
        versions = [s.version for s in step_samples]
        if world_size > 1:
            step_samples, plan, padding, dealt = _rank_share(
                step_samples, cfg, prefix, rank, world_size
            )
        else:
            plan, padding, dealt = _plan(step_samples, cfg, prefix), 0, {}
        lengths = [s.num_tokens for s in step_samples]
        micro_batches = [
            pack_samples([step_samples[i] for i in idx], shared_prefix=prefix, device=policy.device)
            for idx in plan
        ]
        metrics = _packing_metrics(lengths, plan, cfg, micro_batches)
        metrics["packing/shared_prefix"] = float(prefix)
        metrics["packing/split_groups"] = float(split_groups(step_samples, plan) if prefix else 0)
        if padding:
            from leangrpo.distributed.fsdp import padding_batch

            micro_batches += [padding_batch(0, policy.device) for _ in range(padding)]
        steps.append(PlannedStep(micro_batches, {**metrics, **dealt}, versions))
    return steps


def _packing_metrics(lengths, plan, cfg, micro_batches) -> dict[str, float]:
    if not plan:  # torchrun: a rank dealt no group in this step (it runs padding only)
        return {"packing/tokens": 0.0, "packing/micro_batches": 0.0}
    tokens = [mb.num_tokens for mb in micro_batches]
    return packing_metrics(lengths, plan, cfg.packing.balance, packed_tokens=tokens)


def _plan(step_samples: list[RolloutSample], cfg, prefix: bool) -> list[list[int]]:
    lengths = [s.num_tokens for s in step_samples]
    groups = _group_indices(step_samples) if prefix else None
    prompt_lens = [len(step_samples[g[0]].prompt.ids) for g in groups] if prefix else None
    return plan_micro_batches(
        lengths,
        cfg.train.micro_batch_tokens,
        cfg.packing.balance,
        groups=groups,
        prompt_lens=prompt_lens,
    )


def split_groups(step_samples: list[RolloutSample], plan: list[list[int]]) -> int:
    """Groups whose sequences span more than one micro-batch: a shared-prefix group over
    `train.micro_batch_tokens`, whose prompt is forwarded once per micro-batch it spans."""
    spans: dict[int, set[int]] = defaultdict(set)
    for b, idx in enumerate(plan):
        for i in idx:
            spans[step_samples[i].group_id].add(b)
    return sum(len(bins) > 1 for bins in spans.values())


def _rank_share(step_samples, cfg, prefix: bool, rank: int, world_size: int):
    """This rank's samples of the step, its plan, the padding micro-batches it needs and
    the dealing metrics. Every rank plans every rank's share (no collective)."""
    from leangrpo.distributed.dealing import deal_groups

    groups = _group_indices(step_samples)
    lengths = [[step_samples[i].num_tokens for i in g] for g in groups]
    deal = deal_groups(lengths, world_size, cfg.packing.balance)
    shares = [
        [step_samples[i] for g in deal.groups[r] for i in groups[g]] for r in range(world_size)
    ]
    plans = [_plan(share, cfg, prefix) if share else [] for share in shares]
    count = max(len(p) for p in plans)
    dealt = {
        **deal.metrics(),
        "dist/padding_micro_batches": float(sum(count - len(p) for p in plans)),
    }
    return shares[rank], plans[rank], count - len(plans[rank]), dealt


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
    with eval_mode(policy.model):  # torchrun: padding micro-batches run these passes too
        for mb in (mb for step in steps for mb in step.micro_batches):
            if want_old:
                module = policy.scoring_module
                mb.old_logprobs = score(module, mb, sampling, cfg.logprobs)[0].float()
            if want_ref:
                mb.ref_logprobs = reference_logprobs(policy, mb, sampling, cfg.logprobs).float()
    if policy.root is not None:  # torchrun: no backward follows to reshard what was gathered
        from leangrpo.distributed.fsdp import reshard

        reshard(policy.root)
        if policy.reference is not None:
            reshard(policy.reference)


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
    completions are masked. No micro-batch (a torchrun rank dealt no group in this step,
    which then trains on padding only): 0 tokens."""
    if not cfg.loss.mask_truncated_completions:
        return sum(mb.num_completion_tokens for mb in micro_batches)
    counts = [token_mask(mb, cfg).sum() for mb in micro_batches]
    return int(torch.stack(counts).sum().item()) if counts else 0


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
    policy: Policy,
    micro_batches: list[PackedBatch],
    optimizer,
    cfg,
    sampling,
    loss_cfg,
    ctx=None,  # a DistContext; torchrun ranks take the distributed hooks
) -> StepResult:
    """Accumulate gradients over the micro-batches, clip, and step unless non-finite."""
    ranks = ctx if ctx is not None and ctx.distributed else None
    if ranks is not None:
        from leangrpo.distributed.fsdp import is_padding, padding_pass

        real = [mb for mb in micro_batches if not is_padding(mb)]
        norm = normalisers(real, cfg, ranks.world_size, ranks.all_reduce)
    else:
        norm = normalisers(micro_batches, cfg)
    on_device = []  # per micro-batch: (loss, loss metrics, IS metrics), 0-d tensors
    sums_offload: dict[str, float] = defaultdict(float)
    for mb in micro_batches:
        module = policy.scoring_module
        with _offload_scope(policy):
            if ranks is not None and is_padding(mb):  # the same FSDP collectives, no loss
                padding_pass(module, mb, sampling, cfg.logprobs, backward=True, with_entropy=True)
                continue
            logprobs, entropy = score(module, mb, sampling, cfg.logprobs, with_entropy=True)
            inputs, mb_is = loss_inputs(mb, logprobs, entropy, cfg)
            out = compute_loss(inputs, norm, loss_cfg)
            out.loss.backward()
        on_device.append((out.loss.detach(), out.metrics, mb_is))
        if policy.offloader is not None:  # per micro-batch counts add up to the step's
            for k, v in policy.offloader.metrics().items():
                sums_offload[k] = v if k == "offload/pool_bytes" else sums_offload[k] + v
    total_loss, sums, is_metrics = _sum_on_host(on_device)  # the step's one device sync
    grad_norm = _step_gradients(policy, cfg.train.max_grad_norm, ranks)
    updated = math.isfinite(total_loss) and math.isfinite(grad_norm)
    if ranks is not None:  # every rank steps, or none does
        updated = ranks.all_true(updated)
        sums, is_metrics, total_loss = _combine_ranks(ranks, sums, is_metrics, total_loss)
    if updated:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = _step_metrics(sums, is_metrics, total_loss, grad_norm, micro_batches)
    return StepResult({**metrics, **sums_offload}, updated)


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


def _offload_scope(policy: Policy):
    import contextlib

    return policy.offloader.step() if policy.offloader is not None else contextlib.nullcontext()


def _step_gradients(policy: Policy, max_norm: float | None, ranks) -> float:
    """The step's gradient norm, clipped. Torchrun: after a barrier (the time fast ranks
    wait for the slowest shows there, in wait_s), the norm of the sharded gradients is
    reduced over ranks before clipping."""
    if ranks is None:
        return _clip_gradients(policy, max_norm)
    from leangrpo.distributed.fsdp import clip_grad_norm

    ranks.barrier()
    return clip_grad_norm(policy.trainable_parameters(), max_norm)


def _clip_gradients(policy: Policy, max_norm: float | None) -> float:
    params = [p for p in policy.trainable_parameters() if p.grad is not None]
    if not params:
        return 0.0
    limit = max_norm if max_norm is not None else float("inf")
    return float(torch.nn.utils.clip_grad_norm_(params, limit))


def _combine_ranks(ranks, sums, is_metrics, total_loss):
    """Loss-metric sums added over ranks, IS metrics pooled, the loss averaged: each rank's
    loss carries the normaliser share global / W, so their mean is the step's loss."""
    gathered = ranks.all_gather_object((dict(sums), is_metrics, total_loss))
    combined: dict[str, float] = defaultdict(float)
    for rank_sums, _, _ in gathered:
        for k, v in rank_sums.items():
            combined[k] += v
    pooled = [m for _, rank_is, _ in gathered for m in rank_is]
    return combined, pooled, sum(loss for _, _, loss in gathered) / ranks.world_size


def _step_metrics(sums, is_metrics, total_loss, grad_norm, micro_batches) -> dict[str, float]:
    from leangrpo.train.loss import reduce_metrics

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
