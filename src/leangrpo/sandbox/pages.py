"""The zygote's memory in huge pages, so that forking a box copies less (worker side).

A fork copies the parent's page tables: one entry per 4 KiB page of its private memory,
each write-protected and its page's reference counted, and a box's exit undoes as many.
For a zygote that imported math-verify (about 50 MB of objects) that was most of a reward
call's cost on a small machine (benchmarks/RESULTS.md "sandbox"). `collapse` asks the
kernel (MADV_COLLAPSE, Linux >= 6.1) to move the zygote's anonymous memory into 2 MiB
pages once, before it serves: a fork then copies one entry per 2 MiB of what neither
process writes afterwards. A region that one of them writes is split back into 4 KiB
entries in that process only (the write copies one 4 KiB page, as before), so the
saving is the regions the zygote leaves alone: the bulk of what imports made.

Nothing else changes: the memory holds the same objects, each box still gets its own
copy of every page it writes, and where the kernel has no such pages (THP disabled,
an older kernel, another architecture's page size) the call does nothing. The cost is
the regions' unused tails, filled to 2 MiB (a few MB at most) and, for a region split
later, its huge page kept whole while any of its 4 KiB pages is mapped.
"""

from __future__ import annotations

import contextlib
import ctypes

MADV_COLLAPSE = 25
HUGE = 2 << 20  # PMD-sized pages on x86-64 and arm64 with 4 KiB base pages

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def collapse() -> int:
    """Move this process's private anonymous memory (the heap and anonymous mappings of
    2 MiB or more) into huge pages where the kernel allows; the bytes it moved."""
    moved = 0
    for start, end in _anonymous_regions():
        first = -(-start // HUGE) * HUGE
        last = end // HUGE * HUGE
        if last > first and _libc.madvise(first, last - first, MADV_COLLAPSE) == 0:
            moved += last - first
    return moved


def _anonymous_regions() -> list[tuple[int, int]]:
    """(start, end) of every private, writable, anonymous mapping (the heap included)."""
    regions = []
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            name = fields[5] if len(fields) > 5 else ""
            if fields[1] == "rw-p" and name in ("", "[heap]"):
                start, _, end = fields[0].partition("-")
                regions.append((int(start, 16), int(end, 16)))
    return regions
