"""The hf engine's categorical sampler against the distribution it claims to draw from."""

from __future__ import annotations

import math

import pytest
import torch

from leangrpo.contracts import SamplingParams
from leangrpo.rollout.hf.decode import BLOCK, decode, sample_categorical, sample_next
from leangrpo.rollout.sampling import processed_logprobs


def weights_over_blocks() -> torch.Tensor:
    """(V,) weights spanning 3 blocks (the last one padded), with zeros between mass, a
    whole empty block, a tiny weight and mass on the very first and last tokens."""
    vocab = 2 * BLOCK + 90
    w = torch.zeros(vocab)
    w[0], w[5], w[BLOCK - 1], w[2 * BLOCK + 10], w[vocab - 1] = 1.0, 0.5, 2.0, 1e-3, 1.5
    w[BLOCK : 2 * BLOCK : 7] = 0.01  # many small weights in the middle block
    return w


def test_draws_follow_the_weights_and_never_a_zero_weight():
    w = weights_over_blocks()
    draws = 400_000
    gen = torch.Generator().manual_seed(0)
    tokens, total = sample_categorical(w.expand(draws, -1), gen)
    assert torch.allclose(total, w.double().sum().expand(draws))
    counts = torch.bincount(tokens, minlength=w.numel()).double()
    assert counts[w == 0].sum() == 0
    p = w.double() / w.double().sum()
    expected = draws * p
    sigma = (draws * p * (1 - p)).sqrt()
    nonzero = p > 0
    z = (counts[nonzero] - expected[nonzero]).abs() / sigma[nonzero]
    assert z.max() < 5.5, z.max()  # ~80 cells: a correct sampler exceeds 5.5 sigma ~1e-6


def test_rows_draw_independently_and_reproducibly_from_their_generator():
    w = torch.rand(6, 3 * BLOCK + 1)
    a, _ = sample_categorical(w, torch.Generator().manual_seed(1))
    b, _ = sample_categorical(w, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    whole = torch.rand(1, 2 * BLOCK).expand(3, -1)  # whole blocks, not contiguous
    assert sample_categorical(whole, torch.Generator().manual_seed(1))[0].shape == (3,)
    one_hot = torch.full((2, 700), 0.0)
    one_hot[0, 3], one_hot[1, 699] = 1.0, 1e-30  # a lone weight is drawn however small
    tokens, _ = sample_categorical(one_hot, torch.Generator().manual_seed(2))
    assert tokens.tolist() == [3, 699]


@pytest.mark.parametrize("top_k, min_p", [(0, 0.0), (5, 0.0), (0, 0.2)])
def test_sample_next_logprob_is_the_processed_log_softmax(top_k, min_p):
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(3)) * 3
    params = SamplingParams(temperature=0.7, top_k=top_k, min_p=min_p)
    tokens, logprobs = sample_next(logits, params, torch.Generator().manual_seed(4))
    reference = processed_logprobs(logits, tokens, params)  # float32 log_softmax
    assert torch.isfinite(logprobs).all()  # no filtered token is ever drawn
    torch.testing.assert_close(logprobs, reference, atol=1e-5, rtol=0)


def test_non_finite_logits_are_one_clear_error():
    class NaNModel(torch.nn.Module):
        config = None

        def forward(self, input_ids, **kwargs):
            vocab = 10
            out = torch.full((*input_ids.shape, vocab), math.nan)
            return type("Out", (), {"logits": out})()

    tokens, _ = sample_categorical(torch.full((1, 10), math.nan), None)
    assert tokens.tolist() == [-1]
    with pytest.raises(RuntimeError, match="not finite"):
        decode(
            NaNModel(),
            torch.ones(1, 3, dtype=torch.long),
            torch.ones(1, 3, dtype=torch.long),
            SamplingParams(temperature=1.0, max_new_tokens=2),
            1,
            eos_ids={0},
            generator=None,
        )


def test_per_prompt_generators_draw_as_a_call_per_prompt_in_one_batched_sample(monkeypatch):
    """Multi-turn turns carry one generator each: the rows still draw exactly what a call
    per prompt draws, but the sampler runs once over the batch (a call per row cost as
    much as the forward on the tool demo's model)."""
    from leangrpo.rollout.hf import decode as decode_module

    logits = torch.randn(12, 300, generator=torch.Generator().manual_seed(5)) * 2
    params = SamplingParams(temperature=1.0, top_k=40)
    rows, n = [0, 1, 2, 4, 5, 6, 7, 9, 10, 11, 13, 14], 3  # prompt-major, some rows finished
    seeds = [11, 12, 13, 14, 15]
    expected_tokens, expected_lp = [], []
    for prompt in sorted({row // n for row in rows}):
        mine = [i for i, row in enumerate(rows) if row // n == prompt]
        t, lp = sample_next(logits[mine], params, torch.Generator().manual_seed(seeds[prompt]))
        expected_tokens.append(t)
        expected_lp.append(lp)
    calls = []
    real = decode_module.sample_categorical
    monkeypatch.setattr(
        decode_module, "sample_categorical", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    tokens, logprobs = decode_module._sample_rows(logits, params, generators, rows, n)
    assert torch.equal(tokens, torch.cat(expected_tokens))
    assert torch.equal(logprobs, torch.cat(expected_lp))
    assert len(calls) == 1  # one batched draw, not one per prompt
