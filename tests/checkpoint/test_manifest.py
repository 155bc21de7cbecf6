"""manifest.py: a checkpoint's COMPLETE marker records its files, and every damage to them
is named before a resume: real checkpoints (local.py, and sharded.py on 2 gloo ranks),
damaged the ways ../shared/repros/r4/hostile/hostile.py damages them."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from support.models import make_tiny_model
from support.ranks import assert_ok, launch

from leangrpo.checkpoint.local import save_checkpoint
from leangrpo.checkpoint.manifest import (
    COMPLETE,
    checkpoint_problem,
    files_under,
    read_complete,
)
from leangrpo.checkpoint.rundir import newest_intact_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A real checkpoint of the tiny model: weights, AdamW state, scheduler, RNG, trainer
    state, config and bulky state."""
    torch.manual_seed(0)
    model = make_tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.arange(8).reshape(1, 8)).logits.pow(2).mean().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    out = tmp_path_factory.mktemp("saved")
    return save_checkpoint(
        out, 3, model, optimizer, scheduler, {"version": 3}, keep_last=1,
        extra_files={"config.yaml": "run: {}\n"}, bulky_state={"producer": {"batch": 4}},
    )  # fmt: skip


@pytest.fixture
def ckpt(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "step-3"
    shutil.copytree(saved, copy)
    return copy


def test_complete_records_every_file_of_the_checkpoint(saved: Path) -> None:
    marker = read_complete(saved)
    assert marker["step"] == 3
    names = set(files_under(saved)) - {COMPLETE}
    assert set(marker["files"]) == names
    assert {"model/model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json"} <= names
    for name, (size, checksum) in marker["files"].items():
        assert size == (saved / name).stat().st_size and len(checksum) == 16
    assert checkpoint_problem(saved) is None


def truncate(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


DAMAGES = {  # hostile.py's, and a flipped byte that keeps the size
    "model truncated": (lambda c: truncate(c / "model/model.safetensors"), "model/model.safetensors holds"),
    "model dir deleted": (lambda c: shutil.rmtree(c / "model"), "model/config.json is missing"),
    "optimizer deleted": (lambda c: (c / "optimizer.pt").unlink(), "optimizer.pt is missing"),
    "optimizer zero": (lambda c: truncate(c / "optimizer.pt", 0), "optimizer.pt holds 0 bytes, not the"),
    "trainer state deleted": (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json is missing"),
    "rng garbage": (lambda c: (c / "rng.pt").write_bytes(os.urandom(200)), "rng.pt holds 200 bytes"),
    "byte flipped": (
        lambda c: (c / "rng.pt").write_bytes(bytes([(c / "rng.pt").read_bytes()[0] ^ 1]) + (c / "rng.pt").read_bytes()[1:]),
        "rng.pt does not match its checksum (changed since it was written)",
    ),
    "marker garbage": (lambda c: (c / COMPLETE).write_bytes(b"\x00garbage"), "its COMPLETE marker is not what leangrpo writes"),
    "record garbage": (lambda c: (c / COMPLETE).write_text('{"step": 3, "files": {"rng.pt": 5}}'), "its COMPLETE marker is damaged"),
}  # fmt: skip


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_every_damage_is_named(ckpt: Path, damage: str) -> None:
    do, named = DAMAGES[damage]
    do(ckpt)
    problem = checkpoint_problem(ckpt)
    assert problem is not None and named in problem, problem
    assert "\n" not in problem


def test_the_newest_intact_checkpoint_is_found_past_damaged_ones(ckpt: Path) -> None:
    root = ckpt.parent
    older, newer = root / "step-1", root / "step-5"
    shutil.copytree(ckpt, older)
    shutil.copytree(ckpt, newer)
    truncate(newer / "optimizer.pt")
    assert newest_intact_checkpoint(root) == ckpt
    truncate(ckpt / "model/model.safetensors")
    assert newest_intact_checkpoint(root) == older


@pytest.mark.slow
def test_sharded_checkpoints_record_every_ranks_files_and_are_verified(tmp_path: Path) -> None:
    """2 gloo ranks write sharded checkpoints at steps 1 and 2: step-2's record holds both
    ranks' shards and RNG files (each rank hashed its own), it verifies, and with rank 1's
    shard cut short the run directory resumes from step-1."""
    ranks = launch(tmp_path, "damaged", "-", str(tmp_path), limit_s=240.0)
    assert_ok(ranks)
    seen = pickle.loads((tmp_path / "damaged.pt").read_bytes())
    record = seen["record"]
    ranks_files = ["rng-0.pt", "rng-1.pt", "dcp/__0_0.distcp", "dcp/__1_0.distcp"]
    assert sorted(record) == sorted([*ranks_files, "dcp/.metadata", "trainer_state.json"])
    assert seen["intact"] is None
    assert seen["damaged"].startswith("dcp/__1_0.distcp holds")
    assert seen["resume"].endswith("checkpoints/step-1")
