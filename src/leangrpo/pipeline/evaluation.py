"""Evaluation on held-out prompts: generate, score with the same reward functions, average.

Greedy by default (`eval.temperature = 0`), so the curve moves only when the policy does.
With an environment, each prompt is a multi-turn trajectory (`turns`), and the
trajectories' figures are logged as `eval/multiturn/*` (environments/metrics.py).
Rewards that fail are counted and left out of the mean, as in training; means are
overflow-safe like training's (rewards of +-1e308 average to a finite number, not nan).
Under torchrun with per-rank engines (`share`), each rank evaluates its slice of the
prompts and the scored samples are all-gathered, so the figures are the whole set's;
`eval/version` is the oldest version a rank evaluated. See docs/distributed.md.
"""

from __future__ import annotations

import threading

from leangrpo.contracts import Prompt, RolloutSample, SamplingParams, sample_prompt
from leangrpo.environments.metrics import trajectory_metrics
from leangrpo.pipeline.advantages import mean_std


class Evaluator:
    def __init__(
        self,
        engine,
        rewards,
        prompts: list[Prompt],
        cfg,
        *,
        engine_lock: threading.Lock,
        reward_lock: threading.Lock,
        shared_weights: bool,
        share=None,  # torchrun: a distributed.rollout.RankShare on the main thread's group
        turns=None,  # multi-turn: an environments.driver.MultiTurnRollout over `engine`
    ):
        self.share = share
        self.engine = engine
        self.turns = turns
        self.rewards = rewards
        limit = cfg.eval.num_prompts
        self.prompts = prompts[:limit] if limit else prompts
        self.n = cfg.eval.num_generations
        self.params = SamplingParams(
            temperature=cfg.eval.temperature,
            top_k=cfg.rollout.top_k,
            min_p=cfg.rollout.min_p,
            max_new_tokens=cfg.rollout.max_new_tokens,
            stop=tuple(cfg.rollout.stop),
            seed=cfg.run.seed + 7919,
        )
        self.engine_lock = engine_lock
        self.reward_lock = reward_lock
        self.shared_weights = shared_weights

    def run(self, version: int, step: int) -> dict[str, float]:
        if not self.prompts:
            return {}
        start, stop = self.share.bounds(len(self.prompts)) if self.share else (0, len(self.prompts))
        prompts = self.prompts[start:stop]
        with self.engine_lock:
            if self.shared_weights:  # same weights object as the trainer: only the tag moves
                self.engine.update_weights((), version)
            evaluated_version = self.engine.version
            groups = (self.turns or self.engine).generate(
                prompts, self.params, self.n, evaluated_version, prompt_offset=start
            )
        samples = [
            RolloutSample(start + i, sample_prompt(p, c), c)
            for i, (p, cs) in enumerate(zip(prompts, groups))
            for c in cs
        ]
        with self.reward_lock:
            self.rewards.score(samples)
        if self.share:
            parts = self.share.exchange((samples, evaluated_version))
            samples = [s for part, _ in parts for s in part]
            evaluated_version = min(v for _, v in parts)
        return eval_metrics(samples, evaluated_version)


def eval_metrics(samples: list[RolloutSample], version: int) -> dict[str, float]:
    scored = [s.reward for s in samples if s.reward is not None]
    metrics = {
        "eval/reward": _mean(scored),
        "eval/failures": float(len(samples) - len(scored)),
        "eval/completion_length": _mean([float(len(s.completion.ids)) for s in samples]),
        "eval/version": float(version),
        **trajectory_metrics(samples, prefix="eval/multiturn"),
    }
    names = {name for s in samples for name in s.rewards}
    for name in sorted(names):
        values = [s.rewards[name] for s in samples if s.rewards.get(name) is not None]
        metrics[f"eval/reward/{name}"] = _mean(values)
    return metrics


def _mean(values: list[float]) -> float:
    return mean_std(values)[0] if values else float("nan")
