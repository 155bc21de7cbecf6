"""Rollout samples made up for tests: groups of completions with random ids and log-probs."""

from __future__ import annotations

import random

from leangrpo.contracts import Completion, Prompt, RolloutSample


def make_samples(spec, vocab=64, seed=0):
    """spec: list of (prompt_len, [completion_len, ...]) per group; prompts shared in a group."""
    rng = random.Random(seed)
    samples = []
    for gid, (plen, comp_lens) in enumerate(spec):
        prompt = [rng.randrange(vocab) for _ in range(plen)]
        for clen in comp_lens:
            ids = [rng.randrange(vocab) for _ in range(clen)]
            lps = [-rng.random() for _ in range(clen)]
            finish = "length" if rng.random() < 0.3 else "stop"
            comp = Completion(ids, "", lps, finish, version=rng.randrange(3))
            samples.append(
                RolloutSample(gid, Prompt(gid, "", prompt), comp, advantage=rng.gauss(0, 1))
            )
    return samples
