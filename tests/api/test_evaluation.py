"""evaluation.py: what `leangrpo eval` scores and at which step (`locate`, before torch).

Run directories are faked (checkpoints with a COMPLETE marker recording their files, a
final/ with a config.json, a safetensors file and the FINAL_STATE its save writes): which
weights are scored is decided before any model loads. tests/integration/test_cli.py scores
real runs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from support.configs import DEMO_MODEL, DEMO_YAML
from support.processes import run_cli

from leangrpo.api.evaluation import EvalResult, evaluate, locate, render
from leangrpo.checkpoint.manifest import record_files, write_complete
from leangrpo.checkpoint.rundir import write_final_state
from leangrpo.config import load_config
from leangrpo.data.files import DataError


def fake_checkpoint(run: Path, step: int) -> Path:
    path = run / "checkpoints" / f"step-{step}"
    (path / "model").mkdir(parents=True)
    (path / "model" / "model.safetensors").write_bytes(bytes(range(256)))
    (path / "trainer_state.json").write_text(json.dumps({"step": step, "version": step}))
    write_complete(path, step, record_files(path))
    return path


def fake_final(run: Path, step: int | None) -> Path:
    """A full model's final/ (an empty safetensors file), recording `step` unless None."""
    final = run / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    header = b"{}"
    (final / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    if step is not None:
        write_final_state(final, step, version=step)
    return final


def printed(target) -> str:
    return render(EvalResult(target.path, target.step, {}, Path("x"), target.note)).splitlines()[0]


def test_a_final_as_new_as_the_newest_checkpoint_is_scored_at_the_step_it_records(tmp_path):
    run = tmp_path / "run"
    fake_checkpoint(run, 1)
    fake_checkpoint(run, 2)
    final = fake_final(run, 2)
    for path in (run, final):
        target = locate(path)
        assert (target.kind, target.path, target.step, target.version) == ("final", final, 2, 2)
        assert target.note == "" and printed(target) == f"leangrpo eval: {final} (step 2)"


def test_a_run_extended_past_its_final_is_scored_at_its_newest_checkpoint(tmp_path):
    """eval_stale_final.py: a run trained to step 2 (final/), extended and stopped at step
    10 was scored on final/'s step-2 weights, labelled step 10. The run directory now gives
    checkpoint step-10, saying final/ is older; final/ itself reports its own step."""
    run = tmp_path / "run"
    fake_checkpoint(run, 2)
    newest = fake_checkpoint(run, 10)
    final = fake_final(run, 2)
    target = locate(run)
    assert (target.kind, target.path, target.step, target.version) == ("checkpoint", newest, 10, 10)
    assert printed(target) == (
        f"leangrpo eval: {newest} (step 10; the run's final/ holds step 2, older than step-10)"
    )
    own = locate(final)  # asked for by name: scored, at the step it holds
    assert (own.kind, own.step, own.version) == ("final", 2, 2)
    assert own.note == "final/ holds step 2, older than step-10"


def test_a_final_that_records_no_step_is_scored_only_without_checkpoints(tmp_path):
    run = tmp_path / "run"
    final = fake_final(run, None)
    (run / "checkpoints").mkdir()
    target = locate(run)
    assert (target.kind, target.step) == ("final", 0)  # 0: unknown
    newest = fake_checkpoint(run, 3)
    target = locate(run)
    assert (target.kind, target.path, target.step) == ("checkpoint", newest, 3)
    assert "final/ records no step (no final_state.json), so step-3 may be newer" in target.note
    assert locate(final).step == 0


def test_data_to_score_that_cannot_be_read_is_named_as_it_was_given(tmp_path):
    """eval_bad.py: `leangrpo eval RUN --data missing.jsonl` said `data.path = ...: file
    not found`, a key the user never set; the refusal names --data (data= from Python),
    before torch is imported."""
    run = tmp_path / "run"
    fake_checkpoint(run, 2)
    fake_final(run, 2)
    config = load_config(DEMO_YAML, [f"run.output_dir={run}", f"model.name_or_path={DEMO_MODEL}"])
    config.save(run / "config.yaml")
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(DataError) as err:
        evaluate(run, missing)
    assert str(err.value) == f"data = '{missing}': file not found ({missing})"
    with pytest.raises(DataError, match=r"^data = '.*' is not a data file; give a \.jsonl"):
        evaluate(run, "some/hub-name")
    done = run_cli("eval", str(run), "--data", str(missing), probe=True)
    assert done.returncode == 2
    assert f"leangrpo: error: --data = '{missing}': file not found" in done.stderr
    assert done.stdout.splitlines()[-1] == "torch imported: False"
