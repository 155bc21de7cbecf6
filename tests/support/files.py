"""Files the tests write and read: JSON-lines files (prompts in, metrics.jsonl and
samples.jsonl out) and copies of the demo model to damage."""

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


def copy_demo_model(tmp: Path, damage: Callable[[Path], object] | None = None) -> Path:
    """The demo model copied to tmp/model, then edited by `damage(directory)` if given."""
    directory = Path(shutil.copytree(DEMO_MODEL, tmp / "model"))
    if damage is not None:
        damage(directory)
    return directory
