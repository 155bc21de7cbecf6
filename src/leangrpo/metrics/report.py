"""`leangrpo report RUN_DIR`: what a run did, from its metrics.jsonl.

Prints first / last / min / max of the metrics worth reading, in the dashboard's order
(PANELS: the held-out eval reward, the training reward and each reward function, KL,
entropy, gradient norm, tokens/s, memory, then loss, lengths, multi-turn figures, phase
times and the pipeline's health), lists the metrics that never changed instead of
plotting them, and, when matplotlib is installed, writes the dashboard (dashboard.py)
beside the metrics file: `report.png` and `report.html`. `run_summary` is the few lines a
finished `leangrpo train` prints.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from leangrpo.metrics.logger import read_metrics


@dataclass(frozen=True)
class Panel:
    """One plot of the dashboard: a title and the series drawn in it (exact keys, or
    patterns such as `reward/<name>/mean`: one series per name the run logged)."""

    title: str
    keys: tuple[str, ...]
    unit: str = ""


PANELS = (
    Panel("held-out reward (eval)", ("eval/reward", r"eval/reward/(?!.*/)[^/]+")),
    Panel("training reward", ("reward/mean", r"reward/(?!env/)[^/]+/mean", r"reward/env/[^/]+/mean")),
    Panel("KL to the reference", ("loss/kl",)),
    Panel("entropy", ("loss/entropy",), "nats / token"),
    Panel("gradient norm (before clipping)", ("grad_norm",)),
    Panel("training tokens / s", ("throughput/train_tokens_per_s",)),
    Panel("peak memory", ("memory/peak_gib",), "GiB"),
    Panel("loss", ("loss",)),
    Panel("completion length", ("completions/mean_length", "eval/completion_length"), "tokens"),
    Panel("tool calls / trajectory", ("multiturn/tool_calls", "eval/multiturn/tool_calls", r"multiturn/tool_calls/.+")),
    Panel("model turns / trajectory", ("multiturn/turns", "eval/multiturn/turns")),
    Panel("tool and environment errors", ("multiturn/tool_errors", r"multiturn/tool_errors/.+", "multiturn/env_errors", "multiturn/parse_errors")),
    Panel("model tokens per turn", (r"multiturn/turn_\d+_length",), "tokens"),
    Panel("seconds per step", ("time/generate", "time/rewards", "time/score", "time/train", "time/weight_sync", "time/eval", "multiturn/env_s"), "s"),
    Panel("groups without signal", ("frac_reward_zero_std",)),
    Panel("staleness", ("staleness/mean", "staleness/max"), "versions"),
    Panel("importance sampling", ("is/mismatch_kl", "is/masked_frac", "is/truncated_frac")),
    Panel("clipped tokens", ("loss/clip/low_frac", "loss/clip/high_frac", "loss/clip/region_frac")),
    Panel("learning rate", ("lr",)),
)  # fmt: skip


def read_rows(run_dir: str | Path) -> list[dict]:
    """The run's metrics rows; torn lines are skipped with a warning (metrics.read_metrics)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a leangrpo run directory?")
    return read_metrics(path)


def series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [
        (r["step"], r[key])
        for r in rows
        if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])
    ]


def panel_keys(panel: Panel, logged: list[str]) -> list[str]:
    """The run's keys a panel shows (each pattern matched whole), in the panel's order."""
    out: list[str] = []
    for pattern in panel.keys:
        out += [k for k in logged if re.fullmatch(pattern, k) and k not in out]
    return out


@dataclass
class Dashboard:
    """What the report shows: panels with their varying series, and the constants."""

    panels: list[tuple[Panel, dict[str, list[tuple[int, float]]]]]
    constants: dict[str, float]

    def drawn_keys(self) -> list[str]:
        return [k for _, drawn in self.panels for k in drawn]


def dashboard(rows: list[dict]) -> Dashboard:
    logged = list(dict.fromkeys(k for r in rows for k in r if k != "step"))
    panels, constants, seen = [], {}, set()
    for panel in PANELS:
        drawn = {}
        for key in panel_keys(panel, logged):
            if key in seen:
                continue
            seen.add(key)
            points = series(rows, key)
            same = next((k for k, other in drawn.items() if other == points), None)
            if len(points) > 1 and len({v for _, v in points}) == 1:
                constants[key] = points[0][1]
            elif same is not None:  # one reward function: its curve is the total's
                drawn = {(f"{k} (= {key})" if k == same else k): v for k, v in drawn.items()}
            elif points:
                drawn[key] = points
        if drawn:
            panels.append((panel, drawn))
    return Dashboard(panels, constants)


def report(run_dir: str | Path) -> str:
    rows = read_rows(run_dir)
    board = dashboard(rows)
    width = max([32, *(len(k) + 2 for k in board.drawn_keys())])
    lines = [
        f"run {run_dir}: {len(rows)} records, last step {rows[-1]['step'] if rows else 0}",
        f"{'metric':<{width}}{'first':>12}{'last':>12}{'min':>12}{'max':>12}",
    ]
    for _, drawn in board.panels:
        for key, points in drawn.items():
            values = [v for _, v in points]
            lines.append(
                f"{key:<{width}}{values[0]:>12.4g}{values[-1]:>12.4g}"
                f"{min(values):>12.4g}{max(values):>12.4g}"
            )
    if board.constants:
        lines.append("constant: " + ", ".join(f"{k} {v:.4g}" for k, v in board.constants.items()))
    from leangrpo.metrics.dashboard import write_dashboard

    written = write_dashboard(board, rows, Path(run_dir), lines)
    if written:
        lines.append(f"dashboard: {written[0]} (and {written[1]})")
    else:
        lines.append("no plots: matplotlib is not installed (pip install matplotlib)")
    return "\n".join(lines)


def run_summary(run_dir: str | Path, seconds: float) -> str:
    """The few lines a finished `leangrpo train` prints: steps and time, first -> last of
    the eval and training reward, and where the run's files are."""
    run_dir = Path(run_dir)
    rows = read_rows(run_dir)
    last = rows[-1]["step"] if rows else 0
    lines = [f"leangrpo: finished at step {last} in {duration(seconds)}"]
    for key in ("eval/reward", "reward/mean"):
        points = series(rows, key)
        if points:
            (s0, v0), (s1, v1) = points[0], points[-1]
            lines.append(f"  {key:<12} {v0:.3f} (step {s0}) -> {v1:.3f} (step {s1})")
    if not series(rows, "eval/reward"):
        lines.append("  no evaluation (no eval set: data.eval_path, data.eval_size)")
    files = [name for name in RUN_FILES if (run_dir / name.rstrip("/")).exists()]
    lines.append(f"  files in {run_dir}/: {', '.join(files)}")
    lines.append(f"  plots and a summary: leangrpo report {run_dir}")
    return "\n".join(lines)


# what a run directory holds, in the order the summary lists them (README "Run directories")
RUN_FILES = (
    "metrics.jsonl",
    "samples.jsonl",
    "config.yaml",
    "checkpoints/",
    "final/",
    "tensorboard/",
    "report.png",
    "report.html",
)


def duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"
