"""`leangrpo report RUN_DIR`: what a run did, from its metrics.jsonl.

Prints first / last / best of the headline metrics (and, for a multi-turn run, its turns,
tool calls per trajectory and per tool, tool and environment errors, environment time and
per-turn lengths) and, when matplotlib is installed, writes `report.png` with their
curves next to the metrics file.
"""

from __future__ import annotations

import math
from pathlib import Path

from leangrpo.metrics.logger import read_metrics

HEADLINE = [
    "eval/reward",
    "reward/mean",
    "loss",
    "grad_norm",
    "completions/mean_length",
    "staleness/mean",
    "time/generate",
    "time/train",
    "throughput/train_tokens_per_s",
]
# multi-turn runs (environments/metrics.py): these, then each tool's calls and errors and
# each turn's length, in the order the run logged them
MULTITURN = [
    "multiturn/turns",
    "multiturn/tool_calls",
    "multiturn/tool_errors",
    "multiturn/env_errors",
    "multiturn/env_s",
    "multiturn/model_tokens",
    "multiturn/env_tokens",
    "multiturn/finish/max_turns",
    "eval/multiturn/tool_calls",
]
PER_NAME = ("multiturn/tool_calls/", "multiturn/tool_errors/", "multiturn/turn_")


def headline_keys(rows: list[dict]) -> list[str]:
    """What the report lists and plots: the headline keys, then the multi-turn ones, each
    only where the run logged it."""
    logged = dict.fromkeys(k for r in rows for k in r)
    per_name = [k for k in logged if k.startswith(PER_NAME)]
    return [k for k in [*HEADLINE, *MULTITURN, *per_name] if k in logged and series(rows, k)]


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


def run_summary(run_dir: str | Path, seconds: float) -> str:
    """The few lines a finished `leangrpo train` prints: steps and time, first -> last of
    the eval and training reward, and where the run's files are."""
    run_dir = Path(run_dir)
    rows = read_rows(run_dir)
    last = rows[-1]["step"] if rows else 0
    lines = [f"leangrpo: finished at step {last} in {_duration(seconds)}"]
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


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def report(run_dir: str | Path) -> str:
    rows = read_rows(run_dir)
    lines = [
        f"run {run_dir}: {len(rows)} records, last step {rows[-1]['step'] if rows else 0}",
        f"{'metric':<32}{'first':>12}{'last':>12}{'min':>12}{'max':>12}",
    ]
    for key in headline_keys(rows):
        values = [v for _, v in series(rows, key)]
        if values:
            lines.append(
                f"{key:<32}{values[0]:>12.4g}{values[-1]:>12.4g}"
                f"{min(values):>12.4g}{max(values):>12.4g}"
            )
    png = _plot(rows, Path(run_dir) / "report.png")
    if png:
        lines.append(f"plots: {png}")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = headline_keys(rows)
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        steps, values = zip(*series(rows, key))
        ax.plot(steps, values, marker="." if len(steps) < 50 else None)
        ax.set_ylabel(key, fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
