"""`leangrpo report`: a run directory summarised from its metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from leangrpo.metrics.report import report


def test_report_lists_first_last_and_range(tmp_path):
    rows = [
        {"step": 0, "eval/reward": 0.5},
        {"step": 1, "reward/mean": 0.25, "loss": 0.1},
        {"step": 2, "reward/mean": 0.75, "loss": None, "eval/reward": 0.9},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    text = report(tmp_path)
    line = next(x for x in text.splitlines() if x.startswith("eval/reward"))
    assert line.split()[1:] == ["0.5", "0.9", "0.5", "0.9"]
    assert "reward/mean" in text and "last step 2" in text


def test_report_names_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="run directory"):
        report(tmp_path)


def test_report_skips_a_torn_line_with_a_warning(tmp_path, caplog):
    rows = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
    text = json.dumps(rows[0]) + "\n" + '{"step": 2, "lo' + "\n" + json.dumps(rows[1]) + "\n"
    (tmp_path / "metrics.jsonl").write_text(text)
    with caplog.at_level("WARNING"):
        summary = report(tmp_path)
    assert "2 records, last step 2" in summary
    assert "metrics.jsonl: skipped 1 line(s)" in caplog.text and "(line 2)" in caplog.text


def test_report_lists_and_plots_a_multiturn_runs_figures(tmp_path):
    rows = [
        {"step": 0, "eval/reward": 0.1, "eval/multiturn/tool_calls": 0.0},
        {"step": 1, "reward/mean": 0.2, "multiturn/turns": 1.2, "multiturn/tool_calls": 0.2,
         "multiturn/tool_calls/add": 0.2, "multiturn/turn_0_length": 30.0, "multiturn/env_s": 0.01},
        {"step": 2, "reward/mean": 0.9, "multiturn/turns": 2.0, "multiturn/tool_calls": 1.0,
         "multiturn/tool_calls/add": 1.0, "multiturn/turn_0_length": 53.0, "multiturn/env_s": 0.02,
         "eval/multiturn/tool_calls": 1.0},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    text = report(tmp_path)
    listed = [line.split()[0] for line in text.splitlines()[2:-1]]
    assert listed == [
        "eval/reward", "reward/mean", "multiturn/tool_calls", "eval/multiturn/tool_calls",
        "multiturn/turns", "multiturn/turn_0_length", "multiturn/env_s",
    ]  # fmt: skip
    assert "multiturn/tool_calls (= multiturn/tool_calls/add)" in text  # the same curve
    pytest.importorskip("matplotlib", reason="the plots need matplotlib")
    assert (tmp_path / "report.png").stat().st_size > 1000 and "dashboard:" in text


def dashboard_rows() -> list[dict]:
    """24 metrics over 40 steps: growing, constant, one-point and sparse ones."""
    rows = [{"step": 0, "eval/reward": 0.0, "eval/reward/math": 0.0, "data/prompts": 100.0}]
    for step in range(1, 41):
        row = {
            "step": step, "reward/mean": step / 40, "reward/math/mean": step / 40,
            "reward/format/mean": 0.5, "loss": 0.01 * (-1) ** step, "loss/entropy": 1 / step,
            "grad_norm": 1.0 + step % 3, "throughput/train_tokens_per_s": 1000.0 + step,
            "memory/peak_gib": 0.5 + step / 400, "lr": 3e-4, "staleness/mean": 0.0,
            "completions/mean_length": 10.0 + step, "time/generate": 1.0, "time/train": 0.5,
            "frac_reward_zero_std": 0.1, "loss/clip/low_frac": 0.0,
        }  # fmt: skip
        if step % 10 == 0:
            row["eval/reward"] = row["eval/reward/math"] = step / 40
        if step == 24:
            row["multiturn/tool_calls/<unknown>"] = 0.0078
        rows.append(row)
    return rows


def test_the_dashboard_puts_key_curves_first_lists_constants_and_shows_single_points(tmp_path):
    from leangrpo.metrics.report import dashboard

    board = dashboard(dashboard_rows())
    titles = [panel.title for panel, _ in board.panels]
    assert titles[:6] == [
        "held-out reward (eval)", "training reward", "entropy",
        "gradient norm (before clipping)", "training tokens / s", "peak memory",
    ]  # fmt: skip
    drawn = board.drawn_keys()
    assert "eval/reward (= eval/reward/math)" in drawn  # one function: one curve, named twice
    assert "reward/format/mean" not in drawn and "lr" not in drawn  # constants: listed
    assert board.constants == {
        "reward/format/mean": 0.5, "time/generate": 1.0, "time/train": 0.5,
        "frac_reward_zero_std": 0.1, "staleness/mean": 0.0, "loss/clip/low_frac": 0.0,
        "lr": 3e-4,
    }  # fmt: skip
    assert "multiturn/tool_calls/<unknown>" in drawn  # a single point is drawn, as a marker
    assert "data/prompts" not in drawn


def test_the_dashboard_is_a_grid_with_a_page_beside_it(tmp_path):
    pytest.importorskip("matplotlib", reason="the plots need matplotlib")
    from PIL import Image

    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in dashboard_rows()))
    text = report(tmp_path)
    assert text.splitlines()[-1] == (
        f"dashboard: {tmp_path / 'report.png'} (and {tmp_path / 'report.html'})"
    )
    assert "constant: reward/format/mean 0.5" in text
    width, height = Image.open(tmp_path / "report.png").size
    assert width == 1500 and height < 1.2 * width  # 3 panels a row, not one tall column
    page = (tmp_path / "report.html").read_text()
    assert '<img src="report.png"' in page and "eval/reward" in page


def test_report_help_says_where_the_files_go():
    from support.processes import run_cli

    out = run_cli("report", "--help")
    assert out.returncode == 0 and "RUN_DIR/report.png" in out.stdout
    assert "RUN_DIR/report.html" in out.stdout


def test_what_report_writes_is_run_output(tmp_path):
    """report.png and report.html count as the run's files (run.overwrite deletes them;
    a directory holding them holds a run), and the summary lists them."""
    pytest.importorskip("matplotlib", reason="the plots need matplotlib")
    from leangrpo.checkpoint.rundir import RUN_FILES
    from leangrpo.metrics.report import RUN_FILES as LISTED

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    report(tmp_path)
    written = {p.name for p in tmp_path.iterdir()} - {"metrics.jsonl"}
    assert written == {"report.png", "report.html"}
    assert written <= set(RUN_FILES)
    assert {name.rstrip("/") for name in LISTED} <= set(RUN_FILES) | {"tensorboard"}


def test_the_readme_lists_every_file_a_run_directory_holds():
    from support.configs import ROOT

    from leangrpo.checkpoint.rundir import LOCK_FILE, RUN_FILES

    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("A run directory (`runs/demo/`) holds:") :]
    table = table[: table.index("\n\n", table.index("| file |"))]
    named = {cell.strip("`/") for row in table.splitlines()[2:] for cell in
             row.split("|")[1].replace(",", " ").split()}  # fmt: skip
    missing = {name for name in (*RUN_FILES, LOCK_FILE)} - {n.split("/")[0] for n in named}
    assert not missing, f"README's run-directory table does not name {sorted(missing)}"
