"""benchmarks/context_parallel.py measures the activations it names with gradient
checkpointing off and on, and `leangrpo plan` counts the same term: two context-parallel
ranks each hold about half of one process's activations in both modes. Memory is counted
op by op (every storage an op allocates: deterministic); no timings."""

from __future__ import annotations

import context_parallel  # benchmarks/ (conftest.py)
import pytest
from models import CONFIGS

from leangrpo.config import config_from_dict
from leangrpo.planner.plan import dims_from_json, plan_memory

TOKENS = 1024
PLAN_TOLERANCE = 0.1  # |plan - measured| / measured; seen: up to 4%


def planned_activations(size: int, checkpointing: bool) -> int:
    """`leangrpo plan`'s activation term for the benchmark's own step at C = size."""
    shape = {k: v for k, v in CONFIGS["cp-small"].items() if k != "arch"}
    dims = dims_from_json({**shape, "model_type": "llama", "max_position_embeddings": TOKENS + 1})
    cfg = config_from_dict(
        context_parallel.step_config("cp-small", TOKENS, size, False, checkpointing)
    )
    prompt = context_parallel.PROMPT_TOKENS
    return plan_memory(cfg, TOKENS, dims, prompt_tokens=prompt, world_size=size)["activations"]


@pytest.mark.slow
def test_two_context_ranks_hold_half_the_activations_with_checkpointing_off_and_on():
    rows = list(context_parallel.case_rows("cp-small", TOKENS, [1, 2], 600.0, (False, True)))
    assert not [r for r in rows if "error" in r], rows
    by = {(r["gradient_checkpointing"], r["context_parallel_size"]): r for r in rows}
    assert sorted(by) == [(False, 1), (False, 2), (True, 1), (True, 2)]
    for checkpointing in (False, True):
        one, two = by[checkpointing, 1], by[checkpointing, 2]
        assert two["mem_ratio"] <= 0.6, (checkpointing, one, two)
        for size, row in ((1, one), (2, two)):
            planned = planned_activations(size, checkpointing)
            error = (planned - row["activation_bytes"]) / row["activation_bytes"]
            assert abs(error) <= PLAN_TOLERANCE, (checkpointing, size, planned, row)
    # checkpointing keeps one layer's tensors, not every layer's: the figure sees it
    assert by[True, 1]["activation_bytes"] < 0.7 * by[False, 1]["activation_bytes"]
