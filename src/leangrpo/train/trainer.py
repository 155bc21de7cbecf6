"""The GRPO loop: for each generation batch, score it, then for each of its mu x
steps_per_generation optimizer steps: step -> sync -> log -> evaluate -> checkpoint.

Everything expensive is set up in `Trainer.__init__` after every cheap check has passed
(preflight.py: config, data, reward functions, model files, the locked run directory), so
bad input fails in a second with one sentence. What differs between one process and
torchrun (device, sharding, the step's ranks, checkpoints, the weights engines receive,
per-rank metrics, the logger, the producer's shutdown) is a `contracts.Strategy` chosen
once at set-up (distributed/strategy.py), so the loop below has one code path. Each phase runs
inside `ctx.phase(...)` (a no-op in one process; under torchrun a rank that fails stops
the others within `distributed.timeout_s`, naming it and the phase).

The policy version counts successful optimizer updates; every sample carries the version
that generated it, so staleness is measured, never assumed (`staleness/*` at each update).

Guards: a batch with no scored sample (with re-rolls: no scored group with signal) is
skipped (counted, consumed); a run stops with one sentence after
`train.max_consecutive_skipped_steps` non-finite steps or
`pipeline.max_consecutive_skipped_batches` such batches in a row, or at the first such
batch whose cause is certain to last (train/skips.py: an environment that failed every
trajectory the same way, a reward that timed out on every sample). A checkpoint taken
inside a batch holds that batch (`BatchInProgress`), so resume is exact at any step.

Stop signals (stopping.py): during `train()` a first SIGTERM or Ctrl-C is checked at each
optimizer-step boundary (on every rank, agreed by one all-reduce; a wait for a batch in one
process is cut short: the batch is abandoned); the run then saves a checkpoint at that
step, closes, and raises `RunStopped`. See docs/training.md and docs/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import resource
import time
from pathlib import Path

import numpy as np
import torch

from leangrpo.agents.setup import start_agents
from leangrpo.checkpoint.rundir import schedule_horizon
from leangrpo.config import Config
from leangrpo.contracts import MultiTurn, RolloutBatch
from leangrpo.distill.served import ServedTeacher
from leangrpo.distill.teacher import load_teacher
from leangrpo.distributed.context import DistContext, init_distributed
from leangrpo.distributed.strategy import choose_strategy
from leangrpo.environments.setup import start_environments
from leangrpo.errors import RunError
from leangrpo.metrics.learning import LearningSignal, warn_if_tokenizer_drops_text
from leangrpo.model.policy import Policy, load_policy
from leangrpo.model.tokenizer import remember
from leangrpo.pipeline.builder import build_pipeline
from leangrpo.preflight import (
    Preflight,
    check_attention_backend,
    load_checked_tokenizer,
    preflight,
    prepare_prompts,
)
from leangrpo.prestart import Prestarted
from leangrpo.rewards import RewardPool
from leangrpo.rollout.factory import make_engines, start_shared_engine
from leangrpo.stopping import RunStopped, StopRequested, StopSignals
from leangrpo.train.inflight import BatchInProgress
from leangrpo.train.passes import attach_missing_teacher, attach_old_and_ref
from leangrpo.train.planning import PlannedStep, group_indices, plan_steps
from leangrpo.train.routing import routing_diagnostics
from leangrpo.train.schedule import make_scheduler
from leangrpo.train.skips import certain_cause, skipped_batches_advice
from leangrpo.train.step import train_step

log = logging.getLogger("leangrpo")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        checked: Preflight | None = None,
        ctx: DistContext | None = None,
        prestarted: Prestarted | None = None,
    ):
        """`checked`: the CLI's preflight result (its run-directory lock passes to us);
        `ctx`: the torchrun context (default: from the environment; the caller ends it);
        `prestarted`: worker pools the CLI started before importing torch (we take them)."""
        self.prestarted = prestarted
        self.ctx = ctx if ctx is not None else init_distributed(cfg.distributed, cfg.run.device)
        self.checked = checked if checked is not None else preflight(cfg, self.ctx)
        try:
            self.cfg = cfg
            self.out = self.checked.run_dir.path
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
            if getattr(self, "multi_turn", None) is not None:
                self.multi_turn.close()
            self.checked.release()
            raise

    # -- set-up --------------------------------------------------------------------------
    def _build(self, cfg: Config) -> None:
        ctx = self.ctx
        self.strategy = strategy = choose_strategy(cfg, ctx, self.out)
        check_attention_backend(cfg, strategy.device.type)  # run.device auto, resolved
        log.info("loading transformers, the tokenizer and the prompts ...")
        tokenizer, limit = load_checked_tokenizer(cfg, self.checked)  # `leangrpo check` too
        # multi-turn, still before the model loads: environment workers (or the agent
        # endpoint and workers) and the chat template, the prompts as their first turn
        # renders them, a probe reset
        self.multi_turn = self._start_multi_turn(cfg, tokenizer)
        early = self.prestarted
        first_turn = self.multi_turn.first_turn if self.multi_turn else None
        prompts = prepare_prompts(cfg, tokenizer, limit, first_turn)
        if ctx.is_main:
            warn_if_tokenizer_drops_text(prompts.train, tokenizer, cfg.model.name_or_path)
        # warns when nothing can be learned (a teacher's signal is not the groups')
        self.learning = LearningSignal(self.out, flat_groups_matter=cfg.distill is None)
        remember(self.checked.model.directory, tokenizer)  # for the next preflight and check
        if self.multi_turn is not None:
            self.multi_turn.probe(prompts.train[0])
        log.info("loading the model %s (%s) ...", cfg.model.name_or_path, cfg.model.dtype)
        started = start_shared_engine(cfg, strategy.device)  # vLLM first: the policy views it
        shared = started.build_policy(cfg, tokenizer, strategy.device) if started else None
        self.policy: Policy = shared or load_policy(
            cfg, tokenizer, strategy.device, reference_on_meta=strategy.reference_on_meta
        )
        # a served teacher: its servers' client (they were checked before anything loaded)
        self.served_teacher = ServedTeacher(cfg.distill) if cfg.served_teacher() else None
        if cfg.distill is not None and not cfg.distill.served:  # sharded under torchrun
            log.info("loading the teacher %s ...", cfg.distill.teacher)
            # torchrun (sharded next): staged in host memory, sharded onto the device
            staged = strategy.reference_on_meta
            self.policy.teacher = load_teacher(cfg, strategy.device, staged=staged)
        own_copy = strategy.shard(self.policy)  # torchrun, hf engine: the rank's own copy
        self.engines = engines = make_engines(
            cfg, self.policy, ctx, own_copy, started=started and started.engine
        )
        self.optimizer = self._make_optimizer()
        self.schedule_steps = self._schedule_horizon()
        self.scheduler = make_scheduler(self.optimizer, cfg.train, self.schedule_steps)
        self.sampling = cfg.rollout.sampling_params()  # per-batch seeds are set by the producer
        self.rewards = early.take_rewards() if early is not None else None
        if self.rewards is None and engines is not None:
            if cfg.rewards.functions:
                log.info("starting %d reward worker(s) ...", cfg.rewards.num_workers)
            self.rewards = RewardPool(cfg.rewards)
        # hf sync, or vLLM sharing full fine-tuning weights: every version
        self.sync_every_version = cfg.generates_with_live_weights() or (
            engines is not None and engines.rollout_shares_weights
        )
        pipeline = build_pipeline(
            cfg, ctx, engines, self.rewards, prompts.train, prompts.eval, self.multi_turn
        )
        self.producer, self.evaluator = pipeline.producer, pipeline.evaluator
        self.share = pipeline.share
        with ctx.phase("checkpoint"):
            self.resumed = resumed = self._maybe_resume()
        server = cfg.rollout.engine == "vllm" and cfg.rollout.vllm.mode == "server"
        if server and not resumed:  # a server may hold another run's weights
            with ctx.phase("sync"):
                named = self._weights()
                if engines is not None:
                    engines.rollout.update_weights(named, self.version)
        if ctx.is_main:  # set-up done: run.overwrite sets the earlier run aside only now
            self.checked.run_dir.begin_writing()
            cfg.save(self.out / "config.yaml")
        self.logger = self._make_logger(resumed)
        if not resumed:
            self.logger.stage(prompts.metrics)  # merged into the step-0 row

    def _start_multi_turn(self, cfg: Config, tokenizer) -> MultiTurn | None:
        """The environment workers (prestarted where they could be), or the agent endpoint
        and workers, on the processes that generate (torchrun with vLLM: rank 0 alone)."""
        if not self.strategy.generates:
            return None
        if cfg.agent is not None:
            log.info("starting the agent endpoint and %d agent worker(s) ...", cfg.agent.num_workers)
            return start_agents(cfg, tokenizer)
        early = self.prestarted
        pool = early.take_environment_pool() if early is not None else None
        if cfg.environment is not None and pool is None:
            log.info("starting %d environment worker(s) ...", cfg.environment.num_workers)
        return start_environments(cfg, tokenizer, pool)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        t = self.cfg.train
        return torch.optim.AdamW(
            self.policy.trainable_parameters(),
            lr=t.learning_rate,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps,
            weight_decay=t.weight_decay,
        )

    def _make_logger(self, resumed: bool):
        """The strategy's logger (real on the main rank), continuing the log on a resume."""
        cfg = self.cfg
        return self.strategy.logger(
            self.out,
            cfg.logging.backends,
            cfg.logging.progress_bar,
            cfg.run.max_steps,
            run_name=cfg.logging.run_name,
            config_dict=cfg.model_dump(mode="json"),
            project=cfg.logging.wandb_project,
            resume_step=self.step if resumed else None,
            resume_rows=self.resume_rows if resumed else None,
            eval_every=cfg.eval.every_steps if self.evaluator is not None else 0,
        )

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
        model, opt, sched = self.policy.model, self.optimizer, self.scheduler
        restored = self.strategy.checkpointer.load(path, model, opt, sched)
        state, bulky = restored.trainer_state, restored.bulky_state
        self.step, self.version, self.skipped = state["step"], state["version"], state["skipped"]
        self.resume_rows = state.get("metrics_rows_at_step")  # None: an older checkpoint
        self.skips = RunSkips(**state.get("skips", {}))
        self.producer.load_state_dict(bulky.get("producer", state.get("producer")))
        if restored.inflight is not None:
            ranks = self.strategy.ranks  # this process's data-parallel share
            self.inflight = BatchInProgress.from_state(
                restored.inflight, self.cfg, self.policy, ranks.rank, ranks.world_size
            )
            cfg = self.cfg
            if attach_missing_teacher(self.policy, self.inflight.steps, cfg.logprobs,
                                      self.sampling, ranks, cfg.distill, self.served_teacher):  # fmt: skip
                log.info("the batch in progress was saved without the teacher's log-probs "
                         "(distill added on this resume): scored by the teacher now")  # fmt: skip
        # the engine gets these weights before it generates anything (async: a floor)
        self.producer.report_progress(self.version, self._steps_left())
        self.producer.push_weights(self.version, self._weights)
        if Path(path).parent == self.out / "checkpoints":
            self.saved = (self.step, Path(path))
        log.info("resumed from %s at step %d", path, self.step)
        return True

    # -- the loop ------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Train to run.max_steps and return the final evaluation; on a stop signal, save
        a checkpoint at the step reached and raise RunStopped (stopping.py)."""
        with StopSignals(abandon=self.strategy.abandon_waits) as self.signals:
            return self._train()

    def _train(self) -> dict[str, float]:
        clean, stopped = False, None
        try:
            if self.step == 0 and not self.resumed:
                if self.evaluator is not None and self.evaluator.prompts:
                    log.info("evaluating on %d held-out prompts ...", len(self.evaluator.prompts))
                self.logger.log(0, self.evaluate(step=0))
            rollout = self.cfg.rollout
            log.info(
                "training: %d steps of %d prompts x %d completions",
                self.cfg.run.max_steps - self.step,
                rollout.prompts_per_batch,
                rollout.num_generations,
            )
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
        """For each generation batch (unless a resumed one is in hand): generate, score,
        then its optimizer steps."""
        while self.step < self.cfg.run.max_steps and not self.stop_requested():
            batch = self.generate() if self.inflight is None else None
            if self.engines is not None and self.engines.sleep_while_training:
                self.engines.rollout.sleep()  # it wakes itself for the next request
            if batch is not None:
                self.inflight = self.score(batch)
            self.train_on_batch()

    def generate(self) -> RolloutBatch:
        with self.ctx.phase("generate"):
            return self.producer.next_batch(self.version)

    def score(self, batch: RolloutBatch) -> BatchInProgress | None:
        """Plan the batch's steps and fill in old/reference log-probs; None: skipped."""
        with self.ctx.phase("score"):
            t0 = time.perf_counter()
            samples = [s for s in batch.samples if s.reward is not None]
            ranks = self.strategy.ranks
            steps = plan_steps(samples, self.cfg, self.policy, ranks.rank, ranks.world_size)
            if not steps:
                self.skip_batch(batch)
                return None
            self.skips.batches_in_a_row = 0
            cfg = self.cfg
            attach_old_and_ref(self.policy, steps, cfg.loss, cfg.logprobs, self.sampling, ranks,
                               cfg.distill, self.served_teacher)  # fmt: skip
            batch_metrics = {
                **batch.metrics,
                **rollout_metrics(batch, self.version),
                **routing_diagnostics(self.policy, steps, cfg, self.sampling, ranks),  # MoE
                "time/score": time.perf_counter() - t0,
            }
            return BatchInProgress(batch, steps, cfg.loss.mu, metrics=batch_metrics)

    def train_on_batch(self) -> None:
        """The batch in hand's optimizer steps, each: step -> sync -> log -> evaluate ->
        checkpoint; until the batch is done, max_steps is reached or a stop is requested."""
        while (
            self.inflight is not None
            and self.step < self.cfg.run.max_steps
            and not self.stop_requested()
        ):
            work = self.inflight
            planned, metrics = work.take()
            if not work.remaining:  # a checkpoint at this step holds no batch in progress
                self.inflight = None
            self.optimizer_step(planned, metrics, work.batch)

    def stop_requested(self) -> bool:
        """At an optimizer-step boundary: has a stop signal arrived? Under torchrun: on
        any rank (every rank calls this at the same boundaries; one all-reduce)."""
        if not self.stop_signal:
            with self.ctx.phase("train"):
                self.stop_signal = self.ctx.max_int(self.signals.requested)
        return self.stop_signal > 0

    def save_on_stop(self) -> RunStopped:
        """The checkpoint at the step the run stopped at (unless it has one already)."""
        if self.saved is not None and self.saved[0] == self.step:
            path = self.saved[1]
        else:
            path = self.save_checkpoint()
        return RunStopped(self.stop_signal, self.step, path, show=self.ctx.is_main)

    def skip_batch(self, batch: RolloutBatch) -> None:
        """Nothing to train on: every sample unscored (a reward outage), or with re-rolls
        every scored group flat and left out (pipeline/batch.py). Consumed, counted."""
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
        metrics_path = self.out / "metrics.jsonl"
        certain = None if flat else certain_cause(batch, self.cfg, metrics_path)
        if certain is not None:  # the next batch would fail alike: stop at the first
            raise RunError(certain)
        limit = self.cfg.pipeline.max_consecutive_skipped_batches
        if self.skips.batches_in_a_row >= limit:
            why = "had no scored sample"
            if flat:
                why += " with reward variance (pipeline.reroll leaves flat groups out)"
            raise RunError(
                f"the last {limit} generation batches {why}, so there is nothing to train on (pipeline.max_consecutive_skipped_batches = {limit}); {skipped_batches_advice(batch, self.cfg, metrics_path)}"
            )

    def optimizer_step(self, planned: PlannedStep, batch_metrics: dict, batch) -> None:
        """One optimizer step -> weight sync -> its metrics -> evaluate, log, checkpoint."""
        ctx = self.ctx
        t0, waited = time.perf_counter(), ctx.wait_s
        staleness = staleness_metrics(planned.versions, self.version)  # at this update
        with ctx.phase("train"):
            result = train_step(
                self.policy,
                planned.micro_batches,
                self.optimizer,
                self.cfg,
                self.sampling,
                self.strategy.ranks,
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
            "memory/peak_gib": peak_memory_gib(self.strategy.device),
        }
        with ctx.phase("train"):  # torchrun: the ranks' figures combined (one all-gather)
            metrics = self.strategy.reduce_metrics(metrics, tokens, ctx.wait_s - waited)
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
        return self.producer.push_weights(self.version, self._weights)

    def _weights(self):
        """What the engine receives (torchrun: gathered from the shards, a collective)."""
        return self.strategy.weights(self.policy)

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluation metrics ({} on torchrun ranks that do not evaluate)."""
        if self.evaluator is None:
            return {}
        t0 = time.perf_counter()
        with self.ctx.phase("generate"):
            metrics = self.evaluator.run(self.version, step=step)
        return {**metrics, "time/eval": time.perf_counter() - t0} if metrics else {}

    def on_step_end(self, metrics: dict, batch: RolloutBatch) -> None:
        cfg = self.cfg
        if _due(self.step, cfg.eval.every_steps) and self.step < cfg.run.max_steps:
            metrics.update(self.evaluate(step=self.step))
        self.logger.log(self.step, metrics)
        if self.ctx.is_main:
            self.learning.observe(self.step, metrics)
        if _due(self.step, cfg.logging.samples_every):
            self.logger.log_samples(self.step, sample_rows(batch))
        if _due(self.step, cfg.checkpoint.every_steps) and self.step < cfg.run.max_steps:
            self.save_checkpoint()

    def finish(self) -> dict[str, float]:
        final = self.evaluate(step=self.step)
        if final:  # no eval set: no row of its own (it would hold only the step)
            self.logger.log(self.step, final)
        self.save_checkpoint()
        if self.cfg.checkpoint.save_final_model:
            with self.ctx.phase("checkpoint"):
                self.strategy.checkpointer.save_final(
                    self.policy.model, self.policy.tokenizer, self.step, self.version
                )
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
            # checked by a resume before the model loads (rundir.py `check_batch_routes`)
            "batch_in_progress": self.inflight.summary(self.step) if self.inflight else None,
        }
        bulky = {"producer": self.producer.state_dict()}
        extra = {"config.yaml": self.cfg.to_yaml()}  # compared on resume (rundir.py)
        with self.ctx.phase("checkpoint"):
            inflight = self.inflight.state_dict() if self.inflight is not None else None
            path = self.strategy.checkpointer.save(
                self.step, self.policy.model, self.optimizer, self.scheduler, state,
                extra_files=extra, bulky_state=bulky, inflight=inflight,
            )  # fmt: skip
        self.saved = (self.step, path)
        if self.ctx.is_main:  # run.overwrite: the earlier run is deleted now
            self.checked.run_dir.checkpoint_saved()
        return path

    def close(self, clean: bool = False) -> None:
        """The reward pool first: a producer thread waiting in `score()` gets PoolClosedError
        at once instead of finishing a reward's timeout; then the producer (it may be
        mid-call into the engines), then the engines. `clean`: the run ended normally on
        every rank (torchrun: per-rank producers first stop in step, see
        distributed/rollout.py; a thread whose share of its last batch then fails on the
        closed pool aborts that batch's exchange, so no peer's thread is left waiting)."""
        if clean:
            self.strategy.stop_producer(self.producer, self.share)
        if self.rewards is not None:
            self.rewards.close()
        if self.multi_turn is not None:  # a producer stepping environments stops too
            self.multi_turn.close()
        self.producer.close()
        if self.engines is not None:
            self.engines.close()
        if self.served_teacher is not None:
            self.served_teacher.close()
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


def peak_memory_gib(device: torch.device) -> float:
    """The peak so far: CUDA memory allocated on a GPU, the process's RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


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
        "completions/truncated_frac": sum(s.truncated for s in batch.samples) / n,
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
        {"prompt": batch.samples[i].prompt.text, "completion": _shown(batch.samples[i]),
         "reward": batch.samples[i].reward}
        for group in group_indices(batch.samples)[:groups]
        for i in group[:per_group]
    ]  # fmt: skip


