"""Packed batches: real tokens only, one row, and the micro-batch plan that fills them.

Layout (plain): each sample's prompt+completion ids are laid end to end in one (1, N) row;
`position_ids` restart at 0 per sequence, `cu_seqlens` holds the boundaries, and
`completion_index[t]` is the position whose hidden state predicts completion token t (the
position just before it). Everything is built with cumsum / repeat_interleave / arange on
the host and moved with two transfers (one int64 buffer, one float32 buffer).

Layout (shared prefix): each group's prompt is laid once, followed by its G completions:
G*(P+R) tokens become P+G*R. Completion tokens continue the prompt's positions (P, P+1, ..)
and attend to the prompt plus their own completion only; the first token of every
completion is predicted by the prompt's last position. The row segmentation lives in a
`PrefixLayout` carried by `PrefixPackedBatch.prefix`; `cu_seqlens` keeps S + 1 entries (the
cumulative logical lengths P_i + R_i) so that `num_sequences` is still the sample count.

Multi-turn trajectories (`Completion.trajectory`): the completion holds the model's turns
and the environment's segments between them; only the model's tokens get a
`completion_index` / target, so every (T,) tensor (behaviour, old and reference log-probs,
mask, token_seq) and every normaliser counts model tokens only. The environment's tokens
sit in the row like prompt tokens: attended to, never predicted, no log-prob, no loss.
`truncated` marks finish reasons "length" and "max_turns".

Route records (routing replay, mixture-of-experts models): each sample's (model tokens,
layers, k) record is concatenated in the same (T,) order as the behaviour log-probs
(`PackedBatch.routes`); a micro-batch mixing samples with and without one is refused.

Micro-batches: whole units (a sample, or a group when the prefix is shared) are assigned
greedily, heaviest first, to the least loaded of k bins that still fits the token budget,
k being the first-fit-decreasing bin count (a new bin opens when none fits). The load is
the token count ("tokens") or the sum of squared sequence lengths ("attention"). A group
larger than the budget is split first into the fewest chunks first-fit-decreasing finds,
each chunk carrying the prompt once: `train.micro_batch_tokens` is a memory bound, so a
shared prompt never buys a micro-batch over it (its price: the prompt is forwarded once
per micro-batch the group spans). Any two chunks of one group exceed the budget together,
so they never share a micro-batch and the planned token counts are the packed ones.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from leangrpo.contracts import PackedBatch, RolloutSample
from leangrpo.model.moe.routes import packed_routes
from leangrpo.ops.attention.layout import GroupSpan, PrefixLayout

Balance = Literal["tokens", "attention"]


@dataclass
class PrefixPackedBatch(PackedBatch):
    """A PackedBatch whose row shares each group's prompt (see the module docstring)."""

    prefix: PrefixLayout | None = None

    def to(self, device: Any) -> PrefixPackedBatch:
        moved = {
            name: (value.to(device, non_blocking=True) if isinstance(value, Tensor) else value)
            for name, value in self.__dict__.items()
        }
        return PrefixPackedBatch(**moved)


# ----------------------------------------------------------------------------- packing


def pack_samples(
    samples: list[RolloutSample],
    *,
    sample_indices: list[int] | None = None,
    shared_prefix: bool = False,
    device: torch.device | str | None = None,
) -> PackedBatch:
    """Pack `samples` into one row; `sample_indices[i]` is sample i's index in its batch."""
    _check_samples(samples, sample_indices)
    indices = list(range(len(samples))) if sample_indices is None else list(sample_indices)
    if shared_prefix:
        return _pack_shared_prefix(samples, indices, device)
    prompt_lens = [len(s.prompt.ids) for s in samples]
    comp_lens = [len(s.completion.ids) for s in samples]
    flat_ids = _concat(ids for s in samples for ids in (s.prompt.ids, s.completion.ids))
    seq_lens = torch.tensor(prompt_lens) + torch.tensor(comp_lens)  # (S,)
    seq_starts = torch.cumsum(seq_lens, 0) - seq_lens
    # position of the last prompt token = the one predicting completion token 0
    first_predictor = seq_starts + torch.tensor(prompt_lens) - 1
    ints = _index_tensors(
        flat_ids, seq_lens, comp_lens, first_predictor, seq_lens, offsets=_model_offsets(samples)
    )
    return _finish(samples, indices, ints, int(seq_lens.max()), device, PackedBatch, {})


