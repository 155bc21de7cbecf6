"""Files the tests write and read: JSON-lines files (prompts in, metrics.jsonl and
samples.jsonl out), the demos' data files checked against their build scripts, and copies
of the demo model to damage."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from support.configs import DEMO_MODEL


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """One JSON object a line, each line ended; returns the path as a string (for configs)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_jsonl(path: Path) -> list[dict]:
    """Every line of `path` as a JSON object (a torn or blank line fails the test)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_files_are_the_held_out_split(split, train: list[dict], evals: list[dict]) -> None:
    """A demo's train/eval files are the build script's split (eval, train, pre-training
    problems), in its order, and no prompt is in two of the three sets."""
    eval_set, train_set, pretrain_set = split
    assert [p.prompt for p in eval_set] == [r["prompt"] for r in evals]  # files match the script
    assert [p.prompt for p in train_set] == [r["prompt"] for r in train]
    pretrain = {p.prompt for p in pretrain_set}
    eval_prompts, train_prompts = {r["prompt"] for r in evals}, {r["prompt"] for r in train}
    assert not (eval_prompts & pretrain) and not (eval_prompts & train_prompts)
    assert not (train_prompts & pretrain)


def copy_demo_model(tmp: Path, damage: Callable[[Path], object] | None = None) -> Path:
    """The demo model copied to tmp/model, then edited by `damage(directory)` if given."""
    directory = Path(shutil.copytree(DEMO_MODEL, tmp / "model"))
    if damage is not None:
        damage(directory)
    return directory
