"""Context parallelism in one process: each rank of a context-parallel group is a thread
(support/context.py), the all-to-all and the sum a local exchange between them, and
everything else the ranks' own code (ops/context_parallel, model/scoring.py, the trainer's
passes and step). Against one process on the same batch: values and every gradient.

- the row over a group: equal contiguous shards, the padding segment in both layouts,
  which completion tokens a shard scores (a shard's last position predicts the next
  shard's first token);
- Ulysses attention alone against the whole row's kernel (C = 2 and 4; key/value heads
  fewer than, equal to and more than C; plain and shared-prefix rows);
- scoring at the boundary cases: a sequence longer than a shard that straddles its
  boundary, a shard of prompt only (no token to score), shards of padding only (a row
  shorter than C), a row C does not divide;
- one optimizer step (plan, old/reference passes, loss, clipped gradients) for every loss
  type on plain, shared-prefix and multi-turn rows, beta > 0 and IS correction, C = 2 on
  the demo model (2 query heads, 1 key/value head: replicated) and C = 4 on a 4-head model;
- the refusals: a split reaching attention without packed kwargs, models whose attention
  the split cannot reach (a padded view, a layer mixing tokens outside the attention
  function, heads C does not divide).
The same paths on real ranks (gloo, FSDP2) are tests/distributed/test_context_parallel.py.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from support.configs import DEMO_MODEL
from support.context import cp_config, cp_samples, one_step, run_ranks, simulated_step
from support.models import make_tiny_model
from support.samples import make_samples

from leangrpo.contracts import Completion, Prompt, RolloutSample, SamplingParams
from leangrpo.distributed.mesh import ContextParallelError, ParallelMesh, check_splittable
from leangrpo.distributed.strategy import shard_on_mesh
from leangrpo.model.policy import build_policy
from leangrpo.model.scoring import PackedScorer, score
from leangrpo.ops.attention import adapter
from leangrpo.ops.attention.adapter import (
    CONTEXT_KWARG,
    PREFIX_KWARG,
    enable_packed_attention,
    register_packed_attention,
)
from leangrpo.ops.attention.kernels import PackedAttentionError
from leangrpo.ops.context_parallel.shards import RowShards, padded_row_kwargs, shard_row
from leangrpo.ops.context_parallel.ulysses import Ulysses, kv_repeats
from leangrpo.train.packing import pack_samples

LOGPROBS = SimpleNamespace(chunked=True, row_tile=4, vocab_tile=16)


def close(got, want, rtol=1e-4):
    """fp32 agreement: ranks run the kernels on other head groups (other SDPA batching)."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6 + rtol * scale)


def sample(prompt_len: int, completion_len: int, group: int = 0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, 60, (prompt_len,), generator=g).tolist()
    ids = torch.randint(2, 60, (completion_len,), generator=g).tolist()
    completion = Completion(ids, "", [-1.0] * completion_len, "stop", 0)
    return RolloutSample(group, Prompt(group, "", prompt), completion, advantage=1.0)


# ---------------------------------------------------------------- the row over a group


