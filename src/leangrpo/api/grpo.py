"""`leangrpo.GRPO`: a run from Python, on the machinery `leangrpo train` runs.

    run = leangrpo.GRPO("cfg.yaml", reward_funcs=[my_reward], train_dataset=rows)
    result = run.train()   # TrainResult: metrics, eval curve, run directory, final/

`GRPO(...)` builds and validates the config at once (inputs.py: a function that cannot be
sent to the workers, an unknown keyword, a bad value are one sentence here, before
anything starts); `.config` is that `Config`, and `.config.save(path)` writes the YAML
`leangrpo train` runs the same way. `.train()` runs what the CLI runs, in the same order
(`run_checked`, which `leangrpo train` calls too): every cheap check (preflight.py), the
workers prestarted (prestart.py), the trainer; it logs as the CLI does (the `leangrpo`
logger's INFO lines, given a stderr handler for the call when the program configured no
logging; the progress bar on a terminal, a compact line every tenth of the run in a
notebook or a log), prints the same summary, and returns a `TrainResult` read from the
run's files (a run already finished returns its result without loading anything). It
never ends the process: the CLI alone exits without the interpreter's teardown. A stop
signal (Ctrl-C, a notebook's interrupt, SIGTERM) during training saves a checkpoint and
raises `RunStopped`; calling `.train()` again resumes (run.resume: auto). Under torchrun
the CLI runs the config (`torchrun -m leangrpo train`), not this class.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leangrpo.api.inputs import build_config
from leangrpo.checkpoint.rundir import current_final
from leangrpo.config import Config, ConfigError

log = logging.getLogger("leangrpo")
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"  # the CLI's (cli.py main)


@dataclass(frozen=True)
class TrainResult:
    """What a run left: read from its metrics.jsonl and directory once it has ended."""

    run_dir: Path
    final_dir: Path | None  # final/ (the model or adapter), when it holds the run's newest weights
    step: int  # the last step logged
    metrics: dict[str, float]  # every metric's last logged value
    eval: dict[str, float]  # the last evaluation's eval/* figures ({}: no eval prompts)
    eval_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, eval/reward)

    @classmethod
    def read(cls, run_dir: str | Path) -> TrainResult:
        from leangrpo.metrics.logger import read_metrics

        run_dir = Path(run_dir)
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
        latest: dict[str, float] = {}
        evals: list[dict[str, Any]] = []
        for row in rows:
            latest.update({k: v for k, v in row.items() if k != "step" and v is not None})
            if "eval/reward" in row:
                evals.append(row)
        last_eval = {k: v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else {}
        curve = [(int(r["step"]), _number(r["eval/reward"])) for r in evals]
        return cls(
            run_dir=run_dir,
            final_dir=current_final(run_dir),  # not a final/ the run has trained past
            step=int(rows[-1]["step"]) if rows else 0,
            metrics=latest,
            eval=last_eval,
            eval_curve=curve,
        )


def _number(value: Any) -> float:
    return float("nan") if value is None else float(value)


class GRPO:
    """A GRPO run: see the module docstring for the arguments (inputs.py for each form)."""

    def __init__(
        self,
        config: Any = None,
        *,
        reward_funcs: list | Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        environment: Any = None,
        tools: list | None = None,
        **overrides: Any,
    ):
        self.config: Config = build_config(
            config,
            reward_funcs=reward_funcs,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            environment=environment,
            tools=tools,
            overrides=overrides,
        )

    def __repr__(self) -> str:
        return f"GRPO(model={self.config.model.name_or_path!r}, output_dir={self.config.run.output_dir!r})"

    def __reduce__(self) -> Any:
        raise TypeError(
            "a leangrpo.GRPO run stays in the process that trains; send its config instead (GRPO.config)"
        )

    def train(self) -> TrainResult:
        """Train to run.max_steps (or resume and finish) and return what the run left."""
        started = time.monotonic()
        cfg = self.config
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(
                "leangrpo.GRPO trains in one process, but WORLD_SIZE > 1 (torchrun); save the config (GRPO(...).config.save('run.yaml')) and start `torchrun ... -m leangrpo train run.yaml`."
            )
        with console_logging():
            from leangrpo.preflight import preflight

            checked = preflight(cfg)  # holds the run directory's lock from here on
            if checked.finished:
                checked.release()
                log.info(checked.finished_message())
            else:
                run_checked(cfg, checked)
                release_memory()
                from leangrpo.metrics.report import run_summary

                print(run_summary(cfg.run.output_dir, time.monotonic() - started), flush=True)
        return TrainResult.read(cfg.run.output_dir)


def run_checked(cfg: Config, checked: Any) -> dict[str, float]:
    """After preflight passed: the workers prestarted (their imports overlap torch's), then
    the trainer; returns the final evaluation. `leangrpo train` and `GRPO.train` both."""
    from leangrpo.prestart import Prestarted

    prestarted = None
    try:
        prestarted = Prestarted(cfg)
        if "torch" not in sys.modules:
            log.info("loading torch ...")
        from leangrpo.train import train

        return train(cfg, checked, prestarted=prestarted)
    finally:
        if prestarted is not None:
            prestarted.close()


def release_memory() -> None:
    """The run's model, optimizer and engines are garbage once it returns: free them now
    (their reference cycles would wait for the collector), and the GPU's cached blocks, so a
    notebook gets its memory back for the next cell."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def console_logging() -> Iterator[None]:
    """The CLI's INFO lines on stderr for the call, when nothing else handles them (a
    program or notebook that configured logging keeps its own)."""
    logger = logging.getLogger("leangrpo")
    if logger.hasHandlers():
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
