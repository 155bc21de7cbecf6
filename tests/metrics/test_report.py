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
    listed = [line.split()[0] for line in text.splitlines()[2:] if not line.startswith("plots")]
    assert listed == [
        "eval/reward", "reward/mean", "multiturn/turns", "multiturn/tool_calls", "multiturn/env_s",
        "eval/multiturn/tool_calls", "multiturn/tool_calls/add", "multiturn/turn_0_length",
    ]  # fmt: skip
    pytest.importorskip("matplotlib", reason="the plots need matplotlib")
    assert (tmp_path / "report.png").stat().st_size > 1000 and "plots:" in text
