"""The GRPO objective family, KL k3 and the importance-sampling (IS) correction.

Configured by the config's own `loss` section (`config.training.LossConfig`, validated
there: one copy of the settings); docs/training.md gives the reasons.
Every variant is three small pieces picked from a registry (no string branches):

    ratio      token: r_t = exp(logp_t - old_t)
               sequence (gspo): s_i = exp(mean_t(logp_t - old_t)) over the sequence's
               unmasked tokens, applied to each token as sg[s_i] * exp(logp_t - sg[logp_t])
    objective  clipped (PPO): -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), with the
               unclipped r capped at `delta` when set (two-sided clip, as TRL)
               cispo: -sg[min(r, eps_high)] A logp (no min; eps_high is the cap, ~5)
    reducer    grpo, gspo: sum over sequences of each sequence's token mean / norm.sequences
               bnpo: token sum / norm.tokens
               dr_grpo: token sum / (norm.sequences * norm.max_completion_length)
               dapo, cispo: token sum / (norm.global_tokens / norm.world_size)

The normalisers are counted over the whole optimizer step before its first micro-batch,
so the loss returned for one micro-batch is already its exact share of the step loss:
the trainer calls backward() on each and the sum over micro-batches is the step loss
(and, under DDP's gradient mean over ranks, dapo's sum over all ranks / global tokens).
A denominator of 0 (every token of the step masked) is taken as 1: the loss is then 0.

Choices:
- KL k3 (exp(ref - logp) - (ref - logp) - 1) is added as beta * kl per token, and is not
  multiplied by the IS weights: the weights correct the policy-gradient term for sampling
  from the behaviour policy; the KL estimate is a regulariser on the current policy.
- `inputs.mask` is a 0/1 selection, applied with `torch.where`, never by multiplication:
  a masked token may hold -inf or nan-producing values (-inf x 0 = nan) and must leave
  neither the loss nor the gradient. The trainer zeroes the tokens of truncated sequences
  when `mask_truncated_completions` is set (see `build_mask`).
- Filtered targets: with top-k / min-p, a sampled token can lie outside the trainer's
  filtered set (engine and trainer kernels rank a boundary token differently, or the
  weights moved since sampling): its log-prob is -inf. A token whose current, old or
  reference log-prob is -inf is dropped from the loss like a masked one (its inputs are
  replaced by 0 before any arithmetic, so its gradient is exactly 0) and counted in
  `filtered_tokens`. NaN is not dropped: it means a broken step, which the trainer skips.
  The token-sum normalisers (bnpo, dr_grpo, dapo, cispo) are counted before the forward
  that finds these tokens, so a filtered token still counts in their denominator (as a
  token with zero loss); grpo and gspo average over the kept tokens of each sequence.
- A distillation divergence (`inputs.divergence`, distill.objective: jsd) is added as
  divergence_weight x its sum over the kept tokens / norm.tokens, whatever loss.type: the
  token mean over the step, TRL's DistillationTrainer reduction. Like the KL it is not
  multiplied by the IS weights (it is the current policy's divergence, not an estimate
  from samples of the behaviour policy's).
- IS correction modes: "decoupled" = the trainer computes old log-probs with a no-grad
  pass and `importance_weights(old, behaviour, ...)` gives detached weights that multiply
  the policy term; "bypass" = the trainer passes the behaviour log-probs as
  `old_logprobs` and no weights (the ratio itself corrects, bounded by the clip); "none" =
  no weights. `importance_weights` is only used in decoupled mode: its weight old /
  behaviour is 1 by construction in bypass mode, so `is_mode`, `is_cap` and `is_min` do
  nothing there, and preflight lists them among the ignored options as for "none".
- Sequence-level ratios (gspo and the sequence IS modes) are geometric means, i.e. means
  of per-token log-ratios, never sums (a sum makes them depend on the length).
- Metrics are sums over the micro-batch (0-dim tensors, no host sync) so they aggregate
  exactly over micro-batches; `METRIC_COUNTS` says what each is summed over and
  `sums_to_means` turns accumulated sums into means.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from leangrpo.config.training import LossConfig
from leangrpo.contracts import LossInputs, LossNormalisers, LossOutputs

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# metric -> the count metric it is summed over (None: the metric is itself a count)
METRIC_COUNTS: dict[str, str | None] = {
    "tokens": None,  # completion tokens in the loss (unmasked and not filtered)
    "filtered_tokens": None,  # unmasked tokens dropped for a -inf log-prob (top-k / min-p)
    "sequences": None,  # sequences in the micro-batch
    "clip/low_frac": "tokens",  # r < 1 - eps_low and A < 0 (cispo: always 0)
    "clip/high_frac": "tokens",  # r > 1 + eps_high and A > 0 (cispo: r > eps_high)
    "clip/region_frac": "tokens",  # r outside [1 - eps_low, 1 + eps_high] (cispo: = high)
    "ratio/mean": "tokens",  # the ratio the objective used (gspo: the sequence ratio)
    "kl": "tokens",  # k3, only when ref_logprobs are given
    "entropy": "tokens",  # only when entropy is given
    "is/weight_applied": "tokens",  # only when is_weights are given
    # log p_policy - log p_teacher of the sampled tokens (a distillation teacher's log-probs
    # given): the sampled estimate of KL(policy || teacher) per token
    "distill/reverse_kl": "tokens",
    # the per-token divergence to the teacher (distill.objective: jsd), the loss's own term
    "distill/jsd": "tokens",
}


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")


# ---------------------------------------------------------------------------- helpers


def _upcast(x: Tensor) -> Tensor:
    """Loss maths in at least float32 (bf16 log-prob differences lose the ratio)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _sequence_sum(values: Tensor, token_seq: Tensor, num_sequences: int) -> Tensor:
    """(T,) -> (S,) sums per sequence, one index_add (no loop, no host sync)."""
    out = values.new_zeros(num_sequences)
    return out.index_add(0, token_seq, values)


