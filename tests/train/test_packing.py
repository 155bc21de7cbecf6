"""pack_samples layout against a per-token Python reference; micro-batch planning."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.samples import make_samples

from leangrpo.train.packing import (
    pack_samples,
    packing_metrics,
    plan_micro_batches,
    unpack_per_sample,
)

SPEC = [(5, [3, 1, 7]), (9, [2, 4]), (1, [1]), (4, [12, 1, 1, 6])]


def reference_layout(samples):
    """Per-token loops: what the packed fields must hold."""
    ids, pos, comp_index, targets, token_seq = [], [], [], [], []
    for s_idx, s in enumerate(samples):
        start = len(ids)
        seq = s.prompt.ids + s.completion.ids
        ids += seq
        pos += list(range(len(seq)))
        for t, tok in enumerate(s.completion.ids):
            comp_index.append(start + len(s.prompt.ids) + t - 1)
            targets.append(tok)
            token_seq.append(s_idx)
    return ids, pos, comp_index, targets, token_seq


def test_pack_samples_matches_per_token_reference():
    samples = make_samples(SPEC)
    batch = pack_samples(samples, sample_indices=list(range(10, 10 + len(samples))))
    ids, pos, comp_index, targets, token_seq = reference_layout(samples)
    assert batch.input_ids.tolist() == [ids]
    assert batch.position_ids.tolist() == [pos]
    assert batch.completion_index.tolist() == comp_index
    assert batch.targets.tolist() == targets
    assert batch.token_seq.tolist() == token_seq
    lens = [s.num_tokens for s in samples]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
    assert batch.max_seqlen == max(lens)
    assert batch.completion_lens.tolist() == [len(s.completion.ids) for s in samples]
    assert batch.sample_index.tolist() == list(range(10, 10 + len(samples)))
    assert batch.truncated.tolist() == [s.completion.finish_reason == "length" for s in samples]
    assert batch.versions.tolist() == [s.version for s in samples]
    assert torch.allclose(batch.advantages, torch.tensor([s.advantage for s in samples]))
    flat_lp = [lp for s in samples for lp in s.completion.logprobs]
    assert torch.allclose(batch.behaviour_logprobs, torch.tensor(flat_lp))
    assert batch.num_sequences == len(samples)
    assert batch.num_completion_tokens == len(targets)


def test_shared_prefix_layout():
    samples = make_samples(SPEC)
    batch = pack_samples(samples, shared_prefix=True)
    layout = batch.prefix
    plain_tokens = sum(s.num_tokens for s in samples)
    saved = sum(p * (len(c) - 1) for p, c in SPEC)
    assert batch.num_tokens == layout.num_tokens == plain_tokens - saved
    ids = batch.input_ids[0].tolist()
    pos = batch.position_ids[0].tolist()
    k = 0
    for g, (plen, comp_lens) in zip(layout.groups, SPEC):
        assert g.prompt_len == plen and list(g.completion_lens) == comp_lens
        assert ids[g.prompt_start : g.prompt_start + plen] == samples[k].prompt.ids
        assert pos[g.prompt_start : g.prompt_start + plen] == list(range(plen))
        for c0, n in zip(g.completion_starts, g.completion_lens):
            assert ids[c0 : c0 + n] == samples[k].completion.ids
            assert pos[c0 : c0 + n] == list(range(plen, plen + n))
            # the first completion token is predicted by the prompt's last position
            first = batch.completion_index[batch.token_seq == k][0]
            assert first == g.prompt_start + plen - 1
            k += 1
    assert batch.targets.tolist() == [t for s in samples for t in s.completion.ids]
    assert batch.num_sequences == len(samples)  # cu_seqlens keeps S + 1 logical entries


def test_shared_prefix_groups_interleaved_samples():
    samples = make_samples([(3, [2, 2]), (4, [1, 3])])
    shuffled = [samples[0], samples[2], samples[1], samples[3]]
    batch = pack_samples(shuffled, sample_indices=[0, 1, 2, 3], shared_prefix=True)
    assert batch.sample_index.tolist() == [0, 2, 1, 3]  # sequences made group-contiguous
    assert batch.targets.tolist() == [t for i in (0, 2, 1, 3) for t in shuffled[i].completion.ids]


def test_pack_samples_rejects_bad_input():
    samples = make_samples([(3, [2])])
    with pytest.raises(ValueError, match="no samples"):
        pack_samples([])
    with pytest.raises(ValueError, match="sample_indices"):
        pack_samples(samples, sample_indices=[0, 1])
    samples[0].completion.logprobs = [0.0]
    with pytest.raises(ValueError, match="behaviour log-probs"):
        pack_samples(samples)
    empty = make_samples([(3, [2])])
    empty[0].completion.ids, empty[0].completion.logprobs = [], []
    with pytest.raises(ValueError, match="empty prompt or completion"):
        pack_samples(empty)
    mixed = make_samples([(3, [2]), (3, [2])])
    mixed[1].group_id = 0
    with pytest.raises(ValueError, match="mixes different prompt ids"):
        pack_samples(mixed, shared_prefix=True)


def test_unpack_per_sample():
    samples = make_samples(SPEC)
    batch = pack_samples(samples)
    parts = unpack_per_sample(batch.targets, batch)
    assert [p.tolist() for p in parts] == [s.completion.ids for s in samples]
    with pytest.raises(ValueError, match="one value per completion token"):
        unpack_per_sample(batch.targets[:-1], batch)


# ----------------------------------------------------------------------- micro-batches


def lognormal_lengths(n, seed=0):
    rng = random.Random(seed)
    return [min(2000, int(rng.uniform(50, 300) + rng.lognormvariate(5, 0.6))) for _ in range(n)]


@pytest.mark.parametrize("balance", ["tokens", "attention"])
def test_plan_respects_budget_and_covers_all(balance):
    lens = lognormal_lengths(64) + [5000]  # one sequence longer than the budget
    budget = 2048
    plan = plan_micro_batches(lens, budget, balance)
    flat = sorted(i for mb in plan for i in mb)
    assert flat == list(range(len(lens)))
    for mb in plan:
        assert sum(lens[i] for i in mb) <= budget or len(mb) == 1
    assert [64] in plan  # the long one sits alone
    assert plan == plan_micro_batches(list(lens), budget, balance)  # deterministic


def test_plan_balances_better_than_naive_order():
    lens = lognormal_lengths(96, seed=3)
    budget = 4096
    plan = plan_micro_batches(lens, budget, "tokens")
    naive, cur, load = [], [], 0  # fill in arrival order
    for i, n in enumerate(lens):
        if cur and load + n > budget:
            naive.append(cur)
            cur, load = [], 0
        cur.append(i)
        load += n
    naive.append(cur)
    ours = packing_metrics(lens, plan)
    theirs = packing_metrics(lens, naive)
    assert len(plan) <= len(naive)
    assert ours["packing/balance"] < theirs["packing/balance"]
    assert ours["packing/balance"] < 1.1
    attn_plan = plan_micro_batches(lens, budget, "attention")
    a_ours = packing_metrics(lens, attn_plan, "attention")["packing/balance"]
    a_naive = packing_metrics(lens, naive, "attention")["packing/balance"]
    assert a_ours < a_naive


def test_plan_keeps_groups_whole_and_counts_shared_prompt_once():
    prompt, comps = 100, [[30, 50, 20, 40]] * 6
    lens = [prompt + c for g in comps for c in g]
    groups = [list(range(4 * g, 4 * g + 4)) for g in range(6)]
    unit = prompt + 140  # one group with its prompt shared
    plan = plan_micro_batches(lens, 2 * unit, "tokens", groups=groups, prompt_lens=[prompt] * 6)
    assert len(plan) == 3
    for mb in plan:
        assert {i // 4 for i in mb} and all(
            set(range(4 * (i // 4), 4 * (i // 4) + 4)) <= set(mb) for i in mb
        )
    with pytest.raises(ValueError, match="exactly once"):
        plan_micro_batches(lens, 1000, groups=groups[:-1])


def plan_shared(samples, budget, balance="tokens"):
    """The micro-batches step.py plans for a shared-prefix layout, packed."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group_id, []).append(i)
    members = list(groups.values())
    prompt_lens = [len(samples[g[0]].prompt.ids) for g in members]
    lens = [s.num_tokens for s in samples]
    plan = plan_micro_batches(lens, budget, balance, groups=members, prompt_lens=prompt_lens)
    packed = [pack_samples([samples[i] for i in mb], shared_prefix=True) for mb in plan]
    return plan, packed, members


