"""The hf engine's turn stream (rollout/hf/turns.py): turns join and leave the continuous
batch between decode steps; a trajectory's KV cache is kept between its turns and gives the
log-probs of a full prefill; a tiny cache budget evicts and recomputes and still makes the
same trajectories; in the batch-invariant mode (one row per forward) trajectories are
bitwise independent of when and with whom their turns ran."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from support.configs import DEMO_MODEL
from support.models import make_tiny_model
from support.references import teacher_forced_logprobs
from transformers import AutoTokenizer

from leangrpo.contracts import EngineVersionError, SamplingParams, TurnRequest
from leangrpo.rollout.hf.engine import HFEngine

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=99, seed=None)  # neither is read
ENV = [7, 8, 9, 10, 11]  # the "environment's" segment after each turn (prefix varies)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="module")
def model(tokenizer):
    model = make_tiny_model(vocab_size=len(tokenizer), seed=3)
    head = model.get_output_embeddings()  # an EOS bias: turns end at different lengths
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[tokenizer.eos_token_id] = 2.5
    model.set_output_embeddings(biased)
    return model


STARTS = [[5, 6, 12, 13, 14], [20, 21], [30, 31, 2, 3, 4, 25, 26, 27], [28], [29, 22, 23]]


def trajectories(engine, *, turns=3, budget=12, latency=None, rounds=False, order=None, seed=0):
    """Several trajectories of `turns` turns through one stream: after each turn the
    environment's segment (ENV, cut by the turn index) is appended. `latency`: per turn,
    how many advance calls the "environment" takes (random); `rounds`: turns wait for
    every live trajectory's turn. Returns each trajectory's turns and the stream's stats."""
    rng = random.Random(seed)
    order = order or list(range(len(STARTS)))
    ids = {k: list(STARTS[k]) for k in order}
    out: dict[int, list] = {k: [] for k in order}
    waiting: dict[int, int] = {}  # key -> advance calls left before its next turn
    with engine.open_turns(PARAMS, 0) as stream:
        for k in order:
            stream.submit(request(k, ids[k], len(out[k]), budget))
        while stream.pending() or waiting:
            for req, c in stream.advance():
                k = req.key
                out[k].append(c)
                if len(out[k]) < turns and c.finish_reason == "stop":
                    ids[k] = ids[k] + c.ids + ENV[len(out[k]) :]
                    waiting[k] = rng.randint(0, 6) if latency else 0
                else:
                    stream.release(k)
            if rounds and stream.pending():
                continue  # a round ends when every turn of it is done
            for k in sorted(waiting, key=order.index):
                waiting[k] -= 1
                if waiting[k] < 0:
                    del waiting[k]
                    stream.submit(request(k, ids[k], len(out[k]), budget))
        stats = stream.metrics()
    return out, stats


def request(key: int, ids: list[int], turn: int, budget: int) -> TurnRequest:
    return TurnRequest(list(ids), 1000 + 10 * key + turn, budget, key)


def tokens(out):
    return {k: [c.ids for c in turns] for k, turns in out.items()}


def test_a_kept_cache_gives_the_logprobs_of_a_full_prefill(model, tokenizer):
    kept, stats = trajectories(HFEngine(model, tokenizer))
    assert stats["prefill_tokens_saved"] > 0 and stats.get("cache_misses", 0) == 0
    assert sum(len(t) for t in kept.values()) > len(STARTS)  # later turns ran on kept caches
    recomputed, full = trajectories(HFEngine(model, tokenizer, kv_cache_tokens=40))
    assert (
        full["cache_evictions"] > 0 and full["prefill_tokens_saved"] < stats["prefill_tokens_saved"]
    )
    assert tokens(kept) == tokens(recomputed)
    for k, turns in kept.items():
        ids = list(STARTS[k])
        for i, (a, b) in enumerate(zip(turns, recomputed[k])):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-5, rtol=0
            )
            expected = teacher_forced_logprobs(model, ids, a.ids, PARAMS)
            torch.testing.assert_close(torch.tensor(a.logprobs), expected, atol=2e-5, rtol=0)
            ids = ids + a.ids + ENV[i + 1 :]


def test_turns_join_and_leave_between_steps_and_sample_as_they_would_alone(model, tokenizer):
    """Random 'environment latencies': turns join a running batch at other steps; each
    trajectory is what it is alone (tokens; log-probs within float rounding of its batch)."""
    together, stats = trajectories(HFEngine(model, tokenizer), latency=True, seed=1)
    assert stats["prefills_beside_decoding"] >= 3  # turns joined while others decoded
    for k in range(len(STARTS)):
        alone, _ = trajectories(HFEngine(model, tokenizer, max_batch_size=1), order=[k])
        assert tokens(alone)[k] == tokens(together)[k]
        for a, b in zip(alone[k], together[k]):
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-5, rtol=0
            )


