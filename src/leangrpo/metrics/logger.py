"""Metrics: one JSON line per step, optional trackers, a quiet progress display.

`MetricsLogger.log(step, metrics)` appends `{"step": step, ...flat keys...}` to
`output_dir/metrics.jsonl`. Every write is flushed, so a crash loses at most the line being
written; `read_metrics` skips such a torn line (anywhere: a resumed run appends after
it) with a warning naming file and line. Choices:

- Values become JSON numbers: tensors and numpy scalars via `.item()`, nested dicts
  flattened with "/". NaN and +-inf are written as null, because strict JSON has neither.
  Text is refused (it belongs in `log_samples`).
- TensorBoard, W&B and trackio are imported only when asked for. A missing one is a
  `ConfigError` at construction that names the pip extra, not a failure at step 1000.
- The console gets a rich progress bar with ETA and three numbers (eval/reward,
  reward/mean, loss), never a wall of text; a narrow console drops metrics before the step
  or the ETA. The ETA paces the remaining steps on the recent ones and adds the
  evaluations to come (`eval_every`, each at the last one's `time/eval`). When stdout is
  not a terminal (CI, nohup) it prints one compact line of at most 80 characters about
  every tenth of the run instead; the last step's line waits for `close()`, so that it
  shows the final evaluation (logged after the step's own row), not the one before.
- `resume_step=N` drops rows with step > N from existing files, so a resumed run's log has
  no duplicated or orphaned steps; `resume_rows=k` (what `rows_logged_at(N)` said when the
  checkpoint was saved) also drops the step-N rows after its first k: rows logged after
  the checkpoint under the same step (skipped batches) belong to work the resumed run
  does again. The number of rows dropped is said in one line (a run killed past its
  checkpoint). A fresh run never appends to an earlier run's file: rundir.py refuses (or,
  with run.overwrite, empties) a directory holding one.
- `stage(metrics)` holds values logged once (the data counts) until the next row, so they
  land in the step-0 row instead of a row of their own.
- Under torchrun rank 0 holds the MetricsLogger and every other rank a `NullLogger` (the
  set-up's choice, distributed/strategy.py); both are a `contracts.MetricsLog`. See
  docs/distributed.md ("Metrics and logs").
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from leangrpo.config import ConfigError

log = logging.getLogger(__name__)
KEY_METRICS = ("eval/reward", "reward/mean", "loss")  # the console's, most useful first
SHORT = {"eval/reward": "eval", "reward/mean": "reward", "loss": "loss"}
LINE_WIDTH = 80  # the compact line (no terminal) keeps to this, metrics cut first
BAR_WIDTH = 16
# the bar's columns besides the metrics: "train", the bar, "M/N" (2 x digits, added per
# run), elapsed, "eta ..." and the separators
BAR_FIXED_WIDTH = len("train") + BAR_WIDTH + len("/") + len("0:00:00") + len("eta 00m00s") + 6
BACKENDS = ("jsonl", "tensorboard", "wandb", "trackio")
INSTALL_HINT = {
    "tensorboard": ("tensorboard", "pip install 'leangrpo[tensorboard]'"),
    "wandb": ("wandb", "pip install 'leangrpo[wandb]'"),
    "trackio": ("trackio", "pip install trackio"),
}


class MetricsLogger:
    def __init__(
        self,
        output_dir: str | Path,
        backends: Iterable[str] = ("jsonl",),
        progress_bar: bool = True,
        total_steps: int = 1,
        run_name: str | None = None,
        config_dict: dict[str, Any] | None = None,
        *,
        project: str | None = None,
        resume_step: int | None = None,
        resume_rows: int | None = None,
        console: Console | None = None,
        eval_every: int = 0,
    ):
        backends = list(dict.fromkeys(backends))
        check_backends(backends)
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.samples_path = self.dir / "samples.jsonl"
        self._last_step, self._rows_at_last_step = 0, 0  # rows logged under the latest step
        if resume_step is not None:
            kept, dropped = drop_rows_after(self.metrics_path, resume_step, resume_rows)
            drop_rows_after(self.samples_path, resume_step)
            self._last_step, self._rows_at_last_step = resume_step, kept
            if dropped:  # a run killed past its checkpoint (SIGKILL, a crash)
                log.info(
                    "resuming at step %d: dropped %d metrics row(s) logged after that checkpoint "
                    "from %s (the steps they logged are trained again)",
                    resume_step,
                    dropped,
                    self.metrics_path,
                )
        self.console = console or Console()
        self._file = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        project = project or "leangrpo"
        self._sinks = [
            make_sink(b, self.dir, project, run_name, config_dict) for b in backends if b != "jsonl"
        ]
        self._progress = ProgressDisplay(
            self.console,
            total_steps,
            progress_bar,
            start_step=resume_step or 0,
            eval_every=eval_every,
        )
        self._staged: dict[str, Any] = {}

    def stage(self, metrics: Mapping[str, Any]) -> None:
        """Add `metrics` to the next logged row (values logged once, e.g. data counts)."""
        self._staged.update(metrics)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        flat = flatten_metrics({**self._staged, **metrics})
        self._staged = {}
        self._file.write(json.dumps({"step": step, **flat}) + "\n")
        self._file.flush()
        if step != self._last_step:
            self._last_step, self._rows_at_last_step = step, 0
        self._rows_at_last_step += 1
        finite = {k: v for k, v in flat.items() if v is not None}
        for sink in self._sinks:
            sink.log(step, finite)
        self._progress.update(step, flat)

    def rows_logged_at(self, step: int) -> int:
        """metrics.jsonl rows with this step so far (a checkpoint saves it: `resume_rows`)."""
        return self._rows_at_last_step if step == self._last_step else 0

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Append rows (prompt, completion, reward, ...) to samples.jsonl and print a table."""
        with open(self.samples_path, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(
                    json.dumps({"step": step, **{k: _json_value(v) for k, v in row.items()}}) + "\n"
                )
        if rows:
            self._progress.print(samples_table(step, rows))

    def close(self) -> None:
        self._progress.close()
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullLogger:
    """Torchrun ranks > 0: rank 0 writes metrics.jsonl and shows the progress bar. Takes
    MetricsLogger's arguments, so a strategy hands either out (contracts.MetricsLog)."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def stage(self, metrics: Mapping[str, Any]) -> None:
        pass

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        pass

    def rows_logged_at(self, step: int) -> int:
        return 0  # rank 0's count is the one its checkpoint saves

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl (or of the one in a run directory); a torn or foreign line
    (not a JSON object with a numeric step) is skipped with a warning."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    rows, skipped = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int | float):
            rows.append(row)
        else:  # a line torn by a crash (a resumed run appends after it)
            skipped.append(number)
    if skipped:
        log.warning(
            "%s: skipped %d line(s) that are not complete metrics rows (line %s)",
            path,
            len(skipped),
            ", ".join(map(str, skipped[:5])) + (" ..." if len(skipped) > 5 else ""),
        )
    return rows


# -- values ---------------------------------------------------------------------------------


def flatten_metrics(
    metrics: Mapping[str, Any], prefix: str = ""
) -> dict[str, float | int | bool | None]:
    flat: dict[str, float | int | bool | None] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_metrics(value, f"{name}/"))
        else:
            flat[name] = to_number(name, value)
    return flat


def to_number(name: str, value: Any) -> float | int | bool | None:
    """A JSON-safe scalar: tensors/numpy via .item(); NaN and inf become None."""
    if value is None or isinstance(value, bool):
        return value
    if hasattr(value, "item") and not isinstance(value, int | float):  # tensor, numpy scalar
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            raise ValueError(
                f"metric {name!r} is not a scalar (shape {tuple(value.shape)}); log a number, e.g. its .mean()."
            ) from None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(
        f"metric {name!r} is a {type(value).__name__}; log numbers only (text goes to log_samples)."
    )


def _json_value(value: Any) -> Any:
    if isinstance(value, str | None):
        return value
    try:
        return to_number("sample", value)
    except (TypeError, ValueError):
        return str(value)


def drop_rows_after(path: Path, step: int, rows_at_step: int | None = None) -> tuple[int, int]:
    """Rewrite a JSONL file without rows whose step is above `step` (and any torn line),
    keeping only the first `rows_at_step` rows of `step` itself when given; returns how
    many rows of `step` are kept and how many rows were dropped (torn lines aside)."""
    if not path.is_file():
        return 0, 0
    kept, at_step, dropped = [], 0, 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or row.get("step", 0) > step:
            dropped += isinstance(row, dict)
            continue
        if row.get("step", 0) == step:
            if rows_at_step is not None and at_step >= rows_at_step:
                dropped += 1
                continue
            at_step += 1
        kept.append(line + "\n")
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    return at_step, dropped


# -- trackers -------------------------------------------------------------------------------


def check_backends(backends: list[str]) -> None:
    for backend in backends:
        if backend not in BACKENDS:
            raise ConfigError(
                f"logging.backends has unknown backend {backend!r}; use any of {', '.join(BACKENDS)}."
            )
        if backend in INSTALL_HINT:
            module, hint = INSTALL_HINT[backend]
            try:
                __import__(module)
            except ImportError:
                raise ConfigError(
                    f"logging.backends includes {backend!r} but the {module} package is not installed; run `{hint}` or remove it from logging.backends."
                ) from None


def make_sink(
    backend: str, output_dir: Path, project: str, run_name: str | None, config: dict | None
):
    if backend == "tensorboard":
        return TensorBoardSink(output_dir / "tensorboard")
    module = __import__(backend)  # wandb and trackio share init/log/finish
    return TrackerSink(module, project, run_name, config, output_dir)


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, float(value), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class TrackerSink:
    """wandb or trackio: `init(project, name, config)`, `log(metrics, step)`, `finish()`."""

    def __init__(
        self, module: Any, project: str, run_name: str | None, config: dict | None, output_dir: Path
    ):
        kwargs: dict[str, Any] = {"project": project, "name": run_name, "config": config}
        if "dir" in inspect.signature(module.init).parameters:
            kwargs["dir"] = str(output_dir)
        self.module = module
        self.run = module.init(**kwargs)
        self.log_takes_step = "step" in inspect.signature(module.log).parameters

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.log_takes_step:
            self.module.log(metrics, step=step)
        else:
            self.module.log({**metrics, "step": step})

    def close(self) -> None:
        self.module.finish()


# -- console --------------------------------------------------------------------------------


class ProgressDisplay:
    """A rich bar on a terminal, a compact line every ~10% of the run elsewhere, or nothing.

    What a narrow console drops first is the metrics: the step, the elapsed time and the
    ETA always show, the metrics only in the room left (whole ones, most useful first).
    The ETA is `Eta`'s: recent steps (not the average since the start, which lags when
    trajectories grow) and the evaluations still to come."""

    def __init__(
        self,
        console: Console,
        total_steps: int,
        enabled: bool,
        start_step: int = 0,
        eval_every: int = 0,
        clock=time.monotonic,
    ):
        self.console, self.total, self.enabled = console, max(total_steps, 1), enabled
        self.every = max(1, self.total // 10)
        self.shown: dict[str, float] = {}
        self.start_step, self.clock = start_step, clock
        self.printed = start_step
        self.last_step: int | None = None  # the run's last step, its line printed at close
        self.eta = Eta(self.total, eval_every, start_step, clock())
        self.bar: Progress | None = None
        if enabled and console.is_terminal:
            columns = (
                TextColumn("[bold]train"),
                BarColumn(bar_width=BAR_WIDTH),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta {task.fields[eta]}"),
                TextColumn("{task.fields[stats]}"),
            )
            self.bar = Progress(*columns, console=console)
            self.task = self.bar.add_task(
                "train", total=self.total, completed=start_step, stats="", eta="-"
            )
            self.bar.start()

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        self.shown.update({k: metrics[k] for k in KEY_METRICS if metrics.get(k) is not None})
        self.eta.observe(step, self.clock(), metrics.get("time/eval"))
        if self.bar is not None:
            room = self.console.width - BAR_FIXED_WIDTH - len(str(self.total)) * 2
            eta = _duration(self.eta.seconds_left()) if step > self.start_step else "-"
            self.bar.update(self.task, completed=step, stats=self.stats(room), eta=eta)
        elif step >= self.total:  # at close: the final evaluation's row shares the step
            self.last_step = step
        elif self.enabled and step > max(self.start_step, self.printed) and step % self.every == 0:
            self.printed = step  # one line a step
            self.console.print(self.line(step), highlight=False, soft_wrap=True)

    def stats(self, room: int | None = None) -> str:
        """The key metrics, whole ones only, within `room` characters (None: all)."""
        text = ""
        for key in KEY_METRICS:
            if key in self.shown:
                part = f"{'  ' if text else ''}{SHORT[key]} {self.shown[key]:.4g}"
                if room is not None and len(text) + len(part) > room:
                    break
                text += part
        return text

    def line(self, step: int) -> str:
        elapsed = self.clock() - self.eta.started
        head = (
            f"step {step}/{self.total} | {_duration(elapsed)} | "
            f"eta {_duration(self.eta.seconds_left())}"
        )
        stats = self.stats(LINE_WIDTH - len(head) - 3)
        return f"{head} | {stats}" if stats else head

    def print(self, renderable: Any) -> None:
        (self.bar.console if self.bar is not None else self.console).print(renderable)

    def close(self) -> None:
        """The last step's line (no terminal), with every row of that step seen: the final
        evaluation comes after the step's own row."""
        last = self.last_step
        self.last_step = None
        if last is not None and self.enabled and self.bar is None and last > self.printed:
            self.printed = last
            self.console.print(self.line(last), highlight=False, soft_wrap=True)
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