def test_a_group_over_the_budget_is_split_with_its_prompt_once_per_micro_batch():
    """prefix_budget.py: P=1000, G=8, R=512 at a budget of 4096 made one 5,096-token
    micro-batch; now two, each with the prompt once: 1000 + 6 x 512 and 1000 + 2 x 512."""
    samples = make_samples([(1000, [512] * 8)])
    plan, packed, _ = plan_shared(samples, 4096)
    assert sorted(mb.num_tokens for mb in packed) == [2024, 4072]
    assert sorted(i for mb in plan for i in mb) == list(range(8))
    assert all(mb.prefix is not None and len(mb.prefix.groups) == 1 for mb in packed)


@settings(max_examples=150, deadline=None)
@given(
    spec=st.lists(
        st.tuples(st.integers(1, 60), st.lists(st.integers(1, 24), min_size=1, max_size=12)),
        min_size=1,
        max_size=6,
    ),
    slack=st.integers(0, 200),
    balance=st.sampled_from(["tokens", "attention"]),
)
def test_no_shared_prefix_micro_batch_exceeds_the_budget(spec, slack, balance):
    """Any P, G, R that passes preflight (longest prompt + max_new_tokens <= budget)."""
    max_new = max(n for _, comps in spec for n in comps)
    budget = max(p for p, _ in spec) + max_new + slack
    samples = make_samples(spec)
    plan, packed, members = plan_shared(samples, budget, balance)
    assert sorted(i for mb in plan for i in mb) == list(range(len(samples)))
    assert max(mb.num_tokens for mb in packed) <= budget
    where = {i: b for b, mb in enumerate(plan) for i in mb}
    for g, (plen, comps) in zip(members, spec):
        if plen + sum(comps) <= budget:  # a group that fits stays whole
            assert len({where[i] for i in g}) == 1


