"""Removing a directory tree that model-driven code wrote (a box's or a worker's scratch).

`shutil.rmtree` recurses once per level (Python 3.11) and holds a descriptor per level, so a
box that leaves a tree a few thousand levels deep makes it raise RecursionError, which
`ignore_errors` does not cover, in the zygote or the trainer that cleans up. `remove_tree`
tries it first (the common case costs no process) and hands what is left to coreutils'
`rm -rf --one-file-system`, which walks any depth without recursion and never crosses into
a mount. It never raises.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

RM_TIMEOUT_S = 120.0  # against a hang only: a tree a box could write in its time goes in seconds


def remove_tree(path: str | os.PathLike[str]) -> bool:
    """Remove `path` and everything beneath it, whatever its depth; True when it is gone.
    Never raises (a failure leaves the tree for the next trainer's stale-directory sweep)."""
    with contextlib.suppress(OSError):  # the common case: a box that left nothing
        os.rmdir(path)
        return True
    with contextlib.suppress(Exception):  # RecursionError and MemoryError included
        shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return True
    with contextlib.suppress(Exception):
        subprocess.run(
            ["rm", "-rf", "--one-file-system", "--", os.fspath(path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=RM_TIMEOUT_S,
            check=False,
        )
    return not os.path.lexists(path)