def _shown(sample) -> str:
    """A completion as logged: its text, or a trajectory's turns and replies by role."""
    trajectory = sample.completion.trajectory
    if trajectory is None:
        return sample.completion.text
    turns = trajectory.messages[len(sample.prompt.messages or []) :]
    return " | ".join(f"{m['role']}: {m['content']}" for m in turns)


def train(
    cfg: Config,
    checked: Preflight | None = None,
    ctx: DistContext | None = None,
    prestarted: Prestarted | None = None,
) -> dict[str, float]:
    """Run `cfg` to run.max_steps; a run already finished does nothing and returns {}.

    `ctx`: the caller's torchrun context (it ends it); without one, the environment's is
    made here and ended after a successful run. `prestarted`: see Trainer."""
    own = ctx is None
    ctx = ctx if ctx is not None else init_distributed(cfg.distributed, cfg.run.device)
    checked = checked if checked is not None else preflight(cfg, ctx)
    final = {}
    if checked.finished:
        checked.release()
        log.info(checked.finished_message())
    else:
        try:
            final = Trainer(cfg, checked, ctx, prestarted).train()
        except RunStopped:  # every rank stopped at one step: they leave the group together
            if own:
                ctx.shutdown()
            raise
    if own:
        ctx.shutdown()
    return final
