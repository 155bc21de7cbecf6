"""`run.overwrite`: an earlier run is replaced only once the new run holds a checkpoint.

A run started with `run.overwrite: true` in a directory holding an earlier run's files
(`names`: rundir.RUN_FILES found there) leaves them where they are through every check and
the whole set-up (prompts, environments, engines, the model). Right before it writes its
first file the trainer calls `set_aside`, which moves them into `output_dir/.replaced-run/`
(renames within one directory: instant, nothing copied). The new run's first checkpoint
deletes that directory (`EarlierRun.discard`); a run that ends before one (an error,
Ctrl-C) removes the files it wrote and puts the earlier run back (`EarlierRun.restore`).
A process killed in between leaves `.replaced-run/` behind: the next run in the directory
settles it first (`settle`): deleted when a complete checkpoint sits beside it (the new
run wrote one), else restored. Setting aside is all or nothing (`set_aside`), and
putting back goes through `.replaced-run.tmp/` (`EarlierRun.restore`), so the files beside
`.replaced-run/` are always the new run's. No torch, no leangrpo imports:
rundir.py uses it.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("leangrpo")

ASIDE = ".replaced-run"


class EarlierRun:
    """An earlier run's files, moved into `output_dir/.replaced-run/` by `set_aside`."""

    def __init__(self, output_dir: Path, run_files: Iterable[str]):
        self.output_dir = output_dir
        self.aside = output_dir / ASIDE
        self.run_files = tuple(run_files)  # every name leangrpo writes (rundir.RUN_FILES)

    def discard(self) -> None:
        """The new run has a checkpoint: the earlier run is deleted for good."""
        shutil.rmtree(self.aside, ignore_errors=True)
        log.warning("run.overwrite: deleted the earlier run (it was set aside in %s)", self.aside)

    def restore(self, why: str = "this run ended before its first checkpoint") -> None:
        """The new run ended before its first checkpoint: its files go, the earlier run's
        come back.

        Crash-safe: a kill while the new run's files go leaves `.replaced-run/` whole (the
        next start restores it again); then one rename makes it `.replaced-run.tmp/`, whose
        entries the next start only moves back. Moving them straight out of
        `.replaced-run/` would let a kill half-way leave the earlier checkpoints/ back
        beside a `.replaced-run/`: taken for the new run's checkpoint, the rest of the
        earlier run would be deleted."""
        for name in self.run_files:
            remove(self.output_dir / name)
        partial = self.output_dir / (ASIDE + ".tmp")
        os.rename(self.aside, partial)
        _move_back(partial, self.output_dir)
        log.warning(
            "run.overwrite: the earlier run in %s is back in place: %s", self.output_dir, why
        )


def set_aside(output_dir: Path, names: list[str], run_files: Iterable[str]) -> EarlierRun:
    """Move the earlier run's `names` into `.replaced-run/`; the caller discards or restores.

    All or nothing: the names go into `.replaced-run.tmp/` first, which one rename then
    makes `.replaced-run/`; a failure moves them back, a kill leaves the `.tmp` directory
    that `settle` empties back (nothing of the new run exists yet)."""
    earlier = EarlierRun(output_dir, run_files)
    partial = output_dir / (ASIDE + ".tmp")
    partial.mkdir()
    try:
        for name in names:
            os.rename(output_dir / name, partial / name)
        os.rename(partial, earlier.aside)
    except BaseException:
        _move_back(partial, output_dir)
        raise
    log.warning(
        "run.overwrite: the earlier run in %s is set aside in %s until this run writes its first "
        "checkpoint, then deleted (put back if this run ends before)",
        output_dir,
        earlier.aside,
    )
    return earlier


def settle(output_dir: Path, run_files: Iterable[str], has_checkpoint: bool) -> None:
    """What a run killed while replacing an earlier one left: a half-made `.replaced-run.tmp/`
    goes back; a `.replaced-run/` is deleted if that run wrote a checkpoint
    (`has_checkpoint`), else put back."""
    partial = output_dir / (ASIDE + ".tmp")
    if partial.is_dir():
        _move_back(partial, output_dir)
    earlier = EarlierRun(output_dir, run_files)
    if not earlier.aside.is_dir():
        return
    if has_checkpoint:
        earlier.discard()
    else:
        earlier.restore("the run that was to replace it stopped before its first checkpoint")


def _move_back(partial: Path, output_dir: Path) -> None:
    for entry in sorted(partial.iterdir()):
        os.rename(entry, output_dir / entry.name)
    partial.rmdir()


def remove(path: Path) -> None:
    """Delete a file, a link or a directory tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
