"""vLLM's compile cache, checked before vLLM starts.

A start-up killed while it compiles (Ctrl-C, a timeout, a preempted job) leaves compiled
objects in vLLM's compile cache empty or cut short, and every later start with the same
model and shapes loads them and dies in vLLM's traceback ("main.so: file too short").
`repair_compile_cache` finds such entries and removes them, so vLLM compiles them again;
one log line names each. Damaged: a shared object that is not a whole ELF file, or any
other empty file, outside inductor's `locks/` directories (its lock files are empty by
design). A damaged file whose inductor lock another process holds is being compiled right
now (two starts of one model at once), and is left alone.

An entry is one compile's directory: `torch_compile_cache/<hash>` (or
`torch_compile_cache/torch_aot_compile/<hash>`) under VLLM_CACHE_ROOT (vLLM's default:
~/.cache/vllm), and under a `compilation_config`'s own `cache_dir` when the engine
arguments give one.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ELF_MAGIC = b"\x7fELF"
ELF_HEADER_BYTES = 64  # a 64-bit ELF header: anything shorter is cut short
GROUPS = ("torch_aot_compile",)  # directories that hold entries, not an entry themselves


def compile_cache_roots(llm_kwargs: dict[str, Any]) -> list[Path]:
    """Where this start's compiled code lives: vLLM's compile cache, and a compilation
    config's own cache_dir."""
    from vllm import envs

    roots = [Path(envs.VLLM_CACHE_ROOT) / "torch_compile_cache"]
    config = llm_kwargs.get("compilation_config")
    cache_dir = (
        config.get("cache_dir") if isinstance(config, dict) else getattr(config, "cache_dir", None)
    )
    if cache_dir:
        roots.append(Path(cache_dir).expanduser())
    return roots


def repair_compile_cache(roots: list[Path]) -> list[Path]:
    """Remove every entry under `roots` that holds a damaged file; the entries removed."""
    removed = []
    for root in roots:
        for entry in sorted({_entry(root, f) for f in _damaged_files(root)}):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            log.warning(
                "vLLM's compile cache entry %s was damaged (a compiled file empty or cut short, "
                "as a start-up killed while compiling leaves it): removed, vLLM compiles it again",
                entry,
            )
            removed.append(entry)
    return removed


def _damaged_files(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "locks"]
        for name in filenames:
            path = Path(dirpath) / name
            if _damaged(path) and not _being_written(path):
                found.append(path)
    return found


def _damaged(path: Path) -> bool:
    try:
        size = path.stat().st_size
        if path.suffix != ".so":
            return size == 0
        if size < ELF_HEADER_BYTES:
            return True
        with path.open("rb") as f:
            return f.read(len(ELF_MAGIC)) != ELF_MAGIC
    except OSError:  # gone meanwhile (another process removed it)
        return False


def _being_written(path: Path) -> bool:
    """Whether another process holds inductor's lock on this file's key (`locks/KEY.lock`
    beside its directory: held while the file is compiled)."""
    lock = path.parent.parent / "locks" / f"{path.name.split('.')[0]}.lock"
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _entry(root: Path, path: Path) -> Path:
    """The entry (one compile's directory) under `root` that holds `path`."""
    parts = path.relative_to(root).parts
    depth = 1
    while depth < len(parts) - 1 and parts[depth - 1] in GROUPS:
        depth += 1
    return root.joinpath(*parts[:depth])