def _pack_shared_prefix(samples, indices, device) -> PrefixPackedBatch:
    groups = _group_members(samples)
    order = [i for members in groups for i in members]  # sequences become group-contiguous
    samples = [samples[i] for i in order]
    indices = [indices[i] for i in order]
    spans, flat_ids, cursor, k = [], [], 0, 0
    for members in groups:
        prompt = samples[k].prompt.ids
        comps = [samples[k + j].completion.ids for j in range(len(members))]
        lens = [len(c) for c in comps]
        starts = tuple(itertools.accumulate([cursor + len(prompt), *lens[:-1]]))
        spans.append(GroupSpan(cursor, len(prompt), starts, tuple(lens)))
        flat_ids.extend(prompt)
        for c in comps:
            flat_ids.extend(c)
        cursor += len(prompt) + sum(lens)
        k += len(members)
    layout = PrefixLayout(tuple(spans), cursor)
    comp_lens = [n for g in spans for n in g.completion_lens]
    comp_starts = torch.tensor([s for g in spans for s in g.completion_starts])
    prompt_lens = torch.tensor([g.prompt_len for g in spans for _ in g.completion_lens])
    prompt_last = torch.tensor(
        [g.prompt_start + g.prompt_len - 1 for g in spans for _ in g.completion_lens]
    )
    # segments in row order: prompt, completions...; positions continue from the prompt
    seg_lens = torch.tensor([n for g in spans for n in (g.prompt_len, *g.completion_lens)])
    seg_pos0 = torch.tensor(
        [p for g in spans for p in (0, *[g.prompt_len] * len(g.completion_lens))]
    )
    ints = _index_tensors(
        flat_ids,
        seg_lens,
        comp_lens,
        prompt_last,
        prompt_lens + torch.tensor(comp_lens),
        seg_pos0=seg_pos0,
        comp_starts=comp_starts,
        offsets=_model_offsets(samples),
    )
    max_len = int((prompt_lens + torch.tensor(comp_lens)).max())
    return _finish(samples, indices, ints, max_len, device, PrefixPackedBatch, {"prefix": layout})


def _model_offsets(samples: list[RolloutSample]) -> list[list[int]] | None:
    """Per sample, the offsets in its completion of the tokens it is trained on: all of
    them (single-turn), or a multi-turn trajectory's model tokens; None when no sample is
    multi-turn (the offsets are then 0..R-1 and are built with tensor ops)."""
    if all(s.completion.trajectory is None for s in samples):
        return None
    return [
        list(range(len(s.completion.ids)))
        if s.completion.trajectory is None
        else s.completion.trajectory.model_offsets()
        for s in samples
    ]


