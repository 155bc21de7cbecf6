"""Routing replay and the router's aux loss under context parallelism, in one process (each
rank of the group a thread, support/context.py): every rank's experts receive the record
at each predicting position of its shard, a shard's last position included (it predicts
the next shard's first token); one optimizer step (replay, aux loss, old and reference
passes) on C = 2 and 4 ranks equals one process's: log-probs, gradients, `moe/*`."""

from __future__ import annotations

import copy

import pytest
import torch
from support.configs import DEMO_MODEL
from support.context import cp_config, cp_samples, one_step, run_ranks, simulated_step
from support.moe import (
    as_sets,
    experts_received,
    moe_model,
    random_routes,
    used_routes,
    with_routes,
)

from leangrpo.contracts import SamplingParams
from leangrpo.model.policy import build_policy
from leangrpo.model.scoring import PackedScorer, score
from leangrpo.ops.context_parallel.ulysses import Ulysses
from leangrpo.train.planning import plan_steps

MOE = {"rollout": {"routing_replay": True}, "train": {"router_aux_loss_coef": 0.1}}


def moe_cp_config(size: int, **sections):
    merged = {name: dict(values) for name, values in MOE.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return cp_config(DEMO_MODEL, size, **merged)


def replayed_samples(multiturn: bool = False):
    samples = cp_samples(multiturn=multiturn)
    return with_routes(samples, random_routes(samples))


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("layout", ["plain", "shared-prefix", "multi-turn"])
def test_every_shard_replays_the_records_of_its_predicting_positions(size, layout):
    """The planner's micro-batches of the boundary cases (support/context.py): shards of
    prompt only, of padding only, sequences straddling a boundary."""
    samples = replayed_samples(multiturn=layout == "multi-turn")
    cfg = moe_cp_config(
        size, packing={"shared_prefix": "on" if layout == "shared-prefix" else "off"}
    )
    base = moe_model(head_dim=8)
    steps = plan_steps(
        samples, cfg, build_policy(copy.deepcopy(base), cfg, None, torch.device("cpu"))
    )
    batches = steps[0].micro_batches
    copies = [
        build_policy(copy.deepcopy(base), cfg, None, torch.device("cpu")) for _ in range(size)
    ]

    def rank(c: int, exchange) -> list[tuple[int, int]]:
        policy, split, counts = copies[c], Ulysses(exchange, c, size), []
        for batch in batches:
            row = split.local_row(batch)
            with torch.no_grad(), experts_received(policy.model) as calls:
                score(PackedScorer(policy.model, split), batch, SamplingParams(), cfg.logprobs)
            used = used_routes(calls)[row.completion_index]
            assert torch.equal(used, as_sets(row.routes)), c
            counts.append((row.completion_index.numel(), int(policy.routing.last["route_tokens"])))
        return counts

    per_rank = run_ranks(size, rank)
    for b, batch in enumerate(batches):
        counts = [mine[b] for mine in per_rank]
        assert sum(local for local, _ in counts) == batch.num_completion_tokens
        assert {whole for _, whole in counts} == {batch.num_completion_tokens}  # the group's sum
    assert any(mine[b][0] == 0 for mine in per_rank for b in range(len(batches)))  # prompt only


@pytest.mark.parametrize(
    ("size", "layout"), [(2, "plain"), (2, "multi-turn"), (4, "shared-prefix")]
)
def test_a_context_parallel_moe_step_equals_one_process(size, layout):
    """mu 2 (an old pass) and beta > 0 (the reference pass), replay and the aux loss: each
    rank's log-probs, gradients and moe/* figures equal one process's."""
    sections = {
        "loss": {"type": "grpo", "mu": 2, "beta": 0.04},
        "packing": {"shared_prefix": "on" if layout == "shared-prefix" else "off"},
    }
    samples = replayed_samples(multiturn=layout == "multi-turn")
    base = moe_model(head_dim=8)
    cfg1 = moe_cp_config(1, **sections)
    want = one_step(
        build_policy(copy.deepcopy(base), cfg1, None, torch.device("cpu")), samples, cfg1
    )
    assert want["metrics"]["moe/route_tokens"] > 0 and want["metrics"]["moe/aux_loss"] > 0
    cfg = moe_cp_config(size, **sections)
    policy = build_policy(copy.deepcopy(base), cfg, None, torch.device("cpu"))
    for got in simulated_step(policy, samples, cfg, size):
        assert got["micro_batches"] == want["micro_batches"]
        for key, values in want["passes"].items():
            torch.testing.assert_close(got["passes"][key], values, rtol=1e-5, atol=1e-6)
        for name, grad in want["grads"].items():
            scale = float(grad.abs().max())
            torch.testing.assert_close(
                got["grads"][name], grad, rtol=1e-4, atol=1e-6 + 1e-4 * scale
            )
        for name in ("moe/route_tokens", "moe/routing_flips", "moe/aux_loss", "loss"):
            assert got["metrics"][name] == pytest.approx(want["metrics"][name], rel=1e-5, abs=1e-7)
