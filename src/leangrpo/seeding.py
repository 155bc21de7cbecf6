"""Generation seeds derived by hashing, so that no two samples of a run share one.

A seed is `blake2b(parts)` truncated to 62 bits: a function of the run seed, the batch
index, the prompt and the sample, stable across processes and Python versions (never
Python's salted `hash`). Arithmetic seeds (`seed * K + index`, `seed + i * n`) make the
ranges of consecutive batches overlap; hashed ones collide with probability ~2^-46 per
pair at worst (see `prompt_seed`).

vLLM seeds child k of an n > 1 request with `seed + k`, so a per-prompt seed is a hash
with its low `SAMPLE_BITS` bits cleared: the children of one prompt occupy that prompt's
own block of 2^16 seeds and never reach the next prompt's block.
"""

from __future__ import annotations

import hashlib
import struct

SEED_BITS = 62  # seed + k stays a non-negative int64 for every consumer
SAMPLE_BITS = 16  # completions per prompt are seeded seed + k, k < 2**SAMPLE_BITS


def derive_seed(*parts: int) -> int:
    """A 62-bit seed from integers (run seed, batch index, ...); deterministic everywhere."""
    data = struct.pack(f"<{len(parts)}q", *(p % (1 << 64) - (1 << 63) for p in parts))
    digest = hashlib.blake2b(data, digest_size=8, person=b"leangrpo-seed").digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def prompt_seed(batch_seed: int, prompt_index: int, n: int) -> int:
    """The seed of prompt `prompt_index`'s request: its n samples get seed + 0 .. seed + n-1."""
    if not 1 <= n <= 1 << SAMPLE_BITS:
        raise ValueError(f"n must be in [1, {1 << SAMPLE_BITS}] completions per prompt, got {n}")
    block = derive_seed(batch_seed, prompt_index) >> SAMPLE_BITS
    return block << SAMPLE_BITS