@pytest.mark.exact
def test_one_row_per_forward_is_bitwise_whatever_the_schedule(model, tokenizer):
    """The batch-invariant mode: per-trajectory timing, rounds, another submission order,
    all the same bits."""
    engine = HFEngine(model, tokenizer, max_batch_size=1)
    reference, _ = trajectories(engine, rounds=True)
    for kwargs in (
        {"latency": True, "seed": 2},
        {"latency": True, "seed": 3, "order": [4, 2, 0, 3, 1]},
    ):
        other, _ = trajectories(engine, **kwargs)
        for k in reference:
            assert [(c.ids, c.logprobs) for c in other[k]] == [
                (c.ids, c.logprobs) for c in reference[k]
            ]


def test_the_budget_bounds_the_batch_and_the_kept_caches(model, tokenizer, monkeypatch):
    from leangrpo.rollout.hf import turns as turns_module

    budget, seen = 48, []
    original = turns_module.HFTurnStream.advance

    def watched(self, timeout_s=0.0):
        done = original(self, timeout_s)
        seen.append(self.cache.allocated + self.kept.tokens)
        return done

    monkeypatch.setattr(turns_module.HFTurnStream, "advance", watched)
    out, stats = trajectories(HFEngine(model, tokenizer, kv_cache_tokens=budget), latency=True)
    assert max(seen) <= budget and stats["cache_evictions"] > 0
    assert all(len(t) >= 1 for t in out.values())
    stream = HFEngine(model, tokenizer, kv_cache_tokens=10).open_turns(PARAMS, 0)
    with stream, pytest.raises(ValueError, match="kv_cache_tokens = 10 cannot hold one turn of 14"):
        stream.submit(TurnRequest([1, 2], 1, 12, 0))


def test_an_idle_slot_cache_or_growth_ahead_of_need_never_evicts_a_kept_cache(tokenizer):
    """8 trajectories of 40-token prompts and 20-token turns under a 600-position budget:
    their 8 kept caches (8 x 59) fit it, so the slot cache gives back the rows no turn uses
    rather than evict one when turn 1 ends, and turn 2 evicts only for the rows it needs
    (8 rows of 83 do not fit beside the caches), never for a doubled slot cache."""
    model = make_tiny_model(vocab_size=len(tokenizer), seed=3)
    head = model.get_output_embeddings()
    never_ends = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        never_ends.weight.copy_(head.weight)
        never_ends.bias.zero_()
        never_ends.bias[tokenizer.eos_token_id] = -1e4  # every turn runs to its budget
    model.set_output_embeddings(never_ends)
    ids = {k: [2 + (k * 7 + i) % 29 for i in range(40)] for k in range(8)}
    with HFEngine(model, tokenizer, kv_cache_tokens=600).open_turns(PARAMS, 0) as stream:
        for k in range(8):
            stream.submit(TurnRequest(ids[k], 100 + k, 20, k))
        done = {}
        while stream.pending():
            done.update({r.key: c for r, c in stream.advance()})
        assert stream.stats["cache_evictions"] == 0 and stream.kept.tokens == 8 * 59
        assert stream.cache.allocated + stream.kept.tokens <= 600
        before = dict(stream.stats)
        for k in range(8):
            stream.submit(TurnRequest(ids[k] + done[k].ids + [5, 6, 7], 200 + k, 20, k))
        while stream.pending():
            stream.advance()
        saved = stream.stats["prefill_tokens_saved"] - before.get("prefill_tokens_saved", 0)
        assert saved == 7 * 59  # one kept cache evicted to run 7 of the 8 turns at once


def test_turns_that_join_together_grow_the_slot_cache_once(model, tokenizer, monkeypatch):
    """Without a budget the slot cache is sized for every waiting turn at once: it grew by
    doubling, one copy of the whole cache per doubling (1, 2, 4, ... rows for 33 turns)."""
    from leangrpo.rollout.hf import kv_cache

    sizes = []
    original = kv_cache.SlotCache.resize

    def counted(self, rows, width):
        sizes.append((rows, width))
        return original(self, rows, width)

    monkeypatch.setattr(kv_cache.SlotCache, "resize", counted)
    with HFEngine(model, tokenizer).open_turns(PARAMS, 0) as stream:
        for k in range(33):
            stream.submit(TurnRequest(list(STARTS[k % len(STARTS)]), 1000 + k, 12 + k, k))
        stream.advance()
        assert sizes == [(33, 64)] and stream.stats["prefills"] == 1  # one forward for all
        while stream.pending():
            stream.advance()


