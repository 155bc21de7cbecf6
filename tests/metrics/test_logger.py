"""MetricsLogger: JSONL contents, resume truncation, console output, tracker forwarding."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console
from support.files import read_jsonl

from leangrpo.config import ConfigError
from leangrpo.metrics.logger import MetricsLogger, read_metrics


def quiet_console(terminal: bool = False) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=160), out


def test_jsonl_rows_are_flat_numbers(tmp_path: Path) -> None:
    console, _ = quiet_console()
    logger = MetricsLogger(tmp_path, ["jsonl"], False, 10, console=console)
    logger.log(
        1,
        {
            "loss": torch.tensor(0.25),
            "reward/mean": np.float32(0.5),
            "count": np.int64(3),
            "tokens": 7,
            "nan": float("nan"),
            "inf": torch.tensor(float("inf")),
            "reward": {"math": {"mean": 1.0}},
        },
    )
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # flushed before close
    assert list(json.loads(lines[0]))[0] == "step"
    logger.log(2, {"loss": 0.125})
    logger.close()
    rows = read_metrics(tmp_path)
    assert rows[0] == {
        "step": 1,
        "loss": 0.25,
        "reward/mean": 0.5,
        "count": 3,
        "tokens": 7,
        "nan": None,
        "inf": None,
        "reward/math/mean": 1.0,
    }
    assert rows[1] == {"step": 2, "loss": 0.125}


def test_bad_values_are_refused(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, ["jsonl"], False, 10, console=quiet_console()[0]) as logger:
        with pytest.raises(ValueError, match="'loss' is not a scalar"):
            logger.log(1, {"loss": torch.ones(3)})
        with pytest.raises(TypeError, match="'note' is a str"):
            logger.log(1, {"note": "hello"})


def test_read_metrics_skips_torn_lines_with_a_warning(tmp_path: Path, caplog) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}]
    path.write_text('{"step": 1\n{"step": 2}\n7\n\xff{"step": 3}\n{"step": 4}\n')
    with caplog.at_level("WARNING", logger="leangrpo.metrics"):
        assert [r["step"] for r in read_metrics(path)] == [2, 4]
    assert "skipped 3 line(s)" in caplog.text and "(line 1, 3, 4)" in caplog.text


def test_resume_drops_rows_after_checkpoint(tmp_path: Path) -> None:
    console, _ = quiet_console()
    with MetricsLogger(tmp_path, ["jsonl"], False, 10, console=console) as logger:
        for step in range(6):
            logger.log(step, {"loss": float(step)})
            logger.log_samples(step, [{"prompt": "p", "completion": "c", "reward": 1.0}])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # torn by a crash
    with MetricsLogger(tmp_path, ["jsonl"], False, 10, resume_step=3, console=console) as logger:
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
        logger.log(4, {"loss": 40.0})
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[-1]["loss"] == 40.0
    samples = read_jsonl(tmp_path / "samples.jsonl")
    assert [s["step"] for s in samples] == [0, 1, 2, 3]


def test_resume_drops_the_rows_logged_after_the_checkpoint_under_its_step(tmp_path: Path) -> None:
    """Skipped batches after the step-3 checkpoint are logged under step 3 and done again
    by the resumed run: only the rows the checkpoint counted (rows_logged_at) are kept."""
    console, _ = quiet_console()
    with MetricsLogger(tmp_path, ["jsonl"], False, 10, console=console) as logger:
        for step in range(4):
            logger.log(step, {"loss": float(step)})
        logger.log(3, {"eval/reward": 0.5})
        saved = logger.rows_logged_at(3)  # what the checkpoint at step 3 stores
        assert (saved, logger.rows_logged_at(2)) == (2, 0)
        logger.log(3, {"pipeline/skipped_batches": 1.0})  # after the checkpoint
        logger.log(3, {"pipeline/skipped_batches": 2.0})
        logger.log(4, {"loss": 4.0})
    with MetricsLogger(
        tmp_path, ["jsonl"], False, 10, resume_step=3, resume_rows=saved, console=console
    ) as logger:
        assert logger.rows_logged_at(3) == 2
        logger.log(3, {"pipeline/skipped_batches": 1.0})  # the resumed run skips it again
        assert logger.rows_logged_at(3) == 3
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 3, 3]
    assert [r.get("pipeline/skipped_batches") for r in rows[3:]] == [None, None, 1.0]
    with MetricsLogger(tmp_path, ["jsonl"], False, 10, resume_step=3, console=console):
        pass  # an older checkpoint (no count) keeps every row of its step
    assert len(read_metrics(tmp_path)) == 6


def test_non_terminal_prints_a_compact_line_every_tenth(tmp_path: Path) -> None:
    console, out = quiet_console(terminal=False)
    with MetricsLogger(tmp_path, ["jsonl"], True, 20, console=console) as logger:
        logger.log(0, {"eval/reward": 0.125})
        for step in range(1, 21):
            logger.log(step, {"loss": 0.5, "reward/mean": step / 100, "other/x": 1.0})
    lines = out.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[-1].startswith("step 20/20 | ")
    assert lines[-1].endswith("| eval 0.125  reward 0.2  loss 0.5")
    assert "other/x" not in out.getvalue() and "eta" in lines[0]


def test_the_last_line_shows_the_final_evaluation(tmp_path: Path) -> None:
    """The final evaluation is logged after the last step's own row: the last compact line
    showed the evaluation before it (0.709 at step 15 for a run whose last was 1.069)."""
    console, out = quiet_console(terminal=False)
    with MetricsLogger(tmp_path, ["jsonl"], True, 15, console=console) as logger:
        logger.log(0, {"eval/reward": 0.25})
        for step in range(1, 16):
            logger.log(step, {"loss": 0.5, **({"eval/reward": 0.709} if step == 10 else {})})
        logger.log(15, {"eval/reward": 1.069})  # Trainer.finish
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("step 15/15 | ") and "eval 1.069" in lines[-1]
    assert sum(line.startswith("step 15/15") for line in lines) == 1


def test_a_resume_says_how_many_rows_past_its_checkpoint_it_dropped(tmp_path: Path, caplog) -> None:
    console, _ = quiet_console()
    with MetricsLogger(tmp_path, ["jsonl"], False, 10, console=console) as logger:
        for step in range(6):
            logger.log(step, {"loss": float(step)})
        logger.log(5, {"eval/reward": 1.0})
    with caplog.at_level(logging.INFO, logger="leangrpo"):
        MetricsLogger(tmp_path, ["jsonl"], False, 10, resume_step=3, console=console).close()
    (line,) = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert line.startswith("resuming at step 3: dropped 3 metrics row(s) logged after that")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="leangrpo"):
        MetricsLogger(tmp_path, ["jsonl"], False, 10, resume_step=3, console=console).close()
    assert "dropped" not in caplog.text  # nothing past the checkpoint: nothing said


def test_progress_bar_off_prints_nothing(tmp_path: Path) -> None:
    console, out = quiet_console(terminal=False)
    with MetricsLogger(tmp_path, ["jsonl"], False, 4, console=console) as logger:
        for step in range(1, 5):
            logger.log(step, {"loss": 1.0})
    assert out.getvalue() == ""


def test_terminal_bar_and_samples_table(tmp_path: Path) -> None:
    console, out = quiet_console(terminal=True)
    with MetricsLogger(tmp_path, ["jsonl"], True, 5, console=console) as logger:
        logger.log(1, {"reward/mean": 0.75, "loss": 0.5})
        logger.log_samples(
            1, [{"prompt": "x" * 500 + "What is 2+2?", "completion": "4", "reward": 1.0}]
        )
    text = out.getvalue()
    assert "reward 0.75" in text and "samples at step 1" in text and "What is 2+2?" in text
    (sample,) = read_jsonl(tmp_path / "samples.jsonl")
    assert sample["completion"] == "4" and sample["reward"] == 1.0 and sample["step"] == 1


def test_unknown_and_missing_backends(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown backend 'mlflow'"):
        MetricsLogger(tmp_path, ["jsonl", "mlflow"], False, 1)
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(ConfigError, match=r"leangrpo\[wandb\]"):
        MetricsLogger(tmp_path / "w", ["jsonl", "wandb"], False, 1)
    assert not (tmp_path / "w").exists()  # refused before creating anything


def test_tracker_receives_metrics(tmp_path: Path, monkeypatch) -> None:
    calls: list[tuple] = []
    fake = types.ModuleType("trackio")
    fake.init = lambda project, name=None, config=None: calls.append(
        ("init", project, name, config)
    )
    fake.log = lambda metrics, step=None: calls.append(("log", metrics, step))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(__import__("sys").modules, "trackio", fake)
    with MetricsLogger(
        tmp_path,
        ["jsonl", "trackio"],
        False,
        3,
        run_name="r1",
        config_dict={"a": 1},
        console=quiet_console()[0],
    ) as logger:
        logger.log(1, {"loss": 0.5, "bad": math.nan})
    assert calls == [("init", "leangrpo", "r1", {"a": 1}), ("log", {"loss": 0.5}, 1), ("finish",)]


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs tensorboard")
def test_tensorboard_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(
        tmp_path, ["jsonl", "tensorboard"], False, 3, console=quiet_console()[0]
    ) as logger:
        logger.log(1, {"loss": 0.5})
        logger.log(2, {"loss": 0.25})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 0.25)]


def test_a_narrow_console_drops_metrics_before_the_step_and_eta(tmp_path: Path) -> None:
    """At 80 columns the bar keeps the step count, the elapsed time and the ETA whole;
    metrics go first (whole ones, never a cut number)."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80, color_system=None)
    with MetricsLogger(tmp_path, ["jsonl"], True, 40, console=console) as logger:
        logger.log(0, {"eval/reward": 0.03125})
        logger.log(4, {"reward/mean": 0.25, "loss": -4.843e-08})
    last = out.getvalue().replace("\r", "\n").splitlines()[-2]
    assert "4/40" in last and "eta " in last and "…" not in last, last
    assert "eval 0.03125" in last and "loss" not in last  # the room holds one metric
    assert len(last.replace("\x1b[2K", "")) <= 80