class Eta:
    """Seconds left in a run: the remaining steps at the pace of the recent ones (the
    last tenth of the run so far, at least 3 steps), growing as the later half of the
    steps grew (trajectories that lengthen make later steps slower, and the average since
    the start lags them; capped at twice the recent pace), plus the evaluations still to
    come at the last one's cost. A step's own time leaves out the evaluation logged in its
    row (`time/eval`)."""

    def __init__(self, total: int, eval_every: int, start_step: int, now: float):
        self.total, self.eval_every = total, eval_every
        self.started = now
        self.last_step, self.last_time = start_step, now
        self.step_seconds: list[float] = []
        self.eval_seconds: float | None = None

    def observe(self, step: int, now: float, eval_s: float | None = None) -> None:
        if eval_s is not None:
            self.eval_seconds = float(eval_s)
        if step > self.last_step:
            spent = now - self.last_time - (float(eval_s) if eval_s is not None else 0.0)
            per_step = max(spent, 0.0) / (step - self.last_step)
            self.step_seconds += [per_step] * (step - self.last_step)
        if step >= self.last_step:
            self.last_step, self.last_time = step, now

    def seconds_left(self) -> float:
        left = max(self.total - self.last_step, 0)
        if not self.step_seconds:
            return 0.0
        window = max(3, len(self.step_seconds) // 10)
        recent = self.step_seconds[-window:]
        pace = sum(recent) / len(recent)  # at the middle of the window
        slope = self.growth()
        # steps 1..left after the last one, paced on the trend (at most twice today's pace)
        middle = left * (left + 1) / 2 + left * (len(recent) - 1) / 2
        seconds = min(left * pace + slope * middle, 2 * left * pace)
        return seconds + self.evals_left() * (self.eval_seconds or 0.0)

    def growth(self) -> float:
        """Seconds a step grows by per step (least squares over the later half of the
        steps seen; never negative: steps that speed up are paced as they are now)."""
        ys = self.step_seconds[len(self.step_seconds) // 2 :]
        if len(ys) < 4:
            return 0.0
        mean_x, mean_y = (len(ys) - 1) / 2, sum(ys) / len(ys)
        cov = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(ys))
        var = sum((x - mean_x) ** 2 for x in range(len(ys)))
        return max(cov / var, 0.0)

    def evals_left(self) -> int:
        """Evaluations after the last step seen: every eval_every steps before the last
        one, and the final one (eval_every 0: none)."""
        if not self.eval_every or self.last_step >= self.total:
            return 0
        due = (self.total - 1) // self.eval_every - self.last_step // self.eval_every
        return due + 1


def samples_table(step: int, rows: list[dict[str, Any]], max_rows: int = 6) -> Table:
    table = Table(title=f"samples at step {step}", show_lines=True, expand=True)
    table.add_column("prompt (end)", ratio=2, overflow="fold")
    table.add_column("completion", ratio=3, overflow="fold")
    table.add_column("reward", justify="right", no_wrap=True)
    for row in rows[:max_rows]:
        prompt, completion = str(row.get("prompt", "")), str(row.get("completion", ""))
        prompt = prompt if len(prompt) <= 160 else "..." + prompt[-157:]
        completion = completion if len(completion) <= 400 else completion[:397] + "..."
        reward = row.get("reward")
        table.add_row(prompt, completion, "-" if reward is None else f"{float(reward):.3g}")
    return table


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
