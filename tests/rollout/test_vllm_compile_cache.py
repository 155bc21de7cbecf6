"""vLLM's compile cache damaged by a start-up killed while it compiled (rollout/vllm/
compile_cache.py): the damaged entries are found and removed before vLLM starts, so it
compiles them again, and the rest of the cache is left as it was.

Unmarked: the check on cache trees written here (no vLLM). Marked `vllm` (test-vllm):
a real start after its compiled objects were truncated, as a kill mid-compile leaves them,
in a cache of its own.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from leangrpo.rollout.vllm.compile_cache import repair_compile_cache

ELF = b"\x7fELF" + bytes(124)  # a whole ELF header and more


def write(root: Path, rel: str, data: bytes) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_damaged_entries_are_removed_and_whole_ones_kept(tmp_path, caplog):
    root = tmp_path / "torch_compile_cache"
    aot = "torch_aot_compile"
    write(root, f"{aot}/good/inductor_cache/42/c42.main.so", ELF)
    write(root, f"{aot}/good/inductor_cache/locks/c42.lock", b"")  # empty by design
    write(root, f"{aot}/good/rank_0_0/model", b"artifact")
    write(root, f"{aot}/empty_so/inductor_cache/3x/c3x.main.so", b"")
    write(root, f"{aot}/empty_so/rank_0_0/model", b"artifact")
    write(root, "short_so/inductor_cache/ab/cab.so", ELF[:10])
    write(root, "not_elf/inductor_cache/cd/ccd.so", b"#!" + bytes(100))
    write(root, "empty_file/rank_0_0/model", b"")
    with caplog.at_level("WARNING"):
        removed = repair_compile_cache([root, tmp_path / "absent"])
    damaged = [root / aot / "empty_so", root / "empty_file", root / "not_elf", root / "short_so"]
    assert sorted(removed) == sorted(damaged)
    assert not any(path.exists() for path in damaged)
    assert (root / aot / "good/inductor_cache/42/c42.main.so").read_bytes() == ELF
    assert (root / aot / "good/inductor_cache/locks/c42.lock").exists()
    lines = [r.getMessage() for r in caplog.records if "compile cache entry" in r.getMessage()]
    assert len(lines) == 4 and all(
        "damaged" in line and "compiles it again" in line for line in lines
    )


def test_an_object_another_process_is_compiling_is_left_alone(tmp_path):
    """Its inductor lock is held (a second start of the same model at the same moment):
    the empty object is being written, not damaged."""
    root = tmp_path / "torch_compile_cache"
    so = write(root, "busy/inductor_cache/3x/c3x.main.so", b"")
    lock = write(root, "busy/inductor_cache/locks/c3x.lock", b"")
    fd = os.open(lock, os.O_RDWR)  # a descriptor of its own: flock conflicts with it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert repair_compile_cache([root]) == [] and so.exists()
    finally:
        os.close(fd)
    assert repair_compile_cache([root]) == [root / "busy"] and not so.exists()


STARTS = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from leangrpo.contracts import SamplingParams
    from leangrpo.rollout.vllm.local import LocalVLLM, build_llm_kwargs
    from leangrpo.rollout.vllm.settings import VLLMSettings

    settings = VLLMSettings(mode="colocate", dtype="float32", max_model_len=64,
                            engine_kwargs={"kv_cache_memory_bytes": 16 << 20,
                                           "distributed_executor_backend": sys.argv[3]})
    local = LocalVLLM(build_llm_kwargs(sys.argv[1], settings, False, 8, 0), Path(sys.argv[2]))
    (out,) = local.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3), 1, 0, run=None)
    print("GENERATED", out[0].ids)
    local.close()
    """
)


@pytest.mark.vllm
def test_a_start_after_a_kill_mid_compile_compiles_again(tmp_path):
    """A compiled start (no enforce_eager) fills a cache of its own; its compiled objects
    are truncated to 0 bytes, as a kill mid-compile leaves them; the next start removes
    the damaged entry, compiles again and generates. The second start runs vLLM's worker
    in a process of its own (distributed_executor_backend: mp), which on CPU failed at
    warm-up on such a cache (a C++ compile error of a kernel recompiled around the
    damaged objects) and works on a whole one. One layer: every kernel kind is compiled
    once all the same (a second layer only adds objects)."""
    from support.vllm_models import build_char_model

    model = tmp_path / "model"
    build_char_model(model, layers=1)
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}

    def start(n: int, executor: str) -> subprocess.CompletedProcess:
        work = tmp_path / f"work{n}"
        cmd = [sys.executable, "-c", STARTS, str(model), str(work), executor]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)

    first = start(1, "uni")
    assert first.returncode == 0 and "GENERATED" in first.stdout, first.stderr[-3000:]
    objects = list((tmp_path / "cache").rglob("*.so"))
    assert objects, "the first start compiled nothing"
    for so in objects:
        so.write_bytes(b"")
    second = start(2, "mp")  # the worker in a process of its own, as issue 35 ran it
    assert second.returncode == 0 and "GENERATED" in second.stdout, second.stderr[-3000:]
    assert "compile cache entry" in second.stderr and "compiles it again" in second.stderr
    assert all(so.stat().st_size > 0 for so in (tmp_path / "cache").rglob("*.so"))