def test_plan_rejects_bad_input():
    with pytest.raises(ValueError, match="token_budget"):
        plan_micro_batches([3, 4], 0)
    with pytest.raises(ValueError, match="balance"):
        plan_micro_batches([3, 4], 10, "flops")
    with pytest.raises(ValueError, match="length < 1"):
        plan_micro_batches([3, 0], 10)


def test_packing_metrics():
    lens = [10, 30, 20, 20]
    m = packing_metrics(lens, [[0, 1], [2, 3]])
    assert m["packing/padding_ratio_avoided"] == pytest.approx(1 - 80 / (2 * 30 + 2 * 20))
    assert m["packing/tokens"] == 80 and m["packing/micro_batches"] == 2
    assert m["packing/balance"] == 1.0 and m["packing/padding_ratio"] == 0.0


def test_device_transfer_keeps_shapes_and_dtypes():
    """The one-buffer-per-dtype transfer path (meta stands in for an accelerator)."""
    samples = make_samples(SPEC)
    cpu, moved = pack_samples(samples), pack_samples(samples, device="meta")
    for name, value in cpu.__dict__.items():
        if isinstance(value, torch.Tensor):
            other = getattr(moved, name)
            assert other.device.type == "meta", name
            assert (other.shape, other.dtype) == (value.shape, value.dtype), name


def test_metrics_of_an_empty_plan_are_defined():
    """empty_batch.py: a batch with no scored sample plans no micro-batch."""
    metrics = packing_metrics([], [], "attention", packed_tokens=[])
    assert metrics["packing/tokens"] == 0.0 and metrics["packing/balance"] == 1.0
