"""rundir.py: the run directory's lock, clean starts, finished runs and resume config checks;
overwrite.py: an earlier run replaced only once the new run holds a checkpoint; the choice
of the newest intact checkpoint (manifest.py).

Checkpoints are faked (a step-N directory with config.yaml, a few weight-like files and a
COMPLETE marker recording them, as manifest.py writes it): these rules run before any
model loads, so they need none. tests/checkpoint/test_manifest.py damages real ones.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from leangrpo.checkpoint.manifest import record_files, write_complete
from leangrpo.checkpoint.overwrite import ASIDE
from leangrpo.checkpoint.rundir import (
    RunDirError,
    complete_checkpoints,
    config_changes,
    current_final,
    open_run_dir,
    schedule_horizon,
    write_final_state,
)
from leangrpo.config import config_from_dict
from leangrpo.preflight import describe_run_dir


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
    (path / "model").mkdir(parents=True)
    (path / "config.yaml").write_text(cfg.to_yaml())
    (path / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (path / "optimizer.pt").write_bytes(b"optimizer state" * 10)
    seal(path, step)
    return path


def seal(path: Path, step: int) -> None:
    """The COMPLETE marker recording the files `path` holds now."""
    write_complete(path, step, record_files(path))


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
    deadline = time.time() + 60
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


def test_earlier_run_without_checkpoint_is_refused_then_replaced(tmp_path: Path) -> None:
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
    run_dir = open_run_dir(make_cfg(out, overwrite=True))
    assert (out / "metrics.jsonl").is_file()  # untouched through every check and the set-up
    run_dir.begin_writing()
    assert not (out / "metrics.jsonl").exists() and not (out / "config.yaml").exists()
    assert (out / ASIDE / "metrics.jsonl").is_file()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')  # the new run's
    run_dir.checkpoint_saved()  # its first checkpoint: the earlier run goes for good
    assert not (out / ASIDE).exists() and (out / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert (out / "notes.txt").read_text() == "mine"  # not leangrpo's: never deleted
    run_dir.release()
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` and its bytes, the lock file left out."""
    files = (p for p in root.rglob("*") if p.is_file() and p.name != ".lock")
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def earlier_run(out: Path) -> dict[str, bytes]:
    """A finished run's files (a checkpoint, metrics, a final model) and what they hold."""
    fake_checkpoint(out, 10, make_cfg(out))
    (out / "metrics.jsonl").write_text('{"step": 10}\n')
    (out / "final").mkdir()
    (out / "final" / "model.safetensors").write_bytes(b"w" * 100)
    write_final_state(out / "final", 10, 10)
    (out / "config.yaml").write_text(make_cfg(out).to_yaml())
    return tree(out)


