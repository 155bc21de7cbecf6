"""What a complete checkpoint holds: recorded in its COMPLETE marker, verified before a resume.

COMPLETE is the last file written into a checkpoint (local.py, sharded.py). It holds one
JSON object: `{"step": N, "files": {"model/model.safetensors": [bytes, "xxh3_64 hex"],
...}}`, every file of the checkpoint but COMPLETE itself. `checkpoint_problem(path)`
compares what is on disk with that record and names what differs (a missing file, another
size, another checksum); None means intact. No torch: the run directory picks the
checkpoint to resume from before anything heavy loads (rundir.py).

Choices:
- The checksum is xxh3_64 (xxhash, a dependency of `datasets`): several GB/s, so the cost
  is reading the files, once after they are written (from the page cache) and once before
  a resume (the load that follows then reads from the page cache). It detects damage
  (truncation, a bad copy, bit rot), not tampering: a checkpoint's loader trusts its
  directory anyway (`torch.load(weights_only=True)` limits what a pickle can do).
- A checkpoint written before COMPLETE held the record (`{"step": N}` only) is checked
  for the files a resume reads (`REQUIRED`), each non-empty; its contents cannot be.
- Under torchrun each rank hashes the files it wrote (`record_files(names=...)`) and rank
  0 merges the records (sharded.py), so no rank reads another rank's shards to write them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

COMPLETE = "COMPLETE"
CHUNK_BYTES = 8 << 20
# What a resume reads from a checkpoint without a record (written by an older leangrpo)
REQUIRED = {
    "local": ("trainer_state.json", "rng.pt", "optimizer.pt", "scheduler.pt"),
    "sharded": ("trainer_state.json", "rng-0.pt", "scheduler.pt", "dcp/.metadata"),
}
Record = dict[str, list]  # relative path -> [bytes, checksum]


def file_checksum(path: Path) -> str:
    import xxhash  # only where a checkpoint is written or verified: not for --help

    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def files_under(directory: Path) -> list[str]:
    """Every file under `directory`, as paths relative to it."""
    return [
        str(Path(root, name).relative_to(directory))
        for root, _, files in os.walk(directory)
        for name in files
    ]


def record_files(directory: Path, names: list[str] | None = None) -> Record:
    """[bytes, checksum] of `names` (paths relative to `directory`), by default of every
    file under it; COMPLETE is never recorded."""
    return {
        name: [(directory / name).stat().st_size, file_checksum(directory / name)]
        for name in sorted(files_under(directory) if names is None else names)
        if name != COMPLETE
    }


def write_complete(directory: Path, step: int, files: Record) -> None:
    """The marker, written last: the step and the record of every other file."""
    (directory / COMPLETE).write_text(json.dumps({"step": step, "files": files}) + "\n")


def read_complete(path: Path) -> dict[str, Any]:
    """COMPLETE's contents; {} when it is not a JSON object (a damaged marker)."""
    try:
        data = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with the complete checkpoint `path` (one clause), or None if intact."""
    marker = read_complete(path)
    if "step" not in marker:
        return f"its {COMPLETE} marker is not what leangrpo writes"
    files = marker.get("files")
    if not isinstance(files, dict):
        return _unrecorded_problem(path)
    try:
        expected = sorted((str(name), int(size), str(sum_)) for name, (size, sum_) in files.items())
    except (TypeError, ValueError):
        return f"its {COMPLETE} marker is damaged (its file record does not parse)"
    found = [_file_problem(path, *entry) for entry in expected]
    return _listed([problem for problem in found if problem is not None])


def _file_problem(root: Path, name: str, size: int, checksum: str) -> str | None:
    path = root / name
    if not path.is_file():
        return f"{name} is missing"
    held = path.stat().st_size
    if held != size:
        return f"{name} holds {held} bytes, not the {size} it was written with"
    if file_checksum(path) != checksum:
        return f"{name} does not match its checksum (changed since it was written)"
    return None


def _unrecorded_problem(path: Path) -> str | None:
    """A checkpoint from before the record: the files a resume reads, non-empty."""
    kind = "sharded" if (path / "dcp").is_dir() else "local"
    found = [_presence(path / name, name) for name in REQUIRED[kind]]
    if kind == "local":
        weights = [*(path / "model").glob("*.safetensors")] if (path / "model").is_dir() else []
        found.append(None if weights else "model/ holds no .safetensors weights")
    return _listed([p for p in found if p is not None])


def _presence(path: Path, name: str) -> str | None:
    if not path.is_file():
        return f"{name} is missing"
    return f"{name} is empty" if path.stat().st_size == 0 else None


def _listed(problems: list[str]) -> str | None:
    if not problems:
        return None
    shown = "; ".join(problems[:3])
    return shown + (f"; and {len(problems) - 3} more files" if len(problems) > 3 else "")