def test_rows_pad_to_equal_contiguous_shards():
    assert [RowShards(13, 4).bounds(r) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert (RowShards(13, 4).padded, RowShards(13, 4).padding) == (16, 3)
    assert RowShards(12, 4).padding == 0 and RowShards(12, 4).per_rank == 3
    assert RowShards(3, 8).per_rank == 1 and RowShards(3, 8).padding == 5  # shards of padding
    with pytest.raises(ValueError, match="outside"):
        RowShards(8, 2).bounds(2)


def test_a_shards_last_position_predicts_the_next_shards_first_token():
    batch = pack_samples([sample(3, 9)])  # 12 tokens: shards [0, 6) and [6, 12)
    shards = RowShards(12, 2)
    rows = [shard_row(batch, shards, r, {}) for r in range(2)]
    # completion token t (row position 3 + t) is predicted by position 2 + t
    assert rows[0].tokens.tolist() == [0, 1, 2, 3] and rows[1].tokens.tolist() == [4, 5, 6, 7, 8]
    assert rows[0].completion_index.tolist() == [2, 3, 4, 5]  # positions 2..5 of shard 0
    assert rows[1].completion_index.tolist() == [0, 1, 2, 3, 4]  # positions 6..10
    # shard 0's last position (5) predicts the token at 6: shard 1's first
    assert int(rows[0].targets[-1]) == int(batch.input_ids[0, 6]) == int(rows[1].input_ids[0, 0])
    assert torch.equal(torch.cat([r.targets for r in rows]), batch.targets)
    prompt_only = [
        shard_row(pack_samples([sample(10, 2)]), RowShards(12, 2), r, {}) for r in (0, 1)
    ]
    assert prompt_only[0].tokens.numel() == 0 and prompt_only[1].tokens.tolist() == [0, 1]


def test_padding_is_a_segment_of_its_own_in_both_layouts():
    samples = make_samples([(3, [2, 4]), (2, [1])], vocab=32)  # 15 tokens plain, 12 shared
    plain = pack_samples(samples)
    kwargs = padded_row_kwargs(plain, RowShards(plain.num_tokens, 4))  # 15 -> 16
    assert kwargs["cu_seq_lens_q"].tolist() == [*plain.cu_seqlens.tolist(), 16]
    assert kwargs["max_length_q"] == plain.max_seqlen
    prefixed = pack_samples(samples, shared_prefix=True)
    layout = padded_row_kwargs(prefixed, RowShards(prefixed.num_tokens, 5))[PREFIX_KWARG]
    assert layout.num_tokens == 15 and layout.groups[:-1] == prefixed.prefix.groups
    pad = layout.groups[-1]  # a group with a prompt and no completion
    assert (pad.prompt_start, pad.prompt_len, pad.completion_lens) == (12, 3, ())
    short = shard_row(pack_samples([sample(2, 1)]), RowShards(3, 4), 3, {})  # padding only
    assert short.input_ids.tolist() == [[0]] and short.position_ids.tolist() == [[0]]
    assert short.tokens.numel() == 0


def test_key_value_heads_are_repeated_to_split_evenly():
    assert [kv_repeats(k, 4) for k in (1, 2, 4, 8, 3)] == [4, 2, 1, 1, 4]
    assert kv_repeats(1, 2) == 2 and kv_repeats(6, 4) == 2


# ------------------------------------------------------------------- attention alone


@pytest.mark.parametrize("prefix", [False, True], ids=["plain", "shared-prefix"])
@pytest.mark.parametrize("size, kv_heads", [(2, 1), (2, 4), (4, 1), (4, 2), (4, 8)])
def test_ulysses_attention_equals_the_whole_rows_kernel(size, kv_heads, prefix):
    register_packed_attention("sdpa_segments", "cpu")
    heads = 8
    batch = pack_samples(
        make_samples([(5, [3, 1, 7]), (9, [2, 4]), (1, [1])]), shared_prefix=prefix
    )
    shards = RowShards(batch.num_tokens, size)
    kwargs = padded_row_kwargs(batch, shards)
    n = shards.padded
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 8, generator=g) for h in (heads, kv_heads, kv_heads))
    weight = torch.randn(1, n, heads, 8, generator=g)

    def run(q, k, v):
        cu, layout = kwargs.get("cu_seq_lens_q"), kwargs.get(PREFIX_KWARG)
        return adapter._run_packed(q, k, v, cu, kwargs.get("max_length_q"), layout, 0.3, 0.0)

    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = run(*whole)
    (want * weight).sum().backward()

    def rank(c, exchange):
        a, b = shards.bounds(c)
        mine = [t[:, :, a:b].clone().requires_grad_() for t in (q, k, v)]
        out = Ulysses(exchange, c, size).attend(*mine, run)
        (out * weight[:, a:b]).sum().backward()
        return out.detach(), [t.grad for t in mine]

    parts = run_ranks(size, rank)
    close(torch.cat([out for out, _ in parts], dim=1), want.detach(), rtol=1e-5)
    for i, tensor in enumerate(whole):
        close(torch.cat([grads[i] for _, grads in parts], dim=2), tensor.grad, rtol=1e-5)


# ------------------------------------------------------------- scoring at the boundaries


BOUNDARY_ROWS = {  # (prompt, completion) per sequence, context-parallel size
    "a sequence longer than a shard, straddling it": ([(3, 9)], 2),
    "a shard of prompt only": ([(10, 2)], 2),
    "shards of padding only (a row shorter than C)": ([(2, 1)], 4),
    "a row C does not divide": ([(4, 5), (2, 2)], 4),
    "many sequences, several boundaries": ([(3, 4), (5, 1), (2, 7), (4, 3)], 4),
}