def test_what_a_run_that_failed_before_its_first_step_left_does_not_block_the_rerun(
    tmp_path: Path,
) -> None:
    """flex_on_cpu.py: a run that failed at its first step left metrics.jsonl (its step-0
    evaluation), and the corrected rerun was refused as 'an earlier run'. Such leftovers
    (step-0 rows only, the trackers' files) are deleted once the rerun starts writing;
    anything more (a step completed, a torn row, another file) is still refused."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("the failed run's")
    step0 = '{"step": 0, "prompts/train": 8}\n{"step": 0, "eval/reward": 0.25}\n'
    (out / "metrics.jsonl").write_text(step0)
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events").write_text("x")
    looked = open_run_dir(make_cfg(out), dry=True)
    described = describe_run_dir(looked)
    assert "deleting what a run that failed before its first step left there" in described
    assert "(metrics.jsonl, tensorboard)" in described
    run_dir = open_run_dir(make_cfg(out))
    assert run_dir.resume_from is None and run_dir.leftovers == ["metrics.jsonl", "tensorboard"]
    assert (out / "metrics.jsonl").read_text() == step0  # untouched through the set-up
    run_dir.begin_writing()
    assert not (out / "metrics.jsonl").exists() and not (out / "tensorboard").exists()
    run_dir.release()
    for more in ('{"step": 1}\n', '{"step": 0, "eval/rew'):  # a step completed; a torn row
        (out / "metrics.jsonl").write_text(step0 + more)
        assert "already holds an earlier run (metrics.jsonl)" in refused(make_cfg(out))
    (out / "metrics.jsonl").write_text(step0)
    (out / "eval.jsonl").write_text('{"step": 0}\n')  # `leangrpo eval`'s: the user's figures
    assert "already holds an earlier run (eval.jsonl, metrics.jsonl)" in refused(make_cfg(out))


def test_overwrite_puts_the_earlier_run_back_when_the_new_one_ends_before_a_checkpoint(
    tmp_path: Path, caplog
) -> None:
    out = tmp_path / "run"
    before = earlier_run(out)
    run_dir = open_run_dir(make_cfg(out, overwrite=True))
    assert run_dir.resume_from is None and tree(out) == before  # nothing moved by the checks
    run_dir.begin_writing()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')  # the new run starts writing ...
    (out / "config.yaml").write_text("new")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events").write_text("x")
    with caplog.at_level(logging.WARNING, logger="leangrpo"):
        run_dir.release()  # ... and fails before its first checkpoint
    assert "back in place" in caplog.text
    assert tree(out) == before
    assert not (out / ASIDE).exists() and not (out / "tensorboard").exists()


@pytest.mark.parametrize("wrote_checkpoint", [False, True], ids=["before", "after"])
def test_a_run_killed_with_the_earlier_run_set_aside_is_settled_at_the_next_start(
    tmp_path: Path, wrote_checkpoint: bool
) -> None:
    out = tmp_path / "run"
    before = earlier_run(out)
    run_dir = open_run_dir(make_cfg(out, overwrite=True))
    run_dir.begin_writing()
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    if wrote_checkpoint:  # killed between its first checkpoint and deleting the earlier run
        fake_checkpoint(out, 1, make_cfg(out, overwrite=True))
    run_dir.lock.release()  # SIGKILL: the OS drops the lock, nothing else runs
    looked = open_run_dir(make_cfg(out), dry=True)  # `leangrpo check` changes nothing
    assert (out / ASIDE).is_dir() and "train settles it first" in describe_run_dir(looked)
    again = open_run_dir(make_cfg(out))
    assert not (out / ASIDE).exists()
    if wrote_checkpoint:  # the new run's, resumed; the earlier run is gone
        assert again.resume_step == 1 and "final/model.safetensors" not in tree(out)
    else:  # the earlier run, whole, as if the killed run had never started
        assert again.finished and tree(out) == before
    again.release()


def test_setting_aside_is_all_or_nothing(tmp_path: Path, monkeypatch) -> None:
    """A failure half-way puts back what moved; a kill half-way leaves `.replaced-run.tmp`,
    which the next start empties back (the files beside it are the earlier run's too)."""
    import leangrpo.checkpoint.overwrite as overwrite

    out = tmp_path / "run"
    before = earlier_run(out)
    run_dir = open_run_dir(make_cfg(out, overwrite=True))
    rename, calls = os.rename, []

    def second_fails(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        rename(src, dst)

    monkeypatch.setattr(overwrite.os, "rename", second_fails)
    with pytest.raises(OSError):
        run_dir.begin_writing()
    monkeypatch.setattr(overwrite.os, "rename", rename)
    assert tree(out) == before and not (out / (ASIDE + ".tmp")).exists()
    run_dir.release()
    (out / (ASIDE + ".tmp")).mkdir()  # killed after moving checkpoints/ and final/
    for name in ("checkpoints", "final"):
        os.rename(out / name, out / (ASIDE + ".tmp") / name)
    again = open_run_dir(make_cfg(out))
    assert again.finished and tree(out) == before and not (out / (ASIDE + ".tmp")).exists()
    again.release()


@pytest.mark.parametrize("renames_done", [1, 2])
def test_a_run_killed_while_putting_the_earlier_run_back_loses_none_of_it(
    tmp_path: Path, monkeypatch, renames_done: int
) -> None:
    """A kill (a second Ctrl-C, SIGKILL) between the renames that put an earlier run back:
    its checkpoints/ already back must not make the next start take it for the new run's
    checkpoint and delete the rest of the earlier run (final/, metrics.jsonl ...)."""
    import leangrpo.checkpoint.overwrite as overwrite

    out = tmp_path / "run"
    before = earlier_run(out)
    run_dir = open_run_dir(make_cfg(out, overwrite=True))
    run_dir.begin_writing()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')  # the new run's, then it fails
    rename, calls = os.rename, []

    def killed_after(src, dst):
        if len(calls) == renames_done:
            raise SystemExit("killed")  # nothing after this point runs
        calls.append(src)
        rename(src, dst)

    monkeypatch.setattr(overwrite.os, "rename", killed_after)
    with pytest.raises(SystemExit):
        run_dir.release()
    monkeypatch.setattr(overwrite.os, "rename", rename)
    run_dir.lock.release()  # the OS drops the lock of the killed process
    again = open_run_dir(make_cfg(out))
    assert again.finished and tree(out) == before
    assert not (out / ASIDE).exists() and not (out / (ASIDE + ".tmp")).exists()
    again.release()


def read_only(path: Path) -> None:
    """A directory this process cannot write to, root included (chattr +i), or skip."""
    path.chmod(0o555)
    if os.access(path, os.W_OK):
        made = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
        if made.returncode != 0 or os.access(path, os.W_OK):
            pytest.skip("cannot make a read-only directory here (root without chattr)")


def writable(path: Path) -> None:
    subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    path.chmod(0o755)


def test_read_only_output_dir_is_one_sentence(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    read_only(out)
    try:
        for dry in (False, True):
            with pytest.raises(RunDirError) as info:
                open_run_dir(make_cfg(out), dry=dry)
            assert f"run.output_dir {str(out)!r} is not writable" in str(info.value)
        with pytest.raises(RunDirError) as info:  # under it: the directory cannot be made
            open_run_dir(make_cfg(out / "sub"))
        assert "cannot be created" in str(info.value)
    finally:
        writable(out)


def test_dry_open_decides_without_creating_locking_or_moving(tmp_path: Path) -> None:
    missing = tmp_path / "not" / "yet"
    run_dir = open_run_dir(make_cfg(missing), dry=True)
    assert run_dir.resume_from is None and not (tmp_path / "not").exists()
    out = tmp_path / "run"
    before = earlier_run(out)
    run_dir = open_run_dir(make_cfg(out, overwrite=True), dry=True)
    assert run_dir.replaces == ["checkpoints", "final", "metrics.jsonl", "config.yaml"]
    assert tree(out) == before  # no .lock created, nothing set aside
    held = open_run_dir(make_cfg(out, max_steps=12))  # a run in progress holds the lock
    with pytest.raises(RunDirError, match="in use by this process"):
        open_run_dir(make_cfg(out, max_steps=12), dry=True)
    held.release()


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(
    tmp_path: Path, caplog
) -> None:
    out = tmp_path / "run"
    cfg = make_cfg(out)
    fake_checkpoint(out, 2, cfg)
    middle = fake_checkpoint(out, 4, cfg)
    newest = fake_checkpoint(out, 6, cfg)
    truncate(newest / "model" / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="leangrpo"):
        run_dir = open_run_dir(cfg)
    assert run_dir.resume_from == middle and run_dir.resume_step == 4
    warning = caplog.records[-1].getMessage()
    assert warning == (
        "resuming from step-4, the newest intact checkpoint: step-6 is damaged "
        "(model/model.safetensors holds 512 bytes, not the 1024 it was written with)"
    )
    run_dir.release()
    flipped = bytearray((middle / "optimizer.pt").read_bytes())
    flipped[3] ^= 1  # same size, other bytes
    (middle / "optimizer.pt").write_bytes(bytes(flipped))
    run_dir = open_run_dir(cfg)
    assert run_dir.resume_step == 2
    run_dir.release()
    explicit = refused(make_cfg(out, resume=str(middle)))
    assert explicit.startswith(f"run.resume = {str(middle)!r} is damaged: optimizer.pt does not")


def test_damaged_checkpoints_passed_over_are_kept_out_of_the_pruning(
    tmp_path: Path, caplog
) -> None:
    """The run's first save prunes every checkpoint past the step it saves: the damaged
    newer ones, whose weights may be intact, are renamed out of its way instead (once the
    set-up is done; `leangrpo check` and a refused start leave them as they are)."""
    from leangrpo.checkpoint.rundir import complete_checkpoints

    out = tmp_path / "run"
    cfg = make_cfg(out)
    fake_checkpoint(out, 2, cfg)
    newest = fake_checkpoint(out, 6, cfg)
    truncate(newest / "optimizer.pt")
    weights = (newest / "model" / "model.safetensors").read_bytes()
    open_run_dir(cfg, dry=True)
    assert newest.is_dir()
    run_dir = open_run_dir(cfg)
    assert newest.is_dir()  # nothing moved before the set-up is done
    with caplog.at_level(logging.WARNING, logger="leangrpo"):
        run_dir.begin_writing()
    kept = out / "checkpoints" / "damaged-step-6"
    assert not newest.exists() and (kept / "model" / "model.safetensors").read_bytes() == weights
    assert [step for step, _ in complete_checkpoints(out / "checkpoints")] == [2]
    assert f"kept the damaged checkpoint step-6 as {kept}" in caplog.text
    run_dir.release()


def test_every_checkpoint_damaged_is_one_sentence_naming_them_and_the_way_out(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    cfg = make_cfg(out)
    old = fake_checkpoint(out, 2, cfg)
    new = fake_checkpoint(out, 4, cfg)
    (old / "optimizer.pt").unlink()
    (new / "COMPLETE").write_text("garbage")
    message = refused(cfg)
    assert message.startswith(f"No intact checkpoint to resume from in {str(out / 'checkpoints')!r}")
    assert "step-4 is damaged (its COMPLETE marker is not what leangrpo writes)" in message
    assert "step-2 is damaged (optimizer.pt is missing)" in message
    assert "restore those files from a copy, or set run.overwrite: true" in message
    run_dir = open_run_dir(make_cfg(out, overwrite=True))  # the way out it names
    assert run_dir.resume_from is None
    run_dir.release()


def test_a_checkpoint_from_before_the_record_is_checked_for_the_files_a_resume_reads(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    cfg = make_cfg(out)
    path = fake_checkpoint(out, 2, cfg)
    for name in ("rng.pt", "scheduler.pt"):
        (path / name).write_text("x")
    (path / "trainer_state.json").write_text('{"step": 2}')
    (path / "COMPLETE").write_text('{"step": 2}\n')  # as leangrpo wrote it before
    run_dir = open_run_dir(cfg)
    assert run_dir.resume_step == 2
    run_dir.release()
    (path / "rng.pt").write_text("")
    assert "step-2 is damaged (rng.pt is empty)" in refused(cfg)


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
    run_dir.begin_writing()
    assert not (out / "checkpoints").exists() and not (out / "final").exists()
    run_dir.checkpoint_saved()
    run_dir.release()
    assert not (out / "checkpoints").exists() and not (out / ASIDE).exists()


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
    write_final_state(out / "final", 10, 10)
    run_dir = open_run_dir(make_cfg(out))
    assert run_dir.finished.startswith(f"Run {str(out)!r} is already finished")
    assert "step 10 and run.max_steps is 10" in run_dir.finished
    run_dir.release()
    run_dir = open_run_dir(make_cfg(out, max_steps=12))
    assert not run_dir.finished and run_dir.resume_step == 10
    run_dir.release()


def test_a_final_older_than_the_resume_checkpoint_does_not_finish_the_run(tmp_path: Path) -> None:
    """eval_stale_final.py: a run finished at step 2 (final/), extended and stopped at
    step 10, then told max_steps 10: final/ holds step 2, so the run is not finished; it
    resumes to finish (the last evaluation and final/). `current_final` passes it over."""
    out = tmp_path / "run"
    fake_checkpoint(out, 2, make_cfg(out))
    (out / "final").mkdir()
    write_final_state(out / "final", 2, 2)
    assert current_final(out) == out / "final"
    fake_checkpoint(out, 10, make_cfg(out))
    assert current_final(out) is None
    run_dir = open_run_dir(make_cfg(out))
    assert not run_dir.finished and run_dir.resume_step == 10
    run_dir.release()
    (out / "final" / "final_state.json").unlink()  # written before leangrpo kept the step
    run_dir = open_run_dir(make_cfg(out))
    assert not run_dir.finished and current_final(out) is None
    run_dir.release()
    write_final_state(out / "final", 10, 10)
    run_dir = open_run_dir(make_cfg(out))
    assert run_dir.finished and current_final(out) == out / "final"
    run_dir.release()


def test_a_replay_run_resuming_a_batch_generated_without_routes_is_refused_first(
    tmp_path: Path,
) -> None:
    """moe_resume_replay_on.py: rollout.routing_replay turned on by a resume inside a batch
    generated without route records was refused only after the model loaded, without
    naming the cause. The checkpoint's trainer_state.json says where its batch ends and
    whether it carries routes: refused before anything loads, saying how to go on."""
    out = tmp_path / "run"
    path = fake_checkpoint(out, 5, make_cfg(out))
    batch = {"ends_at_step": 6, "routes": False}
    (path / "trainer_state.json").write_text(json.dumps({"step": 5, "batch_in_progress": batch}))
    seal(path, 5)
    replay = make_cfg(out, allow_config_changes=True, max_steps=20)
    replay.rollout.routing_replay = True
    message = refused(replay)
    assert message == (
        f"Checkpoint {str(path)!r} holds a batch in progress generated without route records (rollout.routing_replay was off when it was generated), which a run with rollout.routing_replay: true cannot train on; resume with rollout.routing_replay: false and run.max_steps: 6 (the step that batch ends at), then resume again with it on (the next batch is generated with routes)."
    )
    open_run_dir(make_cfg(out, max_steps=20)).release()  # replay off: resumed
    batch["routes"] = True
    (path / "trainer_state.json").write_text(json.dumps({"step": 5, "batch_in_progress": batch}))
    seal(path, 5)
    open_run_dir(replay).release()


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
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')  # a step completed
    assert "resumes from" in refused(make_cfg(out, resume=str(ckpt)))
    run_dir = open_run_dir(make_cfg(out, resume=str(ckpt), overwrite=True))
    run_dir.begin_writing()
    assert run_dir.resume_from == ckpt and not (out / "metrics.jsonl").exists()
    run_dir.checkpoint_saved()
    run_dir.release()
    inside = fake_checkpoint(out, 5, make_cfg(out))
    message = refused(make_cfg(out, resume=str(inside), overwrite=True))
    assert "would delete the checkpoint" in message


def test_checkpoint_without_config_is_resumed_with_a_warning(tmp_path: Path, caplog) -> None:
    out = tmp_path / "run"
    ckpt = fake_checkpoint(out, 2, make_cfg(out))
    (ckpt / "config.yaml").unlink()
    seal(ckpt, 2)  # written so by an older leangrpo
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


@pytest.mark.parametrize("kind", ["full", "lora", "qlora"])
def test_the_schedule_extension_refusal_advises_what_works_for_the_kind_of_run(tmp_path, kind):
    """b11_schedule_message.py: a LoRA run was told to start a new run from final/ as
    model.name_or_path, where an adapter is no model (refused). Full fine-tuning: final/
    as it is; LoRA and QLoRA: `leangrpo merge` first (tests/integration/test_trainer.py
    follows that advice); a run without final/ is told to write it first."""

    def cfg(max_steps):
        model = {"name_or_path": "tiny", "quantization": "nf4" if kind == "qlora" else "none"}
        return config_from_dict(
            {
                "run": {"output_dir": str(out), "max_steps": max_steps},
                "model": model,
                "lora": {"enabled": kind != "full"},
                "data": {"path": "p.jsonl"},
                "rewards": {"functions": ["math"]},
                "train": {"lr_scheduler": "linear"},
            }
        )

    out = tmp_path / "run"
    fake_checkpoint(out, 4, cfg(4))
    (out / "final").mkdir()
    message = refused(cfg(6))
    assert "past the end of this run's linear learning-rate schedule (4 steps" in message
    if kind == "full":
        assert f"start a new run from {str(out / 'final')!r} (model.name_or_path)" in message
        assert "merge" not in message
    else:
        merged = f"{out}-merged"
        assert f"`leangrpo merge {out} {merged}` and start a new run from {merged!r}" in message
        assert str(out / "final") not in message
        assert ("quantizes it again" in message) == (kind == "qlora")
    (out / "final").rmdir()
    first = "write its final model first (run.max_steps: 4 with checkpoint.save_final_model: true)"
    assert first in refused(cfg(6))


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


def by_value_cfg(out: Path, reward: str, tool: str, env: str):
    """A config holding user code passed by value (the bytes differ between sessions)."""
    return config_from_dict(
        {
            "run": {"output_dir": str(out), "max_steps": 10},
            "model": {"name_or_path": "tiny"},
            "data": {"path": "p.jsonl", "chat_template": True},
            "rewards": {"functions": [{"name": "mine", "value": reward}]},
            "environment": {"name": "Env", "value": env, "tools": [{"name": "add", "value": tool}]},
        }
    )


def test_a_resume_compares_what_is_sent_by_value_by_its_name_only(tmp_path: Path) -> None:
    out = tmp_path / "run"
    fake_checkpoint(out, 4, by_value_cfg(out, "AAAA", "BBBB", "CCCC"))
    run_dir = open_run_dir(by_value_cfg(out, "AAAB", "BBBC", "CCCD"))  # the same code, re-sent
    assert run_dir.resume_step == 4 and run_dir.config_notes == []
    run_dir.release()
    renamed = by_value_cfg(out, "AAAA", "BBBB", "CCCC")
    renamed.rewards.functions[0].name = "other"
    assert "rewards.functions" in refused(renamed)


def test_a_renamed_checkpoint_is_taken_at_the_step_it_records(tmp_path: Path, caplog) -> None:
    """step-2 renamed step-999 made a run with max_steps 3 'already finished at step 999'
    (the name was trusted over the COMPLETE marker): it resumes at step 2, once warned."""
    out = tmp_path / "run"
    fake_checkpoint(out, 1, make_cfg(out))
    two = fake_checkpoint(out, 2, make_cfg(out))
    renamed = two.rename(two.with_name("step-999"))
    assert complete_checkpoints(out / "checkpoints") == [
        (1, out / "checkpoints" / "step-1"),
        (2, renamed),
    ]
    with caplog.at_level(logging.WARNING, logger="leangrpo"):
        run_dir = open_run_dir(make_cfg(out, max_steps=3))
    assert not run_dir.finished
    assert (run_dir.resume_from, run_dir.resume_step) == (renamed, 2)
    assert f"checkpoint {renamed} holds step 2" in caplog.text
    run_dir.release()
