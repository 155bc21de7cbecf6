"""The loss's inputs and the step's normalisers (train/inputs.py)."""

from __future__ import annotations

from support.steps import step_config, step_samples

from leangrpo.train.inputs import normalisers
from leangrpo.train.packing import pack_samples

CFG = step_config()


def test_normalisers_count_the_whole_step():
    batches = [pack_samples(step_samples([1.0, -1.0])), pack_samples(step_samples([1.0]))]
    norm = normalisers(batches, CFG.loss, CFG.rollout.max_new_tokens)
    assert norm.sequences == 3
    assert norm.tokens == sum(b.num_completion_tokens for b in batches)


def test_normalisers_across_ranks_give_each_rank_its_share_of_the_global_counts():
    """FSDP averages gradients over ranks, so each rank divides by global / world_size."""
    batches = [pack_samples(step_samples([1.0, -1.0]))]
    local = normalisers(batches, CFG.loss, CFG.rollout.max_new_tokens)
    seen = []

    def sum_over_ranks(values):  # as if the other rank held 5 sequences and 17 tokens
        seen.append(values)
        return [values[0] + 5, values[1] + 17]

    norm = normalisers(batches, CFG.loss, 8, world_size=2, sum_over_ranks=sum_over_ranks)
    assert seen == [[2.0, float(local.tokens)]]  # one reduction of the local counts
    assert norm.sequences == (2 + 5) / 2 and norm.tokens == (local.tokens + 17) / 2
    assert norm.global_tokens == local.tokens + 17 and norm.world_size == 2
