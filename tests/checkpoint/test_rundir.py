"""rundir.py: the run directory's lock, clean starts, finished runs and resume config checks.

Checkpoints are faked (a step-N directory with COMPLETE and config.yaml): these rules run
before any model loads, so they need none.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from leangrpo.checkpoint.rundir import RunDirError, config_changes, open_run_dir, schedule_horizon
from leangrpo.config import config_from_dict


def make_cfg(out: Path, **run):
    return config_from_dict(
        {
            "run": {"output_dir": str(out), "max_steps": 10, **run},
            "model": {"name_or_path": "tiny"},
            "data": {"path": "p.jsonl"},
            "rewards": {"functions": ["math"]},
        }
    )


def fake_checkpoint(out: Path, step: int, cfg) -> Path:
    path = out / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(cfg.to_yaml())
    (path / "COMPLETE").write_text(f'{{"step": {step}}}\n')
    return path


def refused(cfg) -> str:
    with pytest.raises(RunDirError) as info:
        open_run_dir(cfg)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_fresh_directory_is_created_locked_and_released(tmp_path: Path) -> None:
    run_dir = open_run_dir(make_cfg(tmp_path / "a" / "b"))
    assert run_dir.path.is_dir() and run_dir.resume_from is None and not run_dir.finished
    assert (run_dir.path / ".lock").read_text().strip() == str(os.getpid())
    assert "this process" in refused(make_cfg(tmp_path / "a" / "b"))
    run_dir.release()
    open_run_dir(make_cfg(tmp_path / "a" / "b")).release()  # free again


def test_lock_names_the_holder_and_dies_with_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from leangrpo.checkpoint.rundir import RunLock;"
            f"Path({str(out)!r}).mkdir(); RunLock(Path({str(out)!r})); print('locked', flush=True);"
            "time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        message = refused(make_cfg(out))
        assert f"in use by another leangrpo run (pid {holder.pid})" in message
        assert repr(str(out)) in message
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: no clean-up runs
        holder.wait()
    deadline = time.time() + 10
    while True:  # the OS releases the lock with the process: no stale lock
        try:
            open_run_dir(make_cfg(out)).release()
            break
        except RunDirError:
            assert time.time() < deadline, "the lock outlived its holder"
            time.sleep(0.1)


def test_output_dir_that_is_a_file_or_under_one(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert "is a file, not a directory" in refused(make_cfg(tmp_path / "f"))
    assert f"because {str(tmp_path / 'f')!r} is a file" in refused(make_cfg(tmp_path / "f" / "x"))


def test_earlier_run_without_checkpoint_is_refused_then_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("old")  # written by a run that failed its checks: fine
    (out / ".lock").write_text("")
    open_run_dir(make_cfg(out)).release()
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')  # crashed before step 2
    (out / "notes.txt").write_text("mine")
    message = refused(make_cfg(out))
    assert "already holds an earlier run (metrics.jsonl, notes.txt)" in message
    assert "no complete checkpoint" in message and "run.overwrite: true" in message
    open_run_dir(make_cfg(out, overwrite=True)).release()
    assert not (out / "metrics.jsonl").exists() and not (out / "config.yaml").exists()
    assert (out / "notes.txt").read_text() == "mine"  # not leangrpo's: never deleted


def test_resume_never_with_checkpoints_is_refused_unless_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = make_cfg(out, resume="never")
    fake_checkpoint(out, 4, cfg)
    (out / "final").mkdir()
    (out / "final" / "model.safetensors").write_text("w")
    message = refused(cfg)
    assert "(checkpoints/, final/)" in message and "run.resume is 'never'" in message
    run_dir = open_run_dir(make_cfg(out, resume="never", overwrite=True))
    assert run_dir.resume_from is None
    assert not (out / "checkpoints").exists() and not (out / "final").exists()
    run_dir.release()


def test_auto_resumes_the_newest_checkpoint_and_notes_harmless_changes(
    tmp_path: Path, caplog
) -> None:
    out = tmp_path / "run"
    cfg = make_cfg(out)
    fake_checkpoint(out, 2, cfg)
    newest = fake_checkpoint(out, 4, cfg)
    (out / "metrics.jsonl").write_text('{"step": 5}\n')  # rows past it are dropped on resume
    changed = make_cfg(out, max_steps=20)
    changed.eval.every_steps = 5
    changed.logging.progress_bar = False
    with caplog.at_level(logging.INFO, logger="leangrpo"):
        run_dir = open_run_dir(changed)
    assert run_dir.resume_from == newest and run_dir.resume_step == 4
    assert run_dir.config_notes == [
        "run.max_steps 10 -> 20",
        "eval.every_steps 0 -> 5",
        "logging.progress_bar True -> False",
    ]
    assert "do not affect training" in caplog.text
    run_dir.release()


def test_resume_with_changed_training_settings_is_refused_or_allowed(
    tmp_path: Path, caplog
) -> None:
    out = tmp_path / "run"
    fake_checkpoint(out, 4, make_cfg(out))
    changed = make_cfg(out)
    changed.train.learning_rate = 1e-3
    changed.rollout.prompts_per_batch = 4
    changed.run.seed = 7
    message = refused(changed)
    assert "train.learning_rate 1e-05 -> 0.001" in message
    assert "rollout.prompts_per_batch 8 -> 4" in message and "run.seed 0 -> 7" in message
    assert "run.allow_config_changes: true" in message
    changed.run.allow_config_changes = True
    with caplog.at_level(logging.WARNING, logger="leangrpo"):
        run_dir = open_run_dir(changed)
    assert run_dir.resume_step == 4
    assert "no longer an exact continuation" in caplog.text and "learning_rate" in caplog.text
    run_dir.release()


def test_finished_run_is_reported_not_rerun(tmp_path: Path) -> None:
    out = tmp_path / "run"
    last = fake_checkpoint(out, 10, make_cfg(out))
    run_dir = open_run_dir(make_cfg(out))  # crashed before final/ was written: finish it
    assert not run_dir.finished and run_dir.resume_from == last
    run_dir.release()
    (out / "final").mkdir()
    run_dir = open_run_dir(make_cfg(out))
    assert run_dir.finished.startswith(f"Run {str(out)!r} is already finished")
    assert "step 10 and run.max_steps is 10" in run_dir.finished
    run_dir.release()
    run_dir = open_run_dir(make_cfg(out, max_steps=12))
    assert not run_dir.finished and run_dir.resume_step == 10
    run_dir.release()


def test_explicit_resume_path_is_checked_first(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = make_cfg(out)
    ckpt = fake_checkpoint(out, 3, cfg)
    typo = refused(make_cfg(out, resume=str(out / "checkpoints" / "step-30")))
    assert "run.resume" in typo and "does not exist" in typo
    hint = refused(make_cfg(out, resume=str(out)))
    assert f"did you mean {str(ckpt)!r}" in hint
    (ckpt / "COMPLETE").unlink()
    assert "no COMPLETE marker" in refused(make_cfg(out, resume=str(ckpt)))


def test_explicit_resume_from_another_directory_needs_a_clean_one(tmp_path: Path) -> None:
    source = tmp_path / "source"
    ckpt = fake_checkpoint(source, 3, make_cfg(source))
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    assert "resumes from" in refused(make_cfg(out, resume=str(ckpt)))
    run_dir = open_run_dir(make_cfg(out, resume=str(ckpt), overwrite=True))
    assert run_dir.resume_from == ckpt and not (out / "metrics.jsonl").exists()
    run_dir.release()
    inside = fake_checkpoint(out, 5, make_cfg(out))
    message = refused(make_cfg(out, resume=str(inside), overwrite=True))
    assert "would delete the checkpoint" in message


def test_checkpoint_without_config_is_resumed_with_a_warning(tmp_path: Path, caplog) -> None:
    out = tmp_path / "run"
    ckpt = fake_checkpoint(out, 2, make_cfg(out))
    (ckpt / "config.yaml").unlink()
    with caplog.at_level(logging.WARNING, logger="leangrpo"):
        run_dir = open_run_dir(make_cfg(out))
    assert run_dir.resume_step == 2
    run_dir.release()
    assert "cannot be checked" in caplog.text


def test_schedule_horizon_is_the_one_the_run_started_with(tmp_path: Path) -> None:
    """max_steps_lr.py: trainer_state.json's schedule_steps; a checkpoint saved before it
    existed falls back to its own config's run.max_steps, not the resuming config's."""
    path = fake_checkpoint(tmp_path / "run", 4, make_cfg(tmp_path / "run", max_steps=4))
    assert schedule_horizon(path, default=8) == 4
    (path / "trainer_state.json").write_text('{"step": 4, "schedule_steps": 3}')
    assert schedule_horizon(path, default=8) == 3
    (path / "trainer_state.json").unlink()
    (path / "config.yaml").unlink()
    assert schedule_horizon(path, default=8) == 8


def test_config_changes_walks_sections_and_compares_lists_whole() -> None:
    old = {"a": {"b": 1, "c": [1, 2]}, "gone": 1}
    new = {"a": {"b": 2, "c": [1, 3]}, "new": {"x": 1}}
    assert config_changes(old, new) == [
        ("a.b", 1, 2),
        ("a.c", [1, 2], [1, 3]),
        ("new", "(unset)", {"x": 1}),
        ("gone", 1, "(unset)"),
    ]
    saved = yaml.safe_load(make_cfg(Path("x")).to_yaml())
    assert config_changes(saved, make_cfg(Path("x")).model_dump(mode="json")) == []


def test_resume_with_another_context_parallel_size_is_refused_even_when_allowed(
    tmp_path: Path, monkeypatch
) -> None:
    """The batch in progress a checkpoint holds was dealt to the shares of its
    distributed.context_parallel_size: another one would hand each process another
    share's old log-probs (run.allow_config_changes does not waive it)."""
    out = tmp_path / "run"
    monkeypatch.setenv("WORLD_SIZE", "4")
    saved = make_cfg(out)
    saved.distributed.context_parallel_size = 2
    ckpt = fake_checkpoint(out, 4, saved)
    (ckpt / "trainer_state.json").write_text('{"step": 4, "world_size": 4}')
    other = make_cfg(out, allow_config_changes=True)
    message = refused(other)
    assert "context_parallel_size = 2 but this run has 1" in message
    assert "resume it with distributed.context_parallel_size: 2" in message
    same = make_cfg(out)
    same.distributed.context_parallel_size = 2
    run_dir = open_run_dir(same)
    assert run_dir.resume_step == 4
    run_dir.release()
