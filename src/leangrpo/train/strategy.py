"""One process or torchrun: the choice, made once at set-up (`choose_strategy`).

A `contracts.Strategy` holds every piece that differs between the two: the device, the
step's ranks, the checkpointer, the logger, sharding the policy, the weights engines
receive, the per-rank metrics reducer and the producer's shutdown. One process takes the
roles' own pieces (`train.ranks.OneProcess`, `checkpoint.local.LocalCheckpointer`,
`metrics.logger.MetricsLogger`, `Policy.named_trainable_tensors`, no sharding, figures as
measured); torchrun takes `distributed.strategy.torchrun_strategy`'s, imported only by a
torchrun run (FSDP and DCP are not loaded otherwise). The trainer then runs one code path.
See docs/ARCHITECTURE.md "Distributed".
"""

from __future__ import annotations

from pathlib import Path

from leangrpo.checkpoint.local import LocalCheckpointer
from leangrpo.contracts import Producer, Strategy
from leangrpo.distributed.context import DistContext
from leangrpo.metrics.logger import MetricsLogger
from leangrpo.model.policy import Policy, resolve_device
from leangrpo.train.ranks import ONE_PROCESS


def choose_strategy(cfg, ctx: DistContext, output_dir: Path) -> Strategy:
    """The run's strategy (`cfg`: its Config): torchrun's when `ctx` spans processes."""
    if not ctx.distributed:
        return one_process_strategy(cfg, output_dir)
    from leangrpo.distributed.strategy import torchrun_strategy  # torchrun runs only

    return torchrun_strategy(cfg, ctx, output_dir)


def one_process_strategy(cfg, output_dir: Path) -> Strategy:
    return Strategy(
        device=resolve_device(cfg.run.device),
        reference_on_meta=False,
        abandon_waits=True,  # a stop signal may cut short the wait for a batch
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