def _index_tensors(
    flat_ids,
    seg_lens,
    comp_lens,
    first_predictor,
    logical_lens,
    *,
    seg_pos0=None,
    comp_starts=None,
    offsets=None,
) -> dict[str, Tensor]:
    """Row-level int64 tensors; `first_predictor[s]` predicts sequence s's first completion
    token. `offsets` (`_model_offsets`): the completion tokens that get a target; an
    environment's tokens between them are context, like the prompt."""
    n = len(flat_ids)
    input_ids = torch.tensor(flat_ids, dtype=torch.int64)
    seg_starts = torch.cumsum(seg_lens, 0) - seg_lens
    pos0 = torch.zeros_like(seg_lens) if seg_pos0 is None else seg_pos0
    position_ids = torch.arange(n) - torch.repeat_interleave(seg_starts - pos0, seg_lens)
    if offsets is None:
        comp = torch.tensor(comp_lens, dtype=torch.int64)  # (S,)
        offset = torch.arange(int(comp.sum())) - torch.repeat_interleave(
            torch.cumsum(comp, 0) - comp, comp
        )
    else:  # multi-turn: the model tokens' offsets in their completion
        comp = torch.tensor([len(o) for o in offsets], dtype=torch.int64)
        offset = torch.tensor(_concat(offsets), dtype=torch.int64)
    token_seq = torch.repeat_interleave(torch.arange(comp.numel()), comp)  # (T,)
    if comp_starts is None:  # plain rows: completion token t-1 sits right before token t
        completion_index = first_predictor[token_seq] + offset
    else:  # shared prefix: token 0 of every completion is predicted by the prompt's last position
        # (a trajectory's first token is always a model token: offset 0)
        completion_index = torch.where(
            offset == 0, first_predictor[token_seq], comp_starts[token_seq] + offset - 1
        )
    targets = (
        input_ids[completion_index + 1]
        if comp_starts is None
        else input_ids[comp_starts[token_seq] + offset]
    )
    cu = torch.zeros(logical_lens.numel() + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(logical_lens, 0)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "cu_seqlens": cu,
        "completion_index": completion_index,
        "targets": targets,
        "token_seq": token_seq,
        "completion_lens": comp,
    }


def _finish(samples, indices, ints, max_len, device, cls, extra) -> PackedBatch:
    """Add per-sequence fields and move everything in one int64 and one float32 transfer."""
    ints["sample_index"] = torch.tensor(indices, dtype=torch.int64)
    ints["versions"] = torch.tensor([s.completion.version for s in samples], dtype=torch.int64)
    ints["truncated"] = torch.tensor([s.truncated for s in samples], dtype=torch.int64)
    floats = {
        "advantages": torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32),
        "behaviour_logprobs": torch.tensor(
            _concat(s.completion.logprobs for s in samples),
            dtype=torch.float32,
        ),
    }
    ints, floats = _transfer(ints, device), _transfer(floats, device)
    routes = packed_routes(
        [s.completion.routes for s in samples],
        lambda i: f"sample {indices[i]} (group {samples[i].group_id})",
    )
    return cls(
        input_ids=ints["input_ids"].view(1, -1),
        position_ids=ints["position_ids"].view(1, -1),
        cu_seqlens=ints["cu_seqlens"].to(torch.int32),
        max_seqlen=max_len,
        completion_index=ints["completion_index"],
        targets=ints["targets"],
        token_seq=ints["token_seq"],
        completion_lens=ints["completion_lens"],
        sample_index=ints["sample_index"],
        advantages=floats["advantages"],
        truncated=ints["truncated"].bool(),
        behaviour_logprobs=floats["behaviour_logprobs"],
        versions=ints["versions"],
        routes=None if routes is None else routes.to(device or routes.device, non_blocking=True),
        **extra,
    )


def _concat(lists) -> list:
    """One flat list; the per-token copying happens in C, not in a Python loop."""
    return list(itertools.chain.from_iterable(lists))


def _transfer(tensors: dict[str, Tensor], device) -> dict[str, Tensor]:
    """Concatenate same-dtype 1-D tensors, move them in one copy, split them back (views)."""
    if device is None or torch.device(device).type == "cpu":
        return tensors
    sizes = [t.numel() for t in tensors.values()]
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    if torch.cuda.is_available():
        flat = flat.pin_memory()
    parts = flat.to(device, non_blocking=True).split(sizes)
    return dict(zip(tensors.keys(), parts))


