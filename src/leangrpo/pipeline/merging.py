"""The metrics of streamed chunks merged into one batch's (`pipeline.min_groups_per_step`):
one declared rule per metric.

A chunk's metrics come from the reward pool (`reward/*`, rewards/pool.py), its
trajectories (`multiturn/*`, environments/metrics.py), its multi-turn generation call's
loop and engine (`multiturn/*` seconds and counts, `rollout/server*`: driver.py's
`last_metrics`), the worker's timings (`time/*`) and its re-rolls (`reroll/*`, batch.py). Each is a count or a sum (added), a maximum (the
largest), or a mean over some of the chunk's samples, weighted by how many of them it
averages over, counted on the chunk's own samples (the scored ones for `reward/mean`,
those a function scored for its mean, the trajectories, those that reached turn k, those
whose environment reported the metric); `reward/std` is pooled from the chunks' means and
stds over the same samples. The merged figures are then those of the whole batch at once
(tests/pipeline/test_merging.py merges random chunks). A metric no rule names is an
error: a new metric gets its rule here. Figures computed on the merged batch (advantages,
replay, flat groups left out: batch.py's BatchFinisher) come after the merge.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from leangrpo.contracts import RolloutSample
from leangrpo.environments.metrics import COUNTED, FINISH_REASONS, PER_TOOL
from leangrpo.sandbox.calls import LIMIT_KINDS

Over = Callable[[list[RolloutSample], re.Match], int]


@dataclass(frozen=True)
class Rule:
    kind: str  # "sum" | "max" | "mean" | "std" (a std pooled with the mean of its name)
    over: Over | None = None  # mean, std: how many of a chunk's samples it averages over


def _scored(samples: list[RolloutSample], _: re.Match) -> int:
    return sum(s.reward is not None for s in samples)


def _scored_by(samples: list[RolloutSample], match: re.Match) -> int:
    return sum(s.rewards.get(match[1]) is not None for s in samples)


def _trajectories(samples: list[RolloutSample], _: re.Match) -> int:
    return sum(s.completion.trajectory is not None for s in samples)


def _reached_turn(samples: list[RolloutSample], match: re.Match) -> int:
    k = int(match[1])
    trajectories = [s.completion.trajectory for s in samples if s.completion.trajectory]
    return sum(sum(is_model for _, is_model in t.segments) > k for t in trajectories)


def _reported(samples: list[RolloutSample], match: re.Match) -> int:
    trajectories = [s.completion.trajectory for s in samples if s.completion.trajectory]
    return sum(match[1] in t.metrics for t in trajectories)


def _names(names) -> str:
    return "|".join(re.escape(n.rstrip("/")) for n in names)


SUM, MAX = Rule("sum"), Rule("max")
CALL_COUNTS = ("generation_s", "env_wait_s", "prefill_tokens", "prefill_tokens_saved",
               "prefills", "prefills_beside_decoding", "decode_steps", "decode_rows",
               "cache_evictions", "cache_misses")  # fmt: skip
LIMITED = [kind.split()[0] for kind in LIMIT_KINDS]  # as the pool names them
RULES: list[tuple[str, Rule]] = [  # (full-match pattern, rule): the first that matches
    (r"time/.+", SUM),
    (r"reroll/(requeued|dropped)", SUM),
    (r"reward/(failures|unscored)", SUM),
    (rf"reward/({_names(LIMITED)})_failures", SUM),  # the sandbox's limit kinds (rewards/pool.py)
    (r"reward/mean", Rule("mean", _scored)),
    (r"reward/std", Rule("std", _scored)),
    (r"reward/.+/failures", SUM),
    (r"reward/.+/timeouts", SUM),  # a function's samples failed by its timeout (rewards/pool.py)
    (r"reward/(.+)/mean", Rule("mean", _scored_by)),  # env/<term> included
    (r"multiturn/turns_max", MAX),
    (r"multiturn/(env_errors|env_s|control_tokens_stripped)", SUM),
    (r"multiturn/turn_(\d+)_length", Rule("mean", _reached_turn)),
    (r"multiturn/env/(.+)", Rule("mean", _reported)),
    (rf"multiturn/(turns|{_names(COUNTED)})", Rule("mean", _trajectories)),
    (rf"multiturn/({_names(PER_TOOL)})/.+", Rule("mean", _trajectories)),  # absent: 0
    (rf"multiturn/finish/({_names(FINISH_REASONS)})", Rule("mean", _trajectories)),
    # the generation call's loop and turn stream (driver.py's last_metrics), one per chunk
    (r"multiturn/in_flight_max", MAX),
    (r"multiturn/in_flight_mean", Rule("mean", _trajectories)),
    (rf"multiturn/({_names(CALL_COUNTS)})", SUM),
    (r"rollout/server/\d+/requests|rollout/server_retries", SUM),
    (r"rollout/servers_down", MAX),
]


def rule_for(key: str) -> tuple[Rule, re.Match]:
    for pattern, rule in RULES:
        match = re.fullmatch(pattern, key)
        if match is not None:
            return rule, match
    raise KeyError(f"chunk metric {key!r} has no merge rule (pipeline/merging.py RULES)")


def merge_metrics(chunks: list[tuple[list[RolloutSample], dict[str, float]]]) -> dict[str, float]:
    """The metrics of the chunks' samples taken as one batch, from each chunk's (samples,
    metrics). A metric a chunk lacks counts as 0 there (a count, a sum, a per-tool mean)
    or has no samples to weigh (a mean over what that chunk did not have)."""
    keys = list(dict.fromkeys(k for _, metrics in chunks for k in metrics))
    merged: dict[str, float] = {}
    for key in keys:
        rule, match = rule_for(key)
        if rule.kind == "sum":
            merged[key] = float(sum(m.get(key, 0.0) for _, m in chunks))
        elif rule.kind == "max":
            merged[key] = float(max(m[key] for _, m in chunks if key in m))
        else:
            weights = [rule.over(samples, match) for samples, _ in chunks]
            if rule.kind == "mean":
                merged[key] = _weighted_mean([m.get(key, 0.0) for _, m in chunks], weights)
            else:
                mean_key = key.removesuffix("std") + "mean"
                merged[key] = _pooled_std(chunks, key, mean_key, weights)
    return merged


def _weighted_mean(values: list[float], weights: list[int]) -> float:
    """Computed on values scaled by the largest magnitude: rewards may be any finite float."""
    parts = [(w, v) for w, v in zip(weights, values) if w]
    total = sum(w for w, _ in parts)
    scale = max((abs(v) for _, v in parts), default=0.0)
    if total == 0 or scale == 0:
        return 0.0
    return scale * (math.fsum(w * (v / scale) for w, v in parts) / total)


def _pooled_std(chunks, key: str, mean_key: str, weights: list[int]) -> float:
    """The std (ddof 0) of the union from each part's (count, mean, std), on values scaled
    by the largest magnitude, so that huge rewards do not overflow the squares."""
    parts = [(w, m.get(mean_key, 0.0), m.get(key, 0.0)) for w, (_, m) in zip(weights, chunks) if w]
    total = sum(w for w, _, _ in parts)
    scale = max((max(abs(mu), sd) for _, mu, sd in parts), default=0.0)
    if total == 0 or scale == 0:
        return 0.0
    mean = math.fsum(w * (mu / scale) for w, mu, _ in parts) / total
    spread = math.fsum(w * ((sd / scale) ** 2 + (mu / scale - mean) ** 2) for w, mu, sd in parts)
    return scale * math.sqrt(spread / total)