def test_the_compact_line_keeps_to_80_characters(tmp_path: Path) -> None:
    from leangrpo.metrics.logger import ProgressDisplay

    console, _ = quiet_console()
    display = ProgressDisplay(console, 1000, True, clock=lambda: 0.0)
    display.update(500, {"eval/reward": 0.123456, "reward/mean": -1234.5678, "loss": 1e-300})
    line = display.line(500)
    assert line.startswith("step 500/1000 | ") and "eta " in line and len(line) <= 80


def test_a_notebook_gets_plain_lines_not_a_bar(tmp_path: Path) -> None:
    """A Jupyter console (leangrpo.GRPO in a notebook; rich detects it) gets the compact
    line every tenth of the run, never a live bar."""
    console = Console(force_jupyter=True, width=100)
    printed = []
    console.print = lambda text, **kwargs: printed.append(str(text))  # Jupyter displays it
    with MetricsLogger(tmp_path, ["jsonl"], True, 20, console=console) as logger:
        assert logger._progress.bar is None
        for step in range(1, 21):
            logger.log(step, {"reward/mean": step / 20, "loss": 0.5})
    assert [line.split(" | ")[0] for line in printed] == [f"step {n}/20" for n in range(2, 21, 2)]


def test_eta_counts_the_evaluations_to_come_and_paces_on_recent_steps() -> None:
    """Steps that slow down (trajectories grow) and an evaluation every 5 steps: the ETA
    follows the recent steps and adds the evaluations left, within 15% of the truth."""
    from leangrpo.metrics.logger import Eta

    total, every, eval_s = 40, 5, 4.0
    step_s = [1.0 + 0.05 * step for step in range(total + 1)]  # 1 s growing to 3 s
    eta, now = Eta(total, every, 0, 0.0), eval_s
    eta.observe(0, now, eval_s)  # the step-0 evaluation
    for step in range(1, 21):
        evaluated = step % every == 0
        now += step_s[step] + (eval_s if evaluated else 0.0)
        eta.observe(step, now, eval_s if evaluated else None)
    truth = sum(step_s[21 : total + 1]) + eval_s * 4  # evals at 25, 30, 35 and the final one
    assert eta.evals_left() == 4
    assert abs(eta.seconds_left() - truth) < 0.15 * truth, (eta.seconds_left(), truth)
    naive = (now - 0.0) / 20 * 20  # the average since the start, evaluations ignored
    assert abs(naive - truth) > 0.15 * truth  # what the old ETA said
