"""The dashboard of `leangrpo report`: `report.png` (a grid of titled plots against the
step) and `report.html` (the picture, the first / last / min / max table and the
constants) beside the run's metrics.jsonl.

Choices: three panels a row, key curves first (report.PANELS); series that belong
together share a panel (the eval reward and each function's, the phase times) with a
legend; a metric that never changed is listed under the grid, not drawn as a flat line; a
metric with one point is drawn as a marker with its value written beside it. matplotlib
is optional: without it nothing is written and the text report says so.
"""

from __future__ import annotations

import html
from pathlib import Path

COLUMNS = 3
PANEL_INCHES = (5.0, 3.1)


def write_dashboard(board, rows: list[dict], run_dir: Path, table: list[str]) -> tuple[Path, Path] | None:
    """Write report.png and report.html into `run_dir`; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    png, page = run_dir / "report.png", run_dir / "report.html"
    figure = draw(plt, board, rows, run_dir)
    figure.savefig(png, dpi=100)
    plt.close(figure)
    page.write_text(html_page(run_dir, png.name, table), encoding="utf-8")
    return png, page


def draw(plt, board, rows: list[dict], run_dir: Path):
    count = max(len(board.panels), 1)
    lines = (count + COLUMNS - 1) // COLUMNS
    footer = constants_text(board.constants)
    footer_inches = 0.25 * len(footer) + (0.3 if footer else 0.0)
    width, height = PANEL_INCHES[0] * COLUMNS, PANEL_INCHES[1] * lines + 0.8 + footer_inches
    fig, axes = plt.subplots(lines, COLUMNS, figsize=(width, height), squeeze=False)
    last = rows[-1]["step"] if rows else 0
    fig.suptitle(f"leangrpo run {run_dir}  (steps 0-{last})", fontsize=14, fontweight="bold")
    for ax, (panel, drawn) in zip(axes.flat, board.panels):
        draw_panel(ax, panel, drawn)
    for ax in list(axes.flat)[len(board.panels) :]:
        ax.set_visible(False)
    if not board.panels:
        axes[0, 0].set_visible(True)
        axes[0, 0].text(0.5, 0.5, "nothing logged yet", ha="center", va="center")
        axes[0, 0].set_axis_off()
    if footer:
        fig.text(0.01, 0.01, "\n".join(footer), fontsize=9, va="bottom", family="monospace")
    top = 1 - 0.8 / height
    bottom = (footer_inches + 0.1) / height
    fig.tight_layout(rect=(0, bottom, 1, top), h_pad=1.2, w_pad=1.0)
    return fig


def draw_panel(ax, panel, drawn: dict) -> None:
    for key, points in drawn.items():
        steps, values = zip(*points)
        label = key if len(drawn) > 1 else None
        if len(points) == 1:
            ax.plot(steps, values, "o", markersize=7, label=label)
            ax.annotate(f"{values[0]:.4g}", (steps[0], values[0]), textcoords="offset points",
                        xytext=(6, 4), fontsize=9)  # fmt: skip
        else:
            ax.plot(steps, values, marker="." if len(points) <= 60 else None, linewidth=1.6,
                    markersize=5, label=label)  # fmt: skip
    ax.set_title(panel.title, fontsize=11, fontweight="bold")
    ax.set_xlabel("step", fontsize=9)
    if panel.unit:
        ax.set_ylabel(panel.unit, fontsize=9)
    elif len(drawn) == 1:
        ax.set_ylabel(next(iter(drawn)), fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if len(drawn) > 1:
        ax.legend(fontsize=7, loc="best", framealpha=0.7)


def constants_text(constants: dict[str, float], width: int = 150) -> list[str]:
    """The metrics that never changed, a few to a line (listed, not drawn)."""
    if not constants:
        return []
    lines, line = [], "constant all run:"
    for key, value in constants.items():
        part = f"  {key} = {value:.4g}"
        if len(line) + len(part) > width:
            lines.append(line)
            line = " " * len("constant all run:")
        line += part
    return [*lines, line]


def html_page(run_dir: Path, png: str, table: list[str]) -> str:
    text = html.escape("\n".join(table))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>leangrpo run {html.escape(str(run_dir))}</title>
<style>body{{font-family:sans-serif;margin:1.5em}} pre{{background:#f6f6f6;padding:1em}}
img{{max-width:100%}}</style></head>
<body><h1>leangrpo run {html.escape(str(run_dir))}</h1>
<img src="{html.escape(png)}" alt="the run's curves by step">
<h2>first, last, min and max of each metric</h2>
<pre>{text}</pre>
<p>From metrics.jsonl in this directory; made by <code>leangrpo report {html.escape(str(run_dir))}</code>.</p>
</body></html>
"""
