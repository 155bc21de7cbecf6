"""The pipeline a run gets: its producer (a `contracts.Producer`) and its evaluator.

`build_pipeline` wires the pipeline package's parts over the run's engines and reward pool:
- One process: a SyncProducer, or an AsyncProducer thread, over the rollout engine; an
  Evaluator over the eval engine.
- Torchrun with the hf engine: the same on every rank, each making its share of every
  batch (`RankShare`; the producer's exchanges on a process group of their own, the
  evaluator's on the main thread's), so every rank holds every batch.
- Torchrun with vLLM servers: rank 0's producer behind a broadcast (`MainRankProducer`);
  rank 0 alone evaluates.
With an environment or an agent (a `contracts.MultiTurn`, chosen once at the trainer's
set-up), the producer's worker and the evaluator generate through its rollout over their
engines (environments/driver.py `MultiTurnRollout`, sharing one pool of environment
workers; agents/episodes.py `AgentRollout`, sharing the endpoint and the agent workers). See
docs/distributed.md ("Generation").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from leangrpo.contracts import MultiTurn, Producer
from leangrpo.data.sampler import PromptSampler
from leangrpo.distributed.rollout import MainRankProducer, RankShare
from leangrpo.pipeline.batch import BatchFinisher, RolloutSettings, RolloutWorker
from leangrpo.pipeline.evaluation import Evaluator
from leangrpo.pipeline.producers import AsyncProducer, SyncProducer
from leangrpo.pipeline.replay import ReplayBuffer


@dataclass
class Pipeline:
    producer: Producer  # SyncProducer | AsyncProducer | distributed.rollout.MainRankProducer
    evaluator: Evaluator | None  # None: this torchrun rank does not evaluate
    share: RankShare | None = None  # the producer's share of each batch (torchrun, hf engine)


def build_pipeline(
    cfg, ctx, engines, rewards, train_prompts, eval_prompts, multi_turn: MultiTurn | None = None
) -> Pipeline:
    """`cfg`: the run's Config; `engines` is None on torchrun ranks > 0 when rank 0
    drives vLLM servers; `multi_turn`: an environment's or an agent's set-up."""
    reward_lock = threading.Lock()  # the producer thread and evaluation share the pool
    envs = multi_turn
    if not ctx.distributed:
        producer = _producer(cfg, engines, rewards, train_prompts, reward_lock, envs=envs)
        evaluator = _evaluator(cfg, engines, rewards, eval_prompts, producer, reward_lock, envs)
        return Pipeline(producer, evaluator)
    if cfg.rollout.engine == "hf":  # every rank its share
        share = RankShare(ctx, ctx.new_group())  # for the producer thread's exchanges
        producer = _producer(cfg, engines, rewards, train_prompts, reward_lock, share, envs)
        evaluator = _evaluator(
            cfg, engines, rewards, eval_prompts, producer, reward_lock, envs, RankShare(ctx)
        )
        return Pipeline(producer, evaluator, share)
    if engines is None:
        return Pipeline(MainRankProducer(None, ctx), None)
    inner = _producer(cfg, engines, rewards, train_prompts, reward_lock, envs=envs)
    evaluator = _evaluator(cfg, engines, rewards, eval_prompts, inner, reward_lock, envs)
    return Pipeline(MainRankProducer(inner, ctx), evaluator)


def _evaluator(
    cfg, engines, rewards, prompts, producer, reward_lock, envs=None, share=None
) -> Evaluator:
    same = engines.eval is engines.rollout
    return Evaluator(
        engines.eval,
        rewards,
        prompts,
        cfg,
        engine_lock=producer.engine_lock if same else threading.Lock(),
        reward_lock=reward_lock,
        shared_weights=engines.eval_shares_weights,
        share=share,
        turns=envs.rollout(engines.eval) if envs is not None else None,
    )


def _producer(cfg, engines, rewards, prompts, reward_lock, share=None, envs=None):
    pipe = cfg.pipeline
    streaming = pipe.mode == "async" and pipe.min_groups_per_step is not None
    chunk = pipe.min_groups_per_step if streaming else cfg.rollout.prompts_per_batch
    sampler = PromptSampler(prompts, chunk, cfg.run.seed, cfg.data.shuffle)
    settings = RolloutSettings(
        group_size=cfg.rollout.num_generations,
        prompts_per_batch=cfg.rollout.prompts_per_batch,
        sampling=cfg.rollout.sampling_params(),  # per-batch seeds are set by the producer
        scale_rewards=cfg.loss.scale_rewards,
        seed=cfg.run.seed,
        updates_per_batch=cfg.loss.mu * cfg.train.steps_per_generation,
        updates_per_chunk=cfg.loss.mu * min(cfg.train.steps_per_generation, chunk),
    )
    worker = RolloutWorker(
        engines.rollout,
        rewards,
        sampler,
        settings,
        reward_lock,
        reroll_attempts=pipe.reroll.max_attempts if pipe.reroll.enabled else 0,
        share=share,
        turns=envs.rollout(engines.rollout) if envs is not None else None,
    )
    finisher = BatchFinisher(
        settings,
        max_staleness=pipe.max_staleness,  # also bounds replayed groups in sync mode
        replay=ReplayBuffer(pipe.replay.capacity) if pipe.replay.enabled else None,
        leave_out_flat=pipe.reroll.enabled,
    )
    if pipe.mode == "async":
        return AsyncProducer(
            worker,
            finisher,
            pipe.prefetch_depth,
            pipe.max_staleness,
            streaming=streaming,
            snapshot_device=engines.snapshot_device,
            stall_timeout_s=pipe.stall_timeout_s,
            # torchrun: its thread may wait in an exchange for up to distributed.timeout_s
            close_timeout_s=max(30.0, cfg.distributed.timeout_s) if share else 30.0,
        )
    return SyncProducer(worker, finisher)
