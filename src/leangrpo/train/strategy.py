"""The single-process strategy: one process's pieces of a run, as a `contracts.Strategy`.

A Strategy holds every piece that differs between one process and torchrun: the device,
whether this process generates, the step's ranks, the checkpointer, the logger, sharding the policy, the weights engines
receive, the per-rank metrics reducer and the producer's shutdown. One process takes its
roles' own pieces: `train.ranks.OneProcess`, `checkpoint.local.LocalCheckpointer`,
`metrics.logger.MetricsLogger`, `Policy.named_trainable_tensors`, no sharding, figures as
measured, nothing to stop. `distributed.strategy.choose_strategy` picks this one or the
torchrun one once, at set-up, so the trainer runs one code path. See
docs/distributed.md ("One process or torchrun is chosen once").
"""

from __future__ import annotations

from pathlib import Path

from leangrpo.checkpoint.local import LocalCheckpointer
from leangrpo.contracts import Producer, Strategy
from leangrpo.metrics.logger import MetricsLogger
from leangrpo.model.policy import Policy, resolve_device
from leangrpo.train.ranks import ONE_PROCESS


def one_process_strategy(cfg, output_dir: Path) -> Strategy:
    """One process's pieces (`cfg`: the run's Config)."""
    return Strategy(
        device=resolve_device(cfg.run.device),
        reference_on_meta=False,
        abandon_waits=True,  # a stop signal may cut short the wait for a batch
        generates=True,
        ranks=ONE_PROCESS,
        checkpointer=LocalCheckpointer(output_dir, cfg.checkpoint.keep_last),
        logger=MetricsLogger,
        shard=_keep_whole,
        weights=Policy.named_trainable_tensors,
        reduce_metrics=_as_measured,
        stop_producer=_closed_by_owner,
    )


def _keep_whole(policy: Policy) -> None:
    """One process trains the policy whole; its engines share it or copy it themselves."""


def _as_measured(metrics: dict[str, float], tokens: float, wait_s: float) -> dict[str, float]:
    """One process's figures are the run's."""
    return metrics


def _closed_by_owner(producer: Producer, share: object) -> None:
    """One process: the producer's close() is enough."""