def test_a_turn_draws_one_uniform_per_token_from_its_own_seed(tokenizer, monkeypatch):
    """Rows draw their uniforms in blocks; the draws are still the seed's stream, one per
    token, past a block's end, whichever rows share the steps."""
    from leangrpo.rollout.hf import turns as turns_module

    used: list[list[float]] = []
    original = turns_module.sample_next

    def recorded(logits, params, generator, uniforms=None):
        used.append(uniforms[:, 0].tolist())
        return original(logits, params, generator, uniforms)

    monkeypatch.setattr(turns_module, "sample_next", recorded)
    model = make_tiny_model(vocab_size=len(tokenizer), seed=4)
    head = model.get_output_embeddings()
    never_eos = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        never_eos.weight.copy_(head.weight)
        never_eos.bias.zero_()
        never_eos.bias[tokenizer.eos_token_id] = -1e4  # the rows run to their budgets
    model.set_output_embeddings(never_eos)
    budgets = {0: turns_module.DRAW_BLOCK + 6, 1: 9}
    with HFEngine(model, tokenizer).open_turns(PARAMS, 0) as stream:
        for key, budget in budgets.items():
            stream.submit(TurnRequest(list(STARTS[key]), 77 + key, budget, key))
        done = {}
        while stream.pending():
            done.update({r.key: c for r, c in stream.advance()})
    rows = {0: [step[0] for step in used], 1: [step[1] for step in used if len(step) == 2]}
    for key, budget in budgets.items():
        generator = torch.Generator().manual_seed(77 + key)
        expected = [torch.rand(1, generator=generator, dtype=torch.float64).item() for _ in range(budget)]
        assert len(done[key].ids) == budget and rows[key] == expected
    assert len(done[0].ids) > turns_module.DRAW_BLOCK


def test_ids_that_do_not_extend_the_kept_cache_are_prefilled_whole(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    with engine.open_turns(PARAMS, 0) as stream:
        stream.submit(TurnRequest([5, 6, 7], 1, 4, key=0))
        while stream.pending():
            stream.advance()
        stream.submit(TurnRequest([9, 9, 9, 9, 9, 9], 2, 4, key=0))  # another history
        while stream.pending():
            ((_, changed),) = stream.advance() or [(None, None)]
        stats = stream.metrics()
    assert stats["cache_misses"] == 1 and stats["prefill_tokens_saved"] == 0
    (alone,) = engine.generate_turns([TurnRequest([9, 9, 9, 9, 9, 9], 2, 4)], PARAMS, 0)
    assert changed.ids == alone.ids


def test_released_caches_are_dropped(model, tokenizer):
    with HFEngine(model, tokenizer).open_turns(PARAMS, 0) as stream:
        for key in range(3):
            stream.submit(TurnRequest([5, 6, 7 + key], key, 3, key=key))
        while stream.pending():
            stream.advance()
        assert len(stream.kept) == 3
        stream.release(1)
        assert len(stream.kept) == 2 and stream.kept.take(1) is None


def test_a_stream_holds_the_engine_until_it_is_closed(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    with pytest.raises(EngineVersionError, match="holds version 0"):
        engine.open_turns(PARAMS, 1)
    stream = engine.open_turns(PARAMS, 0)  # the failed open released the engine
    started = threading.Event()
    result = []

    def other():
        started.set()
        result.append(engine.generate_turns([TurnRequest([5, 6], 1, 2)], PARAMS, 0))

    thread = threading.Thread(target=other)
    thread.start()
    started.wait(5)
    thread.join(0.3)
    assert thread.is_alive() and not result  # waits for the stream
    stream.close()
    stream.close()  # idempotent
    thread.join(30)
    assert len(result) == 1
    with pytest.raises(RuntimeError, match="closed"):
        stream.submit(TurnRequest([5], 1, 2))


@pytest.mark.parametrize(
    "arch, window",
    [
        ("mistral", {"sliding_window": 4}),  # every layer slides: one windowed mask
        ("qwen3", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4, "use_sliding_window": True}),  # fmt: skip
    ],
)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_sliding_window_layers_see_only_their_window(tokenizer, arch, window, attention):
    """Turns longer than the window, batched and on kept caches, give the log-probs of the
    model's own forward (which masks the sliding layers to their window)."""
    model = make_tiny_model(arch, vocab_size=len(tokenizer), seed=3, **window)
    model.config._attn_implementation = attention
    kept, _ = trajectories(HFEngine(model, tokenizer), turns=2)
    for k, turns in kept.items():
        ids = list(STARTS[k])
        for i, c in enumerate(turns):
            expected = teacher_forced_logprobs(model, ids, c.ids, PARAMS)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=2e-5, rtol=0)
            ids = ids + c.ids + ENV[i + 1 :]
