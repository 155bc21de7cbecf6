"""What routing replay changes, measured on a batch (`logging.routing_diagnostics`).

Each micro-batch of the batch is scored twice more, without gradient and in eval mode
like the old-policy pass: once replaying the engine's routes and once routing as the
forward decides (`RoutingControl.unforced`). Against the engine's behaviour log-probs
each gives the statistics of the importance-sampling ratio pi_trainer / pi_engine over
the batch's completion tokens (tokens a filter dropped, -inf on either side, left out):

    moe/{replayed,unreplayed}/ratio_mean, ratio_max, log_ratio_std, mismatch_kl (k3)

and the unreplayed pass counts the tokens whose routing differed from the record
(`moe/unreplayed/routing_flips`). Torchrun's padding micro-batches run the same forwards
(every rank makes the same ones) and count nothing; figures are summed over the
data-parallel shares. Logged with the batch's first step.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from leangrpo.contracts import PackedBatch, SamplingParams, StepRanks
from leangrpo.model.policy import Policy
from leangrpo.model.scoring import eval_mode, score

PASSES = ("replayed", "unreplayed")


@torch.no_grad()
def routing_diagnostics(
    policy: Policy, steps: list, cfg, sampling: SamplingParams, ranks: StepRanks
) -> dict[str, float]:
    """The batch's `moe/*` replay diagnostics ({} unless logging.routing_diagnostics)."""
    if not cfg.logging.routing_diagnostics:
        return {}
    sums: dict[str, float] = defaultdict(float)
    maxima: dict[str, float] = defaultdict(float)
    with eval_mode(policy.model):
        for mb in (mb for step in steps for mb in step.micro_batches):
            for name in PASSES:
                replay = (
                    contextlib.nullcontext() if name == "replayed" else policy.routing.unforced()
                )
                with replay:
                    logprobs = score(policy.scoring_module, mb, sampling, cfg.logprobs)[0]
                if not mb.padding:
                    _add(sums, maxima, name, mb, logprobs.float(), policy.routing.last)
    ranks.release_gathered(policy)
    return _figures(ranks.all_gather_object((dict(sums), dict(maxima))))


def _add(sums, maxima, name: str, mb: PackedBatch, logprobs, last: dict) -> None:
    behaviour = mb.behaviour_logprobs.float()
    kept = torch.isfinite(logprobs) & torch.isfinite(behaviour)
    log_ratio = torch.where(kept, logprobs - behaviour, 0.0)
    ratio = torch.where(kept, log_ratio.exp(), 0.0)
    values = torch.stack(
        [
            kept.sum(),
            ratio.sum(),
            log_ratio.sum(),
            log_ratio.square().sum(),
            torch.where(kept, ratio - log_ratio - 1.0, 0.0).sum(),
            ratio.max() if ratio.numel() else ratio.new_zeros(()),
        ]
    ).tolist()  # one copy per pass
    for key, value in zip(("tokens", "ratio", "log_ratio", "log_ratio_sq", "k3"), values):
        sums[f"{name}/{key}"] += value
    maxima[name] = max(maxima[name], values[5])
    if name == "unreplayed" and "flipped" in last:
        sums["flipped"] += float(last["flipped"])
        sums["route_tokens"] += float(last["route_tokens"])


def _figures(shares: list[tuple[dict, dict]]) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    maxima: dict[str, float] = defaultdict(float)
    for share_sums, share_max in shares:
        for key, value in share_sums.items():
            sums[key] += value
        for key, value in share_max.items():
            maxima[key] = max(maxima[key], value)
    out = {}
    for name in PASSES:
        n = sums[f"{name}/tokens"]
        if not n:
            continue
        mean = sums[f"{name}/log_ratio"] / n
        variance = max(sums[f"{name}/log_ratio_sq"] / n - mean * mean, 0.0)
        out[f"moe/{name}/ratio_mean"] = sums[f"{name}/ratio"] / n
        out[f"moe/{name}/ratio_max"] = maxima[name]
        out[f"moe/{name}/log_ratio_std"] = variance**0.5
        out[f"moe/{name}/mismatch_kl"] = sums[f"{name}/k3"] / n
    if sums["route_tokens"]:
        out["moe/unreplayed/routing_flips"] = sums["flipped"] / sums["route_tokens"]
    return out
