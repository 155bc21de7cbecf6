"""Checkpoints: atomic under a crash, pruned, and an exact resume for full and LoRA models.

"Exact" is checked the strongest way: a run resumed into a fresh model takes the next
optimizer step bit-for-bit like the run that never stopped.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from support.models import make_tiny_model
from transformers import get_scheduler

from leangrpo.checkpoint import local as ckpt
from leangrpo.checkpoint.local import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    save_final_model,
)
from leangrpo.checkpoint.rundir import final_state, latest_checkpoint

INPUT_IDS = torch.arange(24).remainder(64).reshape(2, 12)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads; on a busy 2-core box two threads spin (~30x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_lora_model(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    base = make_tiny_model(seed=0)  # frozen base: identical in every run
    torch.manual_seed(seed)  # adapter init differs with the seed
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return get_peft_model(base, config)


def make_run(model):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=10)
    return optimizer, scheduler


def train_step(model, optimizer, scheduler) -> None:
    noise = torch.rand(()) * 0.01  # consumes the torch RNG, so RNG restore matters
    loss = model(input_ids=INPUT_IDS).logits.float().pow(2).mean() + noise
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def draw_random() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("make_model", [make_tiny_model, make_lora_model], ids=["full", "lora"])
def test_resume_is_exact(tmp_path: Path, make_model) -> None:
    model = make_model(seed=0)
    optimizer, scheduler = make_run(model)
    for _ in range(2):
        train_step(model, optimizer, scheduler)
    state = {"sampler": {"epoch": 1, "position": 5}, "version": 2}
    path = save_checkpoint(tmp_path, 2, model, optimizer, scheduler, state, keep_last=2)
    saved_opt = copy.deepcopy(optimizer.state_dict())
    saved_sched = copy.deepcopy(scheduler.state_dict())
    draws = draw_random()
    train_step(model, optimizer, scheduler)
    expected = trainable(model)

    fresh = make_model(seed=123)  # different weights until the checkpoint is loaded
    fresh_opt, fresh_sched = make_run(fresh)
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restored = load_checkpoint(path, fresh, fresh_opt, fresh_sched)

    assert restored == {**state, "step": 2}
    assert draw_random() == draws
    assert fresh_sched.state_dict() == saved_sched
    loaded_opt = fresh_opt.state_dict()
    assert loaded_opt["param_groups"] == saved_opt["param_groups"]
    assert loaded_opt["state"].keys() == saved_opt["state"].keys()
    for index, saved_state in saved_opt["state"].items():
        for key, value in saved_state.items():
            assert torch.equal(loaded_opt["state"][index][key], value), (index, key)
    train_step(fresh, fresh_opt, fresh_sched)
    got = trainable(fresh)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_lora_checkpoint_holds_adapter_only(tmp_path: Path) -> None:
    model = make_lora_model()
    path = save_checkpoint(tmp_path, 1, model, None, None, {}, keep_last=1)
    files = {p.name for p in (path / "model").iterdir()}
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files


def test_a_checkpoint_is_as_readable_as_the_umask_says(tmp_path: Path) -> None:
    """mkdtemp made every checkpoint (and final/) private, 0700, whatever the umask:
    colleagues in the group could not read a run."""
    import os

    old = os.umask(0o027)
    try:
        path = save_checkpoint(tmp_path, 1, make_tiny_model(), None, None, {}, keep_last=1)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o750


def test_crash_mid_save_leaves_nothing_loadable(tmp_path: Path, monkeypatch) -> None:
    model = make_tiny_model()
    optimizer, scheduler = make_run(model)
    first = save_checkpoint(tmp_path, 1, model, optimizer, scheduler, {}, keep_last=3)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(optimizer, "state_dict", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, model, optimizer, scheduler, {}, keep_last=3)
    monkeypatch.undo()
    assert not list((tmp_path / "checkpoints").glob(".tmp-step-2-*"))  # removed at once
    assert latest_checkpoint(tmp_path) == first

    leftover = tmp_path / "checkpoints" / ".tmp-step-2-killed"  # what a killed save leaves
    (leftover / "model").mkdir(parents=True)
    save_checkpoint(tmp_path, 3, model, optimizer, scheduler, {}, keep_last=3)
    assert not leftover.exists()  # the next save cleans up


def test_a_full_disk_is_one_sentence_and_leaves_nothing_behind(tmp_path: Path, monkeypatch) -> None:
    """bad_disk_full.sh: torch's 'enforce fail ... unexpected pos' traceback, a partial
    .tmp-step-N left filling the disk, and a rerun dying with ENOSPC. Now: refused before
    writing when the free space is short of the tensors to write; a write that fills the
    disk all the same is the same sentence, its directory removed; the next save works."""
    from collections import namedtuple

    from leangrpo.errors import UserError

    model = make_tiny_model()
    optimizer, scheduler = make_run(model)
    train_step(model, optimizer, scheduler)  # the optimizer holds its state tensors
    first = save_checkpoint(tmp_path, 1, model, optimizer, scheduler, {}, keep_last=1)
    usage = namedtuple("usage", "total used free")
    needed = ckpt.saved_bytes(model) + ckpt.optimizer_bytes(optimizer)
    assert needed >= 3 * sum(p.numel() * 4 for p in model.parameters())  # weights + 2 moments
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage(1 << 30, 0, needed - 1))
    with pytest.raises(ckpt.DiskFullError) as err:
        save_checkpoint(tmp_path, 2, model, optimizer, scheduler, {}, keep_last=1)
    assert isinstance(err.value, UserError) and "so it was not written" in str(err.value)
    assert "the checkpoint at step 2 needs at least" in str(err.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]

    free = [needed + 1]  # room by the estimate; the write then fills the disk
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage(1 << 30, 0, free[0]))

    def fill_the_disk(*args, **kwargs):
        free[0] = 0
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1 vs 2")

    monkeypatch.setattr(ckpt.torch, "save", fill_the_disk)
    with pytest.raises(ckpt.DiskFullError, match="filled the disk and was removed"):
        save_checkpoint(tmp_path, 2, model, optimizer, scheduler, {}, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == first
    save_checkpoint(tmp_path, 2, model, optimizer, scheduler, {}, keep_last=1)  # room again
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2"]


def test_crash_before_rename_is_ignored(tmp_path: Path, monkeypatch) -> None:
    model = make_tiny_model()

    def crash(src, dst):
        raise OSError("power cut")

    monkeypatch.setattr(ckpt.os, "rename", crash)
    with pytest.raises(OSError, match="power cut"):
        save_checkpoint(tmp_path, 5, model, None, None, {}, keep_last=2)
    monkeypatch.undo()
    (tmp,) = (tmp_path / "checkpoints").glob(".tmp-step-5-*")
    assert (tmp / ckpt.COMPLETE).is_file()  # fully written, yet not accepted
    assert latest_checkpoint(tmp_path) is None


def test_incomplete_step_dir_is_refused(tmp_path: Path) -> None:
    model = make_tiny_model()
    good = save_checkpoint(tmp_path, 1, model, None, None, {}, keep_last=2)
    half = tmp_path / "checkpoints" / "step-7"
    (half / "model").mkdir(parents=True)
    assert latest_checkpoint(tmp_path) == good
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(half, model)


def test_keep_last_prunes_and_resave_replaces(tmp_path: Path) -> None:
    model = make_tiny_model()
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, None, None, {"n": step}, keep_last=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-5"]
    save_checkpoint(tmp_path, 5, model, None, None, {"n": 55}, keep_last=2)
    assert json.loads((root / "step-5" / "trainer_state.json").read_text())["n"] == 55
    save_checkpoint(tmp_path, 4, model, None, None, {"n": 44}, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-4"]  # step-5: abandoned history
    assert latest_checkpoint(tmp_path) == root / "step-4"


def test_pruning_goes_by_the_step_a_checkpoint_records_not_its_name(tmp_path: Path) -> None:
    """A checkpoint renamed by hand (step-2 -> step-999) is pruned as the step-2 it is: kept
    as the newest but one after step 3, not taken for a newer history and deleted."""
    model = make_tiny_model()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, None, None, {}, keep_last=2)
    root = tmp_path / "checkpoints"
    (root / "step-2").rename(root / "step-999")
    save_checkpoint(tmp_path, 3, model, None, None, {}, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-3", "step-999"]
    assert latest_checkpoint(tmp_path) == root / "step-3"


def test_mismatches_are_clear(tmp_path: Path) -> None:
    full = save_checkpoint(tmp_path / "a", 1, make_tiny_model(), None, None, {}, keep_last=1)
    with pytest.raises(CheckpointError, match="lora.enabled"):
        load_checkpoint(full, make_lora_model())
    with pytest.raises(CheckpointError, match="has shape"):
        load_checkpoint(full, make_tiny_model(hidden_size=16))
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint(full, make_tiny_model(num_layers=3))
    optimizer, _ = make_run(make_tiny_model())
    with pytest.raises(CheckpointError, match="no optimizer.pt"):
        load_checkpoint(full, make_tiny_model(), optimizer)
    bad_state = {"producer": {"buffer": [1, object()]}}
    with pytest.raises(CheckpointError, match=r"trainer_state\['producer'\]\['buffer'\]\[1\]"):
        save_checkpoint(tmp_path / "b", 1, make_tiny_model(), None, None, bad_state, keep_last=1)


class RecordingTokenizer:
    def save_pretrained(self, directory) -> None:
        (Path(directory) / "tokenizer_config.json").write_text("{}")


def test_final_full_model_loads_with_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = make_tiny_model(seed=3)
    final = save_final_model(tmp_path, model, RecordingTokenizer(), step=3, version=2)
    assert (final / "tokenizer_config.json").is_file()
    assert final_state(final) == {"step": 3, "version": 2}  # written inside, renamed with it
    loaded = AutoModelForCausalLM.from_pretrained(final)
    for (name, p), (_, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(p, q), name
    save_final_model(tmp_path, make_tiny_model(seed=4), None)  # replaces atomically
    assert not list(tmp_path.glob(".tmp-*")) and final_state(final) is None


def test_final_lora_adapter_loads_with_peft(tmp_path: Path) -> None:
    from peft import PeftModel

    model = make_lora_model(seed=5)
    optimizer, scheduler = make_run(model)
    for _ in range(2):  # step 1 has lr 0 (warmup); step 2 moves lora_B off zero
        train_step(model, optimizer, scheduler)
    final = save_final_model(tmp_path, model, None)
    loaded = PeftModel.from_pretrained(make_tiny_model(seed=0), final)
    with torch.no_grad():
        want = model(input_ids=INPUT_IDS).logits
        got = loaded(input_ids=INPUT_IDS).logits
        base = make_tiny_model(seed=0)(input_ids=INPUT_IDS).logits
    assert torch.allclose(got, want, atol=1e-6)
    assert (got - base).abs().max() > 1e-6  # the trained adapter is what was loaded


def test_bulky_state_round_trips_through_weights_only_load(tmp_path: Path) -> None:
    """A batch in progress, the replay buffer ...: plain data and tensors beside the JSON."""
    from leangrpo.contracts import Completion, Prompt, RolloutSample

    sample = RolloutSample(
        group_id=3,
        prompt=Prompt(7, "1+1=", [5, 6], columns={"answer": "2"}),
        completion=Completion([8, 9], "2", [-0.25, -1e-9], "stop", version=4),
        rewards={"math": 1.0, "format": None},
        reward=None,
        advantage=-0.5,
        replayed=True,
    )
    bulky = {"samples": [ckpt.sample_state(sample)], "old": torch.randn(5), "none": None}
    path = save_checkpoint(tmp_path, 1, make_tiny_model(), None, None, {}, 1, bulky_state=bulky)
    loaded = ckpt.load_bulky_state(path)  # torch.load(weights_only=True) inside
    assert torch.equal(loaded["old"], bulky["old"]) and loaded["none"] is None
    restored = ckpt.sample_from_state(loaded["samples"][0])
    assert restored.prompt.columns == {}  # reward columns are not kept: already scored
    restored.prompt.columns = sample.prompt.columns
    assert restored == sample
    plain = save_checkpoint(tmp_path, 2, make_tiny_model(), None, None, {}, 1)
    assert ckpt.load_bulky_state(plain) == {}