@pytest.mark.parametrize("prefix", [False, True], ids=["plain", "shared-prefix"])
@pytest.mark.parametrize("case", list(BOUNDARY_ROWS))
def test_split_scoring_equals_one_process_at_the_boundaries(case, prefix):
    split_scoring_equals_one_process("qwen2", case, prefix)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_other_architectures_split_alike(arch):
    """Llama (no q/k/v bias), Qwen3 (per-head q/k norms before attention), Mistral."""
    split_scoring_equals_one_process(arch, "many sequences, several boundaries", prefix=True)


def split_scoring_equals_one_process(arch: str, case: str, prefix: bool) -> None:
    spec, size = BOUNDARY_ROWS[case]
    model = make_tiny_model(arch, num_attention_heads=4, num_key_value_heads=2).train()
    enable_packed_attention(model, "sdpa_segments")
    samples = [sample(p, c, group=0 if prefix else i, seed=i) for i, (p, c) in enumerate(spec)]
    if prefix:  # one group sharing the first prompt
        samples = [
            RolloutSample(0, samples[0].prompt, s.completion, advantage=1.0) for s in samples
        ]
    batch = pack_samples(samples, shared_prefix=prefix)
    params = SamplingParams(temperature=0.7, top_k=20)
    weight = torch.linspace(-1.0, 2.0, batch.num_completion_tokens)

    def loss(lp, entropy):
        return (torch.where(torch.isinf(lp), 0.0, lp) * weight).sum() + (entropy * weight).sum()

    one = copy.deepcopy(model)
    want_lp, want_entropy = score(one, batch, params, LOGPROBS, with_entropy=True)
    loss(want_lp, want_entropy).backward()
    copies = [copy.deepcopy(model) for _ in range(size)]

    def rank(c, exchange):
        scorer = PackedScorer(copies[c], Ulysses(exchange, c, size))
        lp, entropy = scorer(batch, params, LOGPROBS, with_entropy=True)
        loss(lp, entropy).backward()
        return lp.detach(), entropy.detach()

    for lp, entropy in run_ranks(size, rank):  # every rank holds the whole row's values
        close(lp, want_lp.detach(), rtol=1e-5)
        close(entropy, want_entropy.detach(), rtol=1e-5)
    for name, p in one.named_parameters():  # the group's gradients add up to one process's
        total = sum(dict(c.named_parameters())[name].grad for c in copies)
        close(total, p.grad)


# ----------------------------------------------------------------- one optimizer step


LOSSES = {
    "grpo": {"type": "grpo", "is_mode": "token_mask"},
    "bnpo": {"type": "bnpo"},
    "dr_grpo": {"type": "dr_grpo", "mask_truncated_completions": True},
    "dapo": {"type": "dapo", "is_mode": "sequence_truncate"},
    "gspo": {"type": "gspo", "is_mode": "sequence_mask"},
    "cispo": {"type": "cispo", "epsilon_high": 5.0},
}


@pytest.fixture(scope="module")
def demo_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)