def _check_samples(samples: list[RolloutSample], sample_indices: list[int] | None) -> None:
    if not samples:
        raise ValueError("pack_samples got no samples; plan micro-batches over a non-empty batch.")
    if sample_indices is not None and len(sample_indices) != len(samples):
        raise ValueError(
            f"pack_samples got {len(sample_indices)} sample_indices for {len(samples)} samples; "
            "pass one index per sample (or none)."
        )
    for i, s in enumerate(samples):
        if not s.prompt.ids or not s.completion.ids:
            raise ValueError(
                f"sample {i} (group {s.group_id}) has an empty prompt or completion; "
                "drop empty completions before packing (nothing to score)."
            )
        trajectory = s.completion.trajectory
        if trajectory is not None and sum(n for n, _ in trajectory.segments) != len(
            s.completion.ids
        ):
            raise ValueError(
                f"sample {i} (group {s.group_id}) has {len(s.completion.ids)} completion ids but "
                f"segments of {sum(n for n, _ in trajectory.segments)}; the segments must cover the ids."
            )
        if len(s.completion.logprobs) != s.completion.num_model_tokens:
            raise ValueError(
                f"sample {i} (group {s.group_id}) has {s.completion.num_model_tokens} model tokens but "
                f"{len(s.completion.logprobs)} behaviour log-probs; the engine must return one per token."
            )


