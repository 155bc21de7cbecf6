"""`leangrpo plan`'s count of distill.objective: jsd's head (planner/inventory.py
`divergence_head_bytes`) against the bytes the real kernel (ops/logprobs/divergence.py)
allocates at its peak, forward then backward, on CPU: every allocation the profiler
records, replayed in order (deterministic: one thread, allocation sizes, no timing). The
plan is never below it, and at most a tile above; the chunked kernel holds at most three
fp32 tiles (beta 0 or 1) or four (between) beside its gradients and vectors."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from leangrpo.ops.logprobs.divergence import chunked_divergence, naive_divergence
from leangrpo.planner.inventory import divergence_head_bytes

ROWS, HIDDEN, TEACHER_HIDDEN, VOCAB = 96, 40, 56, 1000
TILES = (64, 256)  # two row tiles (the second partial), four vocabulary tiles (the last partial)
TILE = TILES[0] * TILES[1] * 4  # one fp32 tile
DTYPES = {"float32": (torch.float32, 4), "bfloat16": (torch.bfloat16, 2)}


def allocated_peak(fn) -> int:
    """The most bytes `fn()` has allocated and not yet freed at any moment."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        torch.set_num_threads(threads)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def head_pass(dtype, weight_grad: bool, beta: float, chunked: bool):
    """The jsd head's forward and backward, as the training step runs it (the student's
    hidden rows and maybe its head trained, the teacher's frozen and wider)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, generator=g).to(dtype).requires_grad_(weight_grad)
    teacher = (torch.randn(ROWS, TEACHER_HIDDEN, generator=g).to(dtype),
               torch.randn(VOCAB, TEACHER_HIDDEN, generator=g).to(dtype))  # fmt: skip
    targets = torch.randint(0, VOCAB, (ROWS,), generator=g)

    def run():
        if chunked:
            outs = chunked_divergence(hidden, weight, *teacher, targets, beta=beta,
                                      temperature=0.7, row_tile=TILES[0], vocab_tile=TILES[1])  # fmt: skip
        else:
            outs = naive_divergence(hidden, weight, *teacher, targets, beta=beta, temperature=0.7)
        sum(o.sum() for o in outs).backward()
        hidden.grad = weight.grad = None

    run()  # once before measuring: lazy initialisations are not the head's
    return run


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("weight_grad", [False, True], ids=["lora", "full"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_plan_counts_at_least_what_the_divergence_head_allocates(dtype, weight_grad, beta):
    torch_dtype, b = DTYPES[dtype]
    measured = allocated_peak(head_pass(torch_dtype, weight_grad, beta, chunked=True))
    planned = divergence_head_bytes(ROWS, HIDDEN, VOCAB, b, TILES, weight_grad, beta)
    assert measured <= planned <= measured + TILE, (measured / TILE, planned / TILE)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_chunked_divergence_holds_three_tiles_or_four_between(beta):
    """fp32, the head frozen (LoRA): beside the hidden gradient, one row tile's
    accumulator and the (N,) vectors, three tiles (beta 0 / 1) or four (0 < beta < 1)."""
    measured = allocated_peak(head_pass(torch.float32, False, beta, chunked=True))
    others = ROWS * HIDDEN * 4 + TILES[0] * HIDDEN * 4 + 12 * ROWS * 4
    tiles = 4 if 0.0 < beta < 1.0 else 3
    assert measured - others <= tiles * TILE


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_the_full_logits_divergence_is_counted_too(dtype, beta):
    torch_dtype, b = DTYPES[dtype]
    measured = allocated_peak(head_pass(torch_dtype, True, beta, chunked=False))
    assert measured <= divergence_head_bytes(ROWS, HIDDEN, VOCAB, b, None, True, beta)