def _select(values: Tensor, mask: Tensor) -> Tensor:
    """(T,) values where mask > 0, exactly 0 elsewhere (even where values are inf or nan)."""
    return torch.where(mask > 0, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _sequence_mean(values: Tensor, mask: Tensor, token_seq: Tensor, num_sequences: int) -> Tensor:
    """(T,) -> (S,) mean over each sequence's masked tokens (0 for a fully masked one)."""
    total = _sequence_sum(_select(values, mask), token_seq, num_sequences)
    count = _sequence_sum((mask > 0).to(values.dtype), token_seq, num_sequences)
    return total / count.clamp(min=1.0)


def build_mask(token_seq: Tensor, truncated: Tensor, mask_truncated_completions: bool) -> Tensor:
    """(T,) float mask: 1 everywhere, 0 on tokens of truncated sequences when asked."""
    if not mask_truncated_completions:
        return torch.ones(token_seq.shape, dtype=torch.float32, device=token_seq.device)
    return (~truncated.bool())[token_seq].float()


# ---------------------------------------------------------------------------- ratios


def token_ratio(logp: Tensor, old: Tensor, inputs: LossInputs) -> Tensor:
    """(T,) r_t = exp(logp_t - old_t)."""
    return torch.exp(logp - old)


def sequence_ratio(logp: Tensor, old: Tensor, inputs: LossInputs) -> Tensor:
    """(T,) GSPO: sg[s_i] * exp(logp_t - sg[logp_t]), s_i the geometric-mean ratio."""
    log_s = _sequence_mean(logp - old, inputs.mask, inputs.token_seq, inputs.num_sequences)  # (S,)
    log_s_tok = log_s.detach()[inputs.token_seq]  # (T,)
    return torch.exp(log_s_tok + logp - logp.detach())


# ---------------------------------------------------------------------------- objectives


def clipped_objective(ratio: Tensor, adv: Tensor, logp: Tensor, cfg: LossConfig) -> Tensor:
    """(T,) PPO clip: -min(r A, clip(r) A), r capped at delta in the unclipped term."""
    clipped = ratio.clamp(1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
    unclipped = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
    return -torch.minimum(unclipped * adv, clipped * adv)


def cispo_objective(ratio: Tensor, adv: Tensor, logp: Tensor, cfg: LossConfig) -> Tensor:
    """(T,) CISPO: -sg[min(r, eps_high)] A logp; every token keeps a gradient."""
    return -ratio.clamp(max=cfg.epsilon_high).detach() * adv * logp


def _clip_flags(ratio: Tensor, adv: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor, Tensor]:
    """(T,) bool each: low-clipped, high-clipped, outside the trust region."""
    if cfg.type == "cispo":
        high = ratio > cfg.epsilon_high
        return torch.zeros_like(high), high, high
    below = ratio < 1.0 - cfg.epsilon_low
    above = ratio > 1.0 + cfg.epsilon_high
    return below & (adv < 0), above & (adv > 0), below | above


# ---------------------------------------------------------------------------- reducers


def _denominator(value: float) -> float:
    return float(value) if value > 0 else 1.0


def reduce_sequence_mean(per_token: Tensor, inputs: LossInputs, norm: LossNormalisers) -> Tensor:
    per_seq = _sequence_mean(per_token, inputs.mask, inputs.token_seq, inputs.num_sequences)
    return per_seq.sum() / _denominator(norm.sequences)


def reduce_tokens(per_token: Tensor, inputs: LossInputs, norm: LossNormalisers) -> Tensor:
    return _select(per_token, inputs.mask).sum() / _denominator(norm.tokens)


def reduce_max_length(per_token: Tensor, inputs: LossInputs, norm: LossNormalisers) -> Tensor:
    denominator = norm.sequences * norm.max_completion_length
    return _select(per_token, inputs.mask).sum() / _denominator(denominator)


def reduce_global_tokens(per_token: Tensor, inputs: LossInputs, norm: LossNormalisers) -> Tensor:
    tokens_per_rank = norm.global_tokens / norm.world_size
    return _select(per_token, inputs.mask).sum() / _denominator(tokens_per_rank)


# ---------------------------------------------------------------------------- registry

RatioFn = Callable[[Tensor, Tensor, LossInputs], Tensor]
ObjectiveFn = Callable[[Tensor, Tensor, Tensor, LossConfig], Tensor]
ReduceFn = Callable[[Tensor, LossInputs, LossNormalisers], Tensor]


@dataclass(frozen=True)
class LossVariant:
    ratio: RatioFn
    objective: ObjectiveFn
    reduce: ReduceFn


VARIANTS: dict[str, LossVariant] = {
    "grpo": LossVariant(token_ratio, clipped_objective, reduce_sequence_mean),
    "bnpo": LossVariant(token_ratio, clipped_objective, reduce_tokens),
    "dr_grpo": LossVariant(token_ratio, clipped_objective, reduce_max_length),
    "dapo": LossVariant(token_ratio, clipped_objective, reduce_global_tokens),
    "gspo": LossVariant(sequence_ratio, clipped_objective, reduce_sequence_mean),
    "cispo": LossVariant(token_ratio, cispo_objective, reduce_global_tokens),
}


# ---------------------------------------------------------------------------- the loss


def _check_inputs(inputs: LossInputs, cfg: LossConfig) -> None:
    shape = inputs.logprobs.shape
    if inputs.logprobs.dim() != 1:
        raise ValueError(f"LossInputs.logprobs must be (T,) on the packed layout, got {shape}")
    named = {"old_logprobs": inputs.old_logprobs, "advantages": inputs.advantages,
             "mask": inputs.mask, "token_seq": inputs.token_seq,
             "ref_logprobs": inputs.ref_logprobs, "is_weights": inputs.is_weights,
             "entropy": inputs.entropy, "teacher_logprobs": inputs.teacher_logprobs,
             "divergence": inputs.divergence}  # fmt: skip
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"LossInputs.{name} has shape {tuple(tensor.shape)}, need {shape}")
    if cfg.beta > 0 and inputs.ref_logprobs is None:
        raise ValueError("loss.beta > 0 needs LossInputs.ref_logprobs (reference log-probs)")


def kl_k3(logp: Tensor, ref: Tensor) -> Tensor:
    """(T,) k3 estimate of KL(pi || ref) from tokens sampled from pi."""
    d = ref - logp
    return torch.exp(d) - d - 1.0


def excluded_targets(
    logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor | None = None
) -> Tensor:
    """(T,) bool: targets some trainer distribution filtered out (a -inf log-prob)."""
    out = torch.isneginf(logprobs.detach()) | torch.isneginf(old_logprobs.detach())
    if ref_logprobs is not None:
        out |= torch.isneginf(ref_logprobs.detach())
    return out


def compute_loss(inputs: LossInputs, norm: LossNormalisers, cfg: LossConfig) -> LossOutputs:
    """One micro-batch's share of the step loss (see the module docstring) and metrics."""
    _check_inputs(inputs, cfg)
    variant = VARIANTS[cfg.type]
    unmasked = inputs.mask > 0
    filtered = unmasked & excluded_targets(
        inputs.logprobs, inputs.old_logprobs, inputs.ref_logprobs
    )
    keep = unmasked & ~filtered
    # every per-token input is selected before any arithmetic: a dropped token's -inf never
    # meets exp or a product, so neither the loss nor its gradient (exactly 0) sees it
    kept = replace(inputs, mask=keep.float())
    logp = _select(_upcast(inputs.logprobs), keep)
    old = _select(_upcast(inputs.old_logprobs).to(logp.dtype), keep)
    adv = inputs.advantages.to(logp.dtype)

    ratio = variant.ratio(logp, old, kept)
    per_token = variant.objective(ratio, adv, logp, cfg)
    if inputs.is_weights is not None:
        per_token = per_token * _select(inputs.is_weights.detach().to(logp.dtype), keep)
    kl = None
    if inputs.ref_logprobs is not None:
        kl = kl_k3(logp, _select(_upcast(inputs.ref_logprobs).to(logp.dtype), keep))
        if cfg.beta > 0:
            per_token = per_token + cfg.beta * kl
    loss = variant.reduce(per_token, kept, norm)
    if inputs.divergence is not None:  # distillation (jsd): a token mean over the step
        loss = loss + inputs.divergence_weight * reduce_tokens(inputs.divergence, kept, norm)
    metrics = _metrics(kept, logp, ratio, adv, kl, cfg)
    metrics["filtered_tokens"] = filtered.sum().to(metrics["tokens"].dtype)
    return LossOutputs(loss=loss, metrics=metrics)


@torch.no_grad()
def _metrics(
    inputs: LossInputs, logp: Tensor, ratio: Tensor, adv: Tensor, kl: Tensor | None, cfg: LossConfig
) -> dict[str, Tensor]:
    mask = inputs.mask
    low, high, region = _clip_flags(ratio, adv, cfg)
    out = {
        "tokens": (mask > 0).to(ratio.dtype).sum(),
        "sequences": torch.tensor(float(inputs.num_sequences), device=ratio.device),
        "clip/low_frac": _select(low.to(ratio.dtype), mask).sum(),
        "clip/high_frac": _select(high.to(ratio.dtype), mask).sum(),
        "clip/region_frac": _select(region.to(ratio.dtype), mask).sum(),
        "ratio/mean": _select(ratio, mask).sum(),
    }
    optional = {"kl": kl, "entropy": inputs.entropy, "is/weight_applied": inputs.is_weights,
                "distill/jsd": inputs.divergence}  # fmt: skip
    if inputs.teacher_logprobs is not None:
        teacher = _select(_upcast(inputs.teacher_logprobs).to(logp.dtype), mask)
        optional["distill/reverse_kl"] = logp.detach() - teacher
    for name, values in optional.items():
        if values is not None:
            out[name] = _select(values.to(ratio.dtype), mask).sum()
    return out


def sums_to_means(accumulated: dict[str, float]) -> dict[str, float]:
    """Sums accumulated over micro-batches (and ranks) -> means; others pass unchanged."""
    out = dict(accumulated)
    for name, count in METRIC_COUNTS.items():
        if name in accumulated and count is not None:
            total = accumulated.get(count, 0.0)
            out[name] = accumulated[name] / total if total > 0 else 0.0
    return out


# ---------------------------------------------------------------------------- IS weights


def importance_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    token_seq: Tensor,
    num_sequences: int,
    mask: Tensor,
    mode: str,
    cap: float,
    min_weight: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached (T,) weights pi_old / pi_behaviour for decoupled PPO (truncated IS).

    token_truncate: min(exp(lr_t), cap); token_mask: exp(lr_t) inside [min_weight, cap],
    else exactly 0; sequence_*: the same on the sequence's geometric-mean ratio
    exp(mean_t lr_t) over its masked tokens, broadcast to its tokens. lr = old - behaviour.
    A token whose old or behaviour log-prob is -inf (a filtered target, dropped from the
    loss) counts as masked. Metrics are means over the masked tokens of this call (min/max
    over them), with `is/tokens` their count, so callers can weight them across calls.
    """
    _check_choice("importance sampling mode", mode, IS_MODES)
    if not 0.0 <= min_weight < cap:
        raise ValueError(f"need 0 <= min_weight < cap, got min_weight={min_weight}, cap={cap}")
    if old_logprobs.shape != behaviour_logprobs.shape or old_logprobs.shape != mask.shape:
        raise ValueError(
            f"old_logprobs {tuple(old_logprobs.shape)}, behaviour_logprobs "
            f"{tuple(behaviour_logprobs.shape)} and mask {tuple(mask.shape)} must all be (T,)"
        )
    with torch.no_grad():
        inside = (mask > 0) & ~excluded_targets(old_logprobs, behaviour_logprobs)
        log_ratio = _select(
            _upcast(old_logprobs).float() - _upcast(behaviour_logprobs).float(), inside
        )  # (T,)
        if mode.startswith("sequence"):
            log_seq = _sequence_mean(log_ratio, inside, token_seq, num_sequences)  # (S,)
            raw = torch.exp(log_seq)[token_seq]
        else:
            raw = torch.exp(log_ratio)
        if mode.endswith("truncate"):
            weights = raw.clamp(max=cap)
            changed = raw > cap
        else:
            keep = (raw >= min_weight) & (raw <= cap)
            weights = torch.where(keep, raw, torch.zeros_like(raw))
            changed = ~keep
        metrics = _is_metrics(weights, changed, mode, log_ratio, inside)
    return weights, metrics


def _is_metrics(
    weights: Tensor, changed: Tensor, mode: str, log_ratio: Tensor, inside: Tensor
) -> dict[str, Tensor]:
    tokens = inside.float().sum()
    count = tokens.clamp(min=1.0)
    any_inside = inside.any()
    changed_frac = _select(changed.float(), inside).sum() / count
    zero = torch.zeros_like(changed_frac)
    masked = mode.endswith("mask")
    inf = weights.new_tensor(float("inf"))
    # a trailing +-inf keeps amin/amax defined when T == 0; any_inside picks 0 then
    weight_min = torch.cat([torch.where(inside, weights, inf), inf[None]]).amin()
    weight_max = torch.cat([torch.where(inside, weights, -inf), -inf[None]]).amax()
    return {
        "is/tokens": tokens,
        "is/weight_mean": _select(weights, inside).sum() / count,
        "is/weight_min": torch.where(any_inside, weight_min, zero),
        "is/weight_max": torch.where(any_inside, weight_max, zero),
        "is/masked_frac": changed_frac if masked else zero,
        "is/truncated_frac": zero if masked else changed_frac,
        # k3 of pi_old against the behaviour policy, from tokens the behaviour sampled
        "is/mismatch_kl": _select(torch.exp(log_ratio) - log_ratio - 1.0, inside).sum() / count,
    }
