"""The GRPO loop: produce -> score -> optimise -> sync -> log -> checkpoint.

Everything expensive is set up in `Trainer.__init__` after every cheap check has passed
(preflight.py: config, data, reward functions, model files, the locked run directory), so
bad input fails in a second with one sentence. `Trainer.train()` then reads as the
algorithm: take a scored rollout batch from the producer (sync or async), pack it, fill
in old/reference log-probs, run `mu` iterations of optimizer steps over it, hand new
weights to the generator, and log, evaluate and checkpoint on schedule.

The policy version counts successful optimizer updates; every sample carries the version
that generated it, so staleness is measured, never assumed (`staleness/*` at each update).

Guards: a batch with no scored sample (with re-rolls: no scored group with signal) is
skipped (counted, consumed); a run stops with one sentence after
`train.max_consecutive_skipped_steps` non-finite steps or
`pipeline.max_consecutive_skipped_batches` such batches in a row. A checkpoint taken
inside a batch holds that batch (`BatchInProgress`), so resume is exact at any step.

Stop signals (stopping.py): during `train()` a first SIGTERM or Ctrl-C is checked at each
optimizer-step boundary (a wait for a batch in one process is cut short: the batch is
abandoned); the run then saves a checkpoint at that step, closes, and raises `RunStopped`.

Torchrun (`ctx.distributed`, docs/ARCHITECTURE.md "Distributed"): every rank runs this
loop on the same global batch; the policy is FSDP-sharded before the engines are built
(a per-rank hf engine's copy is made from the shards), each step's groups are dealt to ranks (step.py), weights are gathered before any sync,
checkpoints are DCP-sharded, rank 0 logs, and each phase runs inside `ctx.phase(...)` so
a rank that fails stops the others within `distributed.timeout_s`, naming it and the
phase. World size 1 takes none of these paths.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from pathlib import Path

import numpy as np
import torch

from leangrpo.checkpoint import local as ckpt
from leangrpo.checkpoint.rundir import schedule_horizon
from leangrpo.config import Config
from leangrpo.contracts import RolloutBatch
from leangrpo.data.prompts import load_prompts
from leangrpo.distributed.context import DistContext, init_distributed
from leangrpo.errors import RunError
from leangrpo.metrics.logger import MetricsLogger
from leangrpo.model.files import check_model_files
from leangrpo.model.policy import Policy, load_policy, load_tokenizer, resolve_device
from leangrpo.pipeline.builder import make_production
from leangrpo.preflight import Preflight, check_micro_batch, preflight, prompt_limit
from leangrpo.rewards import RewardPool
from leangrpo.rollout.factory import make_engines
from leangrpo.stopping import RunStopped, StopRequested, StopSignals
from leangrpo.train.loss import LossConfig
from leangrpo.train.schedule import make_scheduler
from leangrpo.train.step import (
    BatchInProgress,
    PlannedStep,
    attach_old_and_ref,
    plan_steps,
    train_step,
)

log = logging.getLogger("leangrpo")


def validate_inputs(cfg: Config) -> LossConfig:
    """The loss settings; the cheap input checks are preflight's, run before this."""
    return LossConfig.from_config(cfg.loss)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(
        self, cfg: Config, checked: Preflight | None = None, ctx: DistContext | None = None
    ):
        """`checked`: the CLI's preflight result (its run-directory lock passes to us);
        `ctx`: the torchrun context (default: from the environment; the caller ends it)."""
        self.ctx = ctx if ctx is not None else init_distributed(cfg.distributed, cfg.run.device)
        self.checked = checked if checked is not None else preflight(cfg, self.ctx)
        try:
            self.loss_cfg = validate_inputs(cfg)
            self.cfg = cfg
            self.out = self.checked.run_dir.path
            if self.ctx.is_main:
                cfg.save(self.out / "config.yaml")
            if cfg.run.num_threads:
                torch.set_num_threads(cfg.run.num_threads)
            seed_everything(cfg.run.seed)
            self.step = 0  # optimizer steps taken (including skipped ones)
            self.version = 0  # successful updates: the policy version
            self.skipped = 0
            self.skips = RunSkips()
            self.inflight: BatchInProgress | None = None  # the batch being trained on
            self.resume_rows: int | None = None  # metrics rows of the resumed step to keep
            self.saved: tuple[int, Path] | None = None  # this run's last checkpoint: step, path
            self.signals = StopSignals()  # the one train() installs
            self.stop_signal = 0  # the signal the ranks agreed to stop on (0: none)
            self._build(cfg)
        except BaseException:
            self.checked.release()
            raise

    # -- set-up --------------------------------------------------------------------------
    def _build(self, cfg: Config) -> None:
        ctx = self.ctx
        device = ctx.device if ctx.distributed else resolve_device(cfg.run.device)
        limit = self.checked.prompt_limit
        if self.checked.model.directory is None:  # a hub model not cached yet: fetch config.json
            limit = prompt_limit(cfg, check_model_files(cfg.model, fetch=True))
        tokenizer = load_tokenizer(cfg.model)
        prompts = load_prompts(cfg.data, tokenizer, cfg.run.seed, limit)
        check_micro_batch(prompts.train, cfg)
        train_prompts, eval_prompts = prompts.train, prompts.eval
        # torchrun: one full copy per rank at most (the reference starts on the meta device)
        self.policy: Policy = load_policy(cfg, tokenizer, device, reference_on_meta=ctx.distributed)
        own_copy = None  # torchrun, hf engine: the rank's unsharded copy, made from the shards
        if ctx.distributed:
            from leangrpo.distributed.strategy import shard_for_training

            own_copy = shard_for_training(self.policy, cfg, ctx)
        self.engines = engines = make_engines(cfg, self.policy, ctx, own_copy)
        self.per_rank = ctx.distributed and cfg.rollout.engine == "hf"  # else rank 0 generates
        self.optimizer = torch.optim.AdamW(
            self.policy.trainable_parameters(),
            lr=cfg.train.learning_rate,
            betas=(cfg.train.adam_beta1, cfg.train.adam_beta2),
            eps=cfg.train.adam_eps,
            weight_decay=cfg.train.weight_decay,
        )
        self.schedule_steps = self._schedule_horizon()
        self.scheduler = make_scheduler(self.optimizer, cfg.train, self.schedule_steps)
        self.sampling = cfg.rollout.sampling_params()  # per-batch seeds are set by the producer
        self.rewards = RewardPool(cfg.rewards) if engines is not None else None
        self.sync_every_version = cfg.generates_with_live_weights()  # hf sync: every version
        made = make_production(cfg, ctx, engines, self.rewards, train_prompts, eval_prompts)
        self.producer, self.evaluator, self.share = made.producer, made.evaluator, made.share
        with ctx.phase("checkpoint"):
            self.resumed = resumed = self._maybe_resume()
        server = cfg.rollout.engine == "vllm" and cfg.rollout.vllm.mode == "server"
        if server and not resumed:  # a server may hold another run's weights
            with ctx.phase("sync"):
                named = self._sync_tensors()
                if engines is not None:
                    engines.rollout.update_weights(named, self.version)
        if not ctx.is_main:
            from leangrpo.distributed.strategy import NullLogger

            self.logger = NullLogger()
            return
        self.logger = MetricsLogger(
            self.out,
            cfg.logging.backends,
            cfg.logging.progress_bar,
            cfg.run.max_steps,
            run_name=cfg.logging.run_name,
            config_dict=cfg.model_dump(mode="json"),
            project=cfg.logging.wandb_project,
            resume_step=self.step if resumed else None,
            resume_rows=self.resume_rows if resumed else None,
        )
        if not resumed:
            self.logger.stage(prompts.metrics)  # merged into the step-0 row

    def _schedule_horizon(self) -> int:
        """The steps the LR schedule spans: run.max_steps as the run was started, kept when
        a resume changes it (run.max_steps only says where to stop)."""
        cfg, path = self.cfg, self.checked.run_dir.resume_from
        horizon = cfg.run.max_steps if path is None else schedule_horizon(path, cfg.run.max_steps)
        if horizon != cfg.run.max_steps and cfg.train.lr_scheduler != "constant":
            log.warning(
                "the %s learning-rate schedule keeps the horizon this run started with, %d steps, "
                "although run.max_steps is now %d%s",
                cfg.train.lr_scheduler,
                horizon,
                cfg.run.max_steps,
                f": the learning rate is 0 from step {horizon} on; to train on with a new "
                "schedule, start a new run from this run's final model"
                if cfg.run.max_steps > horizon
                else "",
            )
        return horizon

    def _maybe_resume(self) -> bool:
        path = self.checked.run_dir.resume_from
        if path is None:
            return False
        ctx = self.ctx
        if ctx.distributed:
            from leangrpo.checkpoint.sharded import load_sharded_checkpoint

            model, opt, sched = self.policy.model, self.optimizer, self.scheduler
            state = load_sharded_checkpoint(path, model, opt, sched, ctx)
        else:
            state = ckpt.load_checkpoint(path, self.policy.model, self.optimizer, self.scheduler)
        bulky = ckpt.load_bulky_state(path)
        self.step, self.version, self.skipped = state["step"], state["version"], state["skipped"]
        self.resume_rows = state.get("metrics_rows_at_step")  # None: an older checkpoint
        self.skips = RunSkips(**state.get("skips", {}))
        self.producer.load_state_dict(bulky.get("producer", state.get("producer")))
        if "inflight" in bulky:
            inflight = bulky["inflight"]
            if ctx.distributed:
                from leangrpo.distributed.strategy import inflight_to_load

                inflight = inflight_to_load(ctx, inflight)
            self.inflight = BatchInProgress.from_state(
                inflight, self.cfg, self.policy, ctx.rank, ctx.world_size
            )
        # the engine gets these weights before it generates anything (async: a floor)
        self.producer.report_progress(self.version, self._steps_left())
        self.producer.push_weights(self.version, self._sync_tensors)
        if Path(path).parent == self.out / "checkpoints":
            self.saved = (self.step, Path(path))
        log.info("resumed from %s at step %d", path, self.step)
        return True

    # -- the loop ------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Train to run.max_steps and return the final evaluation; on a stop signal, save
        a checkpoint at the step reached and raise RunStopped (stopping.py)."""
        with StopSignals(abandon=not self.ctx.distributed) as self.signals:
            return self._train()

    def _train(self) -> dict[str, float]:
        clean, stopped = False, None
        try:
            if self.step == 0 and not self.resumed:
                self.logger.log(0, self.evaluate(step=0))
            if hasattr(self.producer, "start"):  # async (rank 0's only, behind a broadcast)
                self.producer.start()
            try:
                self._loop()
            except StopRequested:  # one process: the batch being waited for is abandoned
                self.stop_signal = self.signals.requested
            if self.stop_signal:
                stopped = self.save_on_stop()
            else:
                final = self.finish()
            clean = True
        finally:
            self.close(clean)
        if stopped is not None:
            raise stopped
        return final

    def _loop(self) -> None:
        ctx = self.ctx
        while self.step < self.cfg.run.max_steps and not self.stop_requested():
            batch = None
            if self.inflight is None:
                with ctx.phase("generate"):
                    batch = self.producer.next_batch(self.version)
            if self.engines is not None and self.engines.sleep_while_training:
                self.engines.rollout.sleep()  # it wakes itself for the next request
            if batch is not None:
                with ctx.phase("score"):
                    self.inflight = self.start_batch(batch)
            self.continue_batch()

    def stop_requested(self) -> bool:
        """At an optimizer-step boundary: has a stop signal arrived? Under torchrun: on
        any rank (every rank calls this at the same boundaries; one all-reduce)."""
        if not self.stop_signal:
            signum = self.signals.requested
            if self.ctx.distributed:
                with self.ctx.phase("train"):
                    signum = self.ctx.max_int(signum)
            self.stop_signal = signum
        return self.stop_signal > 0

    def save_on_stop(self) -> RunStopped:
        """The checkpoint at the step the run stopped at (unless it has one already)."""
        if self.saved is not None and self.saved[0] == self.step:
            path = self.saved[1]
        else:
            path = self.save_checkpoint()
        return RunStopped(self.stop_signal, self.step, path, show=self.ctx.is_main)

    def start_batch(self, batch: RolloutBatch) -> BatchInProgress | None:
        """Plan the batch's steps and fill in old/reference log-probs; None: skipped."""
        t0 = time.perf_counter()
        samples = [s for s in batch.samples if s.reward is not None]
        steps = plan_steps(samples, self.cfg, self.policy, self.ctx.rank, self.ctx.world_size)
        if not steps:
            self.skip_batch(batch)
            return None
        self.skips.batches_in_a_row = 0
        attach_old_and_ref(self.policy, steps, self.cfg, self.sampling)
        batch_metrics = {
            **batch.metrics,
            **rollout_metrics(batch, self.version),
            "time/score": time.perf_counter() - t0,
        }
        return BatchInProgress(batch, steps, self.cfg.loss.mu, metrics=batch_metrics)

    def continue_batch(self) -> None:
        """Optimizer steps on the batch in hand until it is done, max_steps is reached or
        a stop is requested."""
        while self.inflight is not None and self.step < self.cfg.run.max_steps:
            if self.stop_requested():
                return
            work = self.inflight
            planned, metrics = work.take()
            if not work.remaining:  # a checkpoint at this step holds no batch in progress
                self.inflight = None
            self.optimizer_step(planned, metrics, work.batch)

    def skip_batch(self, batch: RolloutBatch) -> None:
        """Nothing to train on: every sample unscored (a reward outage), or with re-rolls
        every scored group flat and left out (pipeline_batch.py). Consumed, counted."""
        self.skips.batches += 1
        self.skips.batches_in_a_row += 1
        flat = int(batch.metrics.get("reroll/left_out", 0))
        if flat:
            log.warning(
                "generation batch skipped: its %d scored groups were flat (no reward variance),"
                " which pipeline.reroll leaves out",
                flat,
            )
        else:
            log.warning(
                "generation batch skipped: none of its %d samples was scored", len(batch.samples)
            )
        self.logger.log(self.step, {**batch.metrics, **self.skips.metrics()})
        limit = self.cfg.pipeline.max_consecutive_skipped_batches
        if self.skips.batches_in_a_row >= limit:
            why = "had no scored sample"
            if flat:
                why += " with reward variance (pipeline.reroll leaves flat groups out)"
            raise RunError(
                f"the last {limit} generation batches {why}, so there is nothing to train on (pipeline.max_consecutive_skipped_batches = {limit}); check the reward functions: reward/*/failures and frac_reward_zero_std in {self.out / 'metrics.jsonl'} count their failures and the groups they scored all alike"
            )

    def optimizer_step(self, planned: PlannedStep, batch_metrics: dict, batch) -> None:
        ctx, micro_batches = self.ctx, planned.micro_batches
        t0, waited = time.perf_counter(), ctx.wait_s
        staleness = staleness_metrics(planned.versions, self.version)  # at this update
        with ctx.phase("train"):
            result = train_step(
                self.policy,
                micro_batches,
                self.optimizer,
                self.cfg,
                self.sampling,
                self.loss_cfg,
                ctx,
            )
        self.step += 1
        if result.updated:
            self.scheduler.step()
            self.version += 1
            self.skips.steps_in_a_row = 0
        else:
            self.skipped += 1
            self.skips.steps_in_a_row += 1
            log.warning("step %d skipped: non-finite loss or gradient", self.step)
        train_s = time.perf_counter() - t0
        self.producer.report_progress(self.version, self._steps_left())
        with ctx.phase("sync"):
            sync_s = self.sync_weights()
        tokens = planned.metrics.get("packing/tokens", 0.0)  # this rank's, padding left out
        metrics = {
            **batch_metrics,
            **result.metrics,
            **staleness,
            "lr": self.scheduler.get_last_lr()[0],
            "version": float(self.version),
            "train/skipped_steps": float(self.skipped),
            **self.skips.metrics(),
            "time/train": train_s,
            "time/weight_sync": sync_s,
            "throughput/train_tokens_per_s": tokens / max(train_s, 1e-9),
        }
        if ctx.distributed:
            from leangrpo.distributed.strategy import reduce_rank_metrics

            with ctx.phase("train"):
                metrics = reduce_rank_metrics(
                    ctx, {**metrics, "_tokens": tokens}, ctx.wait_s - waited
                )
        self.on_step_end(metrics, batch)
        self._stop_if_every_step_skips()

    def _steps_left(self) -> int:
        return self.inflight.remaining if self.inflight is not None else 0

    def _stop_if_every_step_skips(self) -> None:
        limit = self.cfg.train.max_consecutive_skipped_steps
        if self.skips.steps_in_a_row >= limit:
            raise RunError(
                f"the last {limit} optimizer steps were all skipped because the loss or gradient was not finite (train.max_consecutive_skipped_steps = {limit}); lower train.learning_rate or loss.beta, or look at loss and grad_norm in {self.out / 'metrics.jsonl'}"
            )

    def sync_weights(self) -> float:
        """New weights to the generator every sync_interval updates (a live engine: every one)."""
        if not self.sync_every_version and self.version % self.cfg.pipeline.sync_interval:
            return 0.0
        return self.producer.push_weights(self.version, self._sync_tensors)

    def _sync_tensors(self):
        """What the engine receives; under torchrun gathered from the shards (collective)."""
        if not self.ctx.distributed:
            return self.policy.named_trainable_tensors()
        from leangrpo.distributed.strategy import sync_tensors

        return sync_tensors(self.policy, self.ctx, to_all=self.per_rank)

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluation metrics ({} on torchrun ranks that do not evaluate)."""
        if self.evaluator is None:
            return {}
        with self.ctx.phase("generate"):
            return self.evaluator.run(self.version, step=step)

    def on_step_end(self, metrics: dict, batch: RolloutBatch) -> None:
        cfg = self.cfg
        if _due(self.step, cfg.eval.every_steps) and self.step < cfg.run.max_steps:
            metrics.update(self.evaluate(step=self.step))
        self.logger.log(self.step, metrics)
        if _due(self.step, cfg.logging.samples_every):
            self.logger.log_samples(self.step, sample_rows(batch))
        if _due(self.step, cfg.checkpoint.every_steps) and self.step < cfg.run.max_steps:
            self.save_checkpoint()

    def finish(self) -> dict[str, float]:
        final = self.evaluate(step=self.step)
        self.logger.log(self.step, final)
        self.save_checkpoint()
        if self.cfg.checkpoint.save_final_model:
            with self.ctx.phase("checkpoint"):
                if self.ctx.distributed:
                    from leangrpo.checkpoint.sharded import save_final_sharded

                    save_final_sharded(self.out, self.policy.model, self.policy.tokenizer, self.ctx)
                else:
                    ckpt.save_final_model(self.out, self.policy.model, self.policy.tokenizer)
        return final

    def save_checkpoint(self) -> Path:
        state = {
            "step": self.step,
            "version": self.version,
            "skipped": self.skipped,
            "skips": dataclasses.asdict(self.skips),
            "schedule_steps": self.schedule_steps,  # the LR schedule's horizon (resume keeps it)
            # rows logged at this step so far: a resume drops the ones logged after it
            "metrics_rows_at_step": self.logger.rows_logged_at(self.step),
        }
        bulky = {"producer": self.producer.state_dict()}
        extra = {"config.yaml": self.cfg.to_yaml()}  # compared on resume (rundir.py)
        args = (self.out, self.step, self.policy.model, self.optimizer, self.scheduler, state)
        keep = self.cfg.checkpoint.keep_last
        with self.ctx.phase("checkpoint"):
            if not self.ctx.distributed:
                if self.inflight is not None:
                    bulky["inflight"] = self.inflight.state_dict()
                path = ckpt.save_checkpoint(*args, keep, extra_files=extra, bulky_state=bulky)
            else:
                from leangrpo.checkpoint.sharded import save_sharded_checkpoint
                from leangrpo.distributed.strategy import inflight_to_save

                if self.inflight is not None:
                    bulky["inflight"] = inflight_to_save(self.ctx, self.inflight.state_dict())
                path = save_sharded_checkpoint(
                    *args, keep, self.ctx, extra_files=extra, bulky_state=bulky
                )
        self.saved = (self.step, path)
        return path

    def close(self, clean: bool = False) -> None:
        """The reward pool first: a producer thread waiting in `score()` gets PoolClosedError
        at once instead of finishing a reward's timeout; then the producer (it may be
        mid-call into the engines), then the engines. `clean`: the run ended normally on
        every rank (torchrun: per-rank producers first stop in step, see dist_rollout; a
        thread whose share of its last batch then fails on the closed pool aborts that
        batch's exchange, so no peer's thread is left waiting in it)."""
        if self.per_rank and clean:
            from leangrpo.distributed.rollout import stop_rank_producer

            stop_rank_producer(self.producer, self.share, self.ctx)
        if self.rewards is not None:
            self.rewards.close()
        self.producer.close()
        if self.engines is not None:
            self.engines.close()
        self.logger.close()
        self.checked.release()


@dataclasses.dataclass
class RunSkips:
    """What the run skipped: unscored batches in all, and skips in a row (the stop rules)."""

    batches: int = 0
    batches_in_a_row: int = 0
    steps_in_a_row: int = 0

    def metrics(self) -> dict[str, float]:
        return {"pipeline/skipped_batches": float(self.batches)}


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def rollout_metrics(batch: RolloutBatch, trainer_version: int) -> dict[str, float]:
    """Completion lengths, finish reasons and staleness (when consumed) of one batch."""
    lengths = [len(s.completion.ids) for s in batch.samples] or [0]
    stale = [trainer_version - s.version for s in batch.samples] or [0]
    n = max(len(batch.samples), 1)
    return {
        "completions/mean_length": float(np.mean(lengths)),
        "completions/max_length": float(max(lengths)),
        "completions/truncated_frac": sum(
            s.completion.finish_reason == "length" for s in batch.samples
        )
        / n,
        "staleness/consumed_max": float(max(stale)),
        "samples/unscored": float(sum(s.reward is None for s in batch.samples)),
        "samples/replayed": float(sum(s.replayed for s in batch.samples)),
    }


def staleness_metrics(versions: list[int], version: int) -> dict[str, float]:
    """Age of the samples of one optimizer step at this update (trainer version - theirs);
    `versions`: every sample of the step (on every rank under torchrun)."""
    ages = [version - v for v in versions] or [0]
    return {"staleness/mean": float(np.mean(ages)), "staleness/max": float(max(ages))}


def sample_rows(batch: RolloutBatch, groups: int = 2, per_group: int = 3) -> list[dict]:
    """A few completions of the first groups: what the model writes and how it is scored."""
    return [
        {"prompt": s.prompt.text, "completion": s.completion.text, "reward": s.reward}
        for group in batch.groups()[:groups]
        for s in group[:per_group]
    ]


def train(
    cfg: Config, checked: Preflight | None = None, ctx: DistContext | None = None
) -> dict[str, float]:
    """Run `cfg` to run.max_steps; a run already finished does nothing and returns {}.

    `ctx`: the caller's torchrun context (it ends it); without one, the environment's is
    made here and ended after a successful run."""
    own = ctx is None
    ctx = ctx if ctx is not None else init_distributed(cfg.distributed, cfg.run.device)
    checked = checked if checked is not None else preflight(cfg, ctx)
    final = {}
    if checked.finished:
        checked.release()
        log.info(checked.finished_message())
    else:
        try:
            final = Trainer(cfg, checked, ctx).train()
        except RunStopped:  # every rank stopped at one step: they leave the group together
            if own:
                ctx.shutdown()
            raise
    if own:
        ctx.shutdown()
    return final