def _group_members(samples: list[RolloutSample]) -> list[list[int]]:
    """Sample indices per group_id, groups in order of first appearance; prompts must match."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group_id, []).append(i)
    for gid, members in groups.items():
        first = samples[members[0]].prompt.ids
        if any(samples[i].prompt.ids != first for i in members[1:]):
            raise ValueError(
                f"group {gid} mixes different prompt ids, so its prompt cannot be shared; "
                "give each prompt its own group_id or pack with shared_prefix=False."
            )
    return list(groups.values())


def unpack_per_sample(values_T: Tensor, batch: PackedBatch) -> list[Tensor]:
    """Split per-completion-token values (T, ...) into one tensor per sequence (host sync)."""
    if values_T.shape[0] != batch.num_completion_tokens:
        raise ValueError(
            f"unpack_per_sample got {values_T.shape[0]} values for a batch with "
            f"{batch.num_completion_tokens} completion tokens; pass one value per completion token."
        )
    return list(values_T.split(batch.completion_lens.tolist()))


# ----------------------------------------------------------------------- micro-batches


def plan_micro_batches(
    seq_lens: list[int],
    token_budget: int,
    balance: Balance = "tokens",
    groups: list[list[int]] | None = None,
    prompt_lens: list[int] | None = None,
) -> list[list[int]]:
    """Split sequence indices into micro-batches of at most `token_budget` real tokens.

    `groups` (lists of indices) are kept whole while they fit the budget; with
    `prompt_lens` (one per group) a group is costed as a shared-prefix unit: its prompt
    counted once. A group over the budget is split into chunks that fit, each costed with
    its prompt once (see the module docstring); only a single sequence longer than the
    budget gets a micro-batch of its own over it. Deterministic: ties break by index.
    """
    if token_budget < 1:
        raise ValueError(
            f"token_budget must be >= 1 (got {token_budget}); set train.micro_batch_tokens."
        )
    units, tokens, costs = _units(seq_lens, groups, prompt_lens, balance, token_budget)
    order = sorted(range(len(units)), key=lambda u: (-costs[u], -tokens[u], u))
    num_bins = _first_fit_decreasing_bins(tokens, order, token_budget)
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    bin_tokens, bin_cost = [0] * num_bins, [0.0] * num_bins
    for u in order:
        fits = [
            b for b in range(len(bins)) if not bins[b] or bin_tokens[b] + tokens[u] <= token_budget
        ]
        if not fits:
            bins.append([])
            bin_tokens.append(0)
            bin_cost.append(0.0)
            fits = [len(bins) - 1]
        b = min(fits, key=lambda i: (bin_cost[i], i))
        bins[b].append(u)
        bin_tokens[b] += tokens[u]
        bin_cost[b] += costs[u]
    plan = [sorted(i for u in b for i in units[u]) for b in bins if b]
    return sorted(plan, key=lambda mb: mb[0])


def _units(
    seq_lens, groups, prompt_lens, balance, token_budget
) -> tuple[list[list[int]], list[int], list[float]]:
    if any(n < 1 for n in seq_lens):
        raise ValueError(
            "plan_micro_batches got a sequence length < 1; every sequence needs tokens."
        )
    if balance not in ("tokens", "attention"):
        raise ValueError(f"balance must be 'tokens' or 'attention' (got {balance!r}).")
    units = [[i] for i in range(len(seq_lens))] if groups is None else [list(g) for g in groups]
    covered = sorted(i for u in units for i in u)
    if covered != list(range(len(seq_lens))):
        raise ValueError("plan_micro_batches: groups must cover every sequence index exactly once.")
    if prompt_lens is not None and (groups is None or len(prompt_lens) != len(units)):
        raise ValueError(
            "plan_micro_batches: prompt_lens needs groups, one prompt length per group."
        )
    shared = [0] * len(units) if prompt_lens is None else list(prompt_lens)
    units, shared = _split_over_budget(units, shared, seq_lens, token_budget)
    tokens = [sum(seq_lens[i] for i in u) - (len(u) - 1) * p for u, p in zip(units, shared)]
    if balance == "tokens":
        costs = [float(t) for t in tokens]
    else:  # attention work ~ sum of squared lengths; a shared prompt's square is paid once
        costs = [
            float(sum(seq_lens[i] ** 2 for i in u) - (len(u) - 1) * p * p)
            for u, p in zip(units, shared)
        ]
    return units, tokens, costs


def _split_over_budget(
    units: list[list[int]], shared: list[int], seq_lens: list[int], budget: int
) -> tuple[list[list[int]], list[int]]:
    """Units over the budget cut into chunks of the same group that fit (first fit
    decreasing over its sequences, each chunk holding the shared prompt once)."""
    out_units, out_shared = [], []
    for unit, prompt in zip(units, shared):
        if sum(seq_lens[i] for i in unit) - (len(unit) - 1) * prompt <= budget:
            out_units.append(unit)
            out_shared.append(prompt)
            continue
        chunks: list[list[int]] = []
        loads: list[int] = []  # tokens of each chunk, its prompt once
        for i in sorted(unit, key=lambda i: (-seq_lens[i], i)):
            own = seq_lens[i] - prompt  # what the sequence adds to a chunk holding the prompt
            fit = next((c for c, load in enumerate(loads) if load + own <= budget), None)
            if fit is None:
                chunks.append([i])
                loads.append(seq_lens[i])
            else:
                chunks[fit].append(i)
                loads[fit] += own
        out_units.extend(sorted(c) for c in chunks)
        out_shared.extend([prompt] * len(chunks))
    return out_units, out_shared


def _first_fit_decreasing_bins(tokens: list[int], order: list[int], budget: int) -> int:
    loads: list[int] = []
    for u in sorted(order, key=lambda u: (-tokens[u], u)):
        for b, load in enumerate(loads):
            if load + tokens[u] <= budget:
                loads[b] += tokens[u]
                break
        else:
            loads.append(tokens[u])
    return max(1, len(loads))


def packing_metrics(
    seq_lens: list[int],
    plan: list[list[int]],
    balance: Balance = "tokens",
    packed_tokens: list[int] | None = None,
) -> dict[str, float]:
    """What packing saved: the padding the padded layout would have had, and the balance.

    `packed_tokens` (per micro-batch) overrides the real-token count (shared prefix rows).
    """
    real = [sum(seq_lens[i] for i in mb) for mb in plan]
    padded = [len(mb) * max(seq_lens[i] for i in mb) for mb in plan]
    cost = real if balance == "tokens" else [sum(seq_lens[i] ** 2 for i in mb) for mb in plan]
    tokens = real if packed_tokens is None else packed_tokens
    return {
        "packing/padding_ratio_avoided": 1.0 - sum(real) / max(1, sum(padded)),
        "packing/padding_ratio": 0.0,
        "packing/tokens": float(sum(tokens)),
        "packing/micro_batches": float(len(plan)),
        "packing/balance": max(cost) / max(1, min(cost)) if cost else 1.0,  # no micro-batch
    }