def policy_of(base, cfg):
    torch.manual_seed(0)
    policy = build_policy(copy.deepcopy(base), cfg, None, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for name, p in sorted(policy.model.named_parameters()):
        if "lora_B" in name:  # adapters away from 0, so their gradients flow
            p.data.normal_(0, 0.05, generator=g)
    return policy


def assert_step_equal(got: dict, want: dict) -> None:
    assert got["micro_batches"] == want["micro_batches"]
    assert sorted(got["passes"]) == sorted(want["passes"]) and want["passes"]
    for key, values in want["passes"].items():
        close(got["passes"][key], values, rtol=1e-5)
    assert sorted(got["grads"]) == sorted(want["grads"]) and want["grads"]
    for name, grad in want["grads"].items():
        close(got["grads"][name], grad)
    for name, value in want["metrics"].items():
        assert got["metrics"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


# every loss type on the most involved layout (multi-turn trajectories sharing their
# prompt), the other layouts once (the loss runs on the gathered (T,) vectors whatever the
# layout, the split on the row whatever the loss; tests/distributed/test_context_parallel.py
# runs each loss type on real ranks too)
STEP_CASES = [(loss, "multi-turn+prefix") for loss in LOSSES]
STEP_CASES += [("grpo", "plain"), ("dapo", "shared-prefix"), ("gspo", "multi-turn")]


@pytest.mark.parametrize("loss, layout", STEP_CASES)
def test_a_context_parallel_step_equals_one_process(demo_model, loss, layout):
    """C = 2 on the demo model (its one key/value head replicated); mu = 2 (old pass) and
    beta > 0 (reference pass); every rank of the group ends with the same figures."""
    sections = {
        "loss": {**LOSSES[loss], "mu": 2, "beta": 0.04},
        "packing": {"shared_prefix": "on" if "prefix" in layout else "off"},
    }
    samples = cp_samples(multiturn=layout.startswith("multi-turn"))
    want = one_step(
        policy_of(demo_model, cp_config(DEMO_MODEL, 1, **sections)),
        samples,
        cp_config(DEMO_MODEL, 1, **sections),
    )
    cfg = cp_config(DEMO_MODEL, 2, **sections)
    ranks = simulated_step(policy_of(demo_model, cfg), samples, cfg, 2)
    for got in ranks:
        assert_step_equal(got, want)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_four_ranks_split_a_four_head_model(lora, tmp_path):
    """C = 4 (two key/value heads, each repeated twice), LoRA and full fine-tuning, a
    shared prefix and multi-turn rows; short rows leave shards of padding only."""
    model = make_tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    sections = {"loss": {"type": "grpo", "mu": 2, "beta": 0.04},
                "packing": {"shared_prefix": "on"},
                "train": {"micro_batch_tokens": 31}}  # fmt: skip
    if lora:
        sections["lora"] = {"enabled": True, "r": 4, "alpha": 8}
    samples = cp_samples(multiturn=True)
    want = one_step(
        policy_of(model, cp_config(tmp_path, 1, **sections)),
        samples,
        cp_config(tmp_path, 1, **sections),
    )
    cfg = cp_config(tmp_path, 4, **sections)
    ranks = simulated_step(policy_of(model, cfg), samples, cfg, 4)
    for got in ranks:
        assert_step_equal(got, want)


# ------------------------------------------------------------------------- refusals


def test_a_split_without_packed_kwargs_is_refused():
    model = make_tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)
    enable_packed_attention(model, "sdpa_segments")
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(PackedAttentionError, match="without packed kwargs"):
        model.model(input_ids=ids, use_cache=False, **{CONTEXT_KWARG: object()})


class OpaqueLM(torch.nn.Module):
    """A backbone whose attention is its own (outside transformers' interface)."""

    config = SimpleNamespace(num_attention_heads=2, num_hidden_layers=1)

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)

    def forward(self, input_ids, position_ids=None, attention_mask=None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        x = self.embed(input_ids)
        return BaseModelOutput(last_hidden_state=x.cumsum(1))


def test_models_whose_attention_the_split_cannot_reach_are_refused():
    mesh = ParallelMesh(data_size=1, context_size=2, data_rank=0, context_rank=0)
    model = make_tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=1)
    enable_packed_attention(model, "sdpa_segments")
    line = check_splittable(model, mesh)
    assert "1 key/value heads" in line and "replicated 2x" in line
    assert "fewer than" in line

    three = ParallelMesh(1, 3, 0, 0)
    with pytest.raises(ContextParallelError, match="4 query heads cannot be split over 3"):
        check_splittable(model, three)
    policy = SimpleNamespace(model=model, teacher=None)
    for rank in (0, 1):  # under torchrun every rank refuses alike; rank 0 alone prints it
        with pytest.raises(ContextParallelError) as refused:
            shard_on_mesh(policy, dist_cfg=None, ctx=SimpleNamespace(rank=rank), mesh=three,
                          engine_copy=False)  # fmt: skip
        assert refused.value.shown_by_rank_0 is (rank > 0)

    mixing = make_tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)
    layer = mixing.model.layers[1].self_attn

    def elsewhere(hidden_states, *args, **kwargs):  # mixes tokens without the interface
        return hidden_states.cumsum(1), None

    layer.forward = elsewhere
    enable_packed_attention(mixing, "sdpa_segments")
    with pytest.raises(ContextParallelError, match="only 1 of its 2 decoder layers"):
        check_splittable(mixing, mesh)

    opaque = OpaqueLM()
    enable_packed_attention(opaque, "sdpa_segments")
    with pytest.raises(
        ContextParallelError,
        match="OpaqueLM cannot be context-parallel: its attention does not receive",
    ):
        check_splittable(opaque, mesh)
