"""HFEngine: shapes, finish reasons, behaviour log-probs vs a teacher-forced recomputation,
versions, weight updates (full and LoRA), seeding and RNG isolation from the trainer;
sampling.process_logits vs transformers."""

from __future__ import annotations

import pytest
import torch
from support.configs import DEMO_MODEL
from support.models import make_tiny_model
from support.references import teacher_forced_logprobs
from transformers import AutoTokenizer

from leangrpo.contracts import EngineVersionError, Prompt, SamplingParams, TurnRequest
from leangrpo.rollout.hf import decode as decode_module
from leangrpo.rollout.hf.engine import HFEngine
from leangrpo.rollout.hf.kv_cache import PreallocatedLayer
from leangrpo.rollout.sampling import process_logits
from leangrpo.seeding import derive_seed

TEXTS = ["12+34=", "5-3=", "99+10=1", "7="]  # different lengths: left padding is exercised


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [Prompt(uid=i, text=t, ids=tokenizer(t).input_ids) for i, t in enumerate(TEXTS)]


def tiny(tokenizer, seed=0):
    return make_tiny_model(vocab_size=len(tokenizer), seed=seed)


def with_eos_bias(model, eos_id: int, bias: float):
    """Give the lm_head a bias towards EOS so that some completions stop early."""
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[eos_id] = bias
    model.set_output_embeddings(biased)
    return model


def test_shapes_and_version_tags(tokenizer, prompts):
    engine = HFEngine(tiny(tokenizer), tokenizer)
    engine.update_weights((), 3)
    groups = engine.generate(prompts, SamplingParams(max_new_tokens=5, seed=0), n=3, version=3)
    assert len(groups) == len(prompts) and all(len(g) == 3 for g in groups)
    for c in (c for g in groups for c in g):
        assert 1 <= len(c.ids) <= 5 and len(c.logprobs) == len(c.ids)
        assert c.version == 3 and c.finish_reason in ("stop", "length")
        assert all(lp <= 0 for lp in c.logprobs)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=5, min_p=0.1, max_new_tokens=6, seed=1),
        SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=6, seed=3),  # rows of 2 lengths
    ],
)
@pytest.mark.parametrize("compact", [0.0, 0.25, 1.01])  # drop at once / the rule / never
def test_behaviour_logprobs_match_teacher_forced(tokenizer, prompts, params, compact, monkeypatch):
    monkeypatch.setattr(decode_module, "COMPACT_FRACTION", compact)
    model = with_eos_bias(tiny(tokenizer), tokenizer.eos_token_id, 0.0)  # lengths 1 to 6
    engine = HFEngine(model, tokenizer, max_batch_size=8)  # 2 chunks of 2 prompts x 4
    groups = engine.generate(prompts, params, n=4, version=0)
    # rows end at different steps: finished rows leave the running batch and its KV cache
    assert len({len(c.ids) for g in groups for c in g}) > 1
    for prompt, group in zip(prompts, groups):
        for c in group:
            expected = teacher_forced_logprobs(model, prompt.ids, c.ids, params)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=0)


def test_finished_rows_riding_along_change_no_sample(tokenizer, prompts, monkeypatch):
    """Finished rows kept in the batch are never sampled: the same draws as dropping them."""
    model = with_eos_bias(tiny(tokenizer), tokenizer.eos_token_id, 1.0)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    outputs = []
    for compact in (0.0, 0.5, 1.01):
        monkeypatch.setattr(decode_module, "COMPACT_FRACTION", compact)
        groups = HFEngine(model, tokenizer).generate(prompts, params, n=6, version=0)
        outputs.append([(c.ids, c.logprobs) for g in groups for c in g])
    assert len({len(ids) for ids, _ in outputs[0]}) > 2  # rows finish at several steps
    for other in outputs[1:]:
        assert [ids for ids, _ in other] == [ids for ids, _ in outputs[0]]
        for (_, a), (_, b) in zip(other, outputs[0]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


def test_preallocated_cache_layer_equals_dynamic_layer():
    """Updates past the capacity, row repeats and row selection: same keys and values."""
    from transformers.cache_utils import DynamicLayer

    g = torch.Generator().manual_seed(0)
    ours, ref = PreallocatedLayer(capacity=5), DynamicLayer()
    steps = [("update", 3), ("repeat", 2), ("update", 1), ("select", [0, 3, 5]), ("update", 4)]
    for op, arg in steps:  # 3 + 1 + 4 positions: the last update outgrows capacity 5
        if op == "update":
            b = ref.keys.shape[0] if ref.is_initialized and ref.keys.numel() else 3
            k, v = torch.randn(b, 2, arg, 4, generator=g), torch.randn(b, 2, arg, 6, generator=g)
            got, want = ours.update(k, v), ref.update(k, v)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        elif op == "repeat":
            ours.batch_repeat_interleave(arg), ref.batch_repeat_interleave(arg)
        else:
            index = torch.tensor(arg)
            ours.batch_select_indices(index), ref.batch_select_indices(index)
        for a, b in ((ours.keys, ref.keys), (ours.values, ref.values)):
            assert torch.equal(a, b)
        assert ours.get_seq_length() == ref.get_seq_length()
    assert ours.get_seq_length() == 8 and ours.buffers[0].shape[2] >= 8


def test_finish_reasons_eos_and_length(tokenizer, prompts):
    eos = tokenizer.eos_token_id
    model = with_eos_bias(tiny(tokenizer), eos, 2.5)
    groups = HFEngine(model, tokenizer).generate(
        prompts, SamplingParams(max_new_tokens=4, seed=0), n=8, version=0
    )
    completions = [c for g in groups for c in g]
    for c in completions:
        if c.finish_reason == "stop":
            assert c.ids[-1] == eos and eos not in c.ids[:-1]
            assert c.text == tokenizer.decode(c.ids, skip_special_tokens=True)  # EOS not in text
        else:
            assert c.finish_reason == "length" and len(c.ids) == 4 and eos not in c.ids
    assert {c.finish_reason for c in completions} == {"stop", "length"}


def test_stop_strings_cut_text_and_keep_the_completing_token(tokenizer, prompts):
    model = with_eos_bias(tiny(tokenizer), tokenizer.eos_token_id, -100.0)  # never EOS
    params = SamplingParams(max_new_tokens=8, stop=("1", "2"), seed=0)
    groups = HFEngine(model, tokenizer).generate(prompts, params, n=8, version=0)
    stopped = [c for g in groups for c in g if c.finish_reason == "stop"]
    assert stopped, "no completion produced a stop string; raise n"
    for c in stopped:
        full = tokenizer.decode(c.ids, skip_special_tokens=True)
        assert any(s in full for s in params.stop)
        assert not any(
            s in tokenizer.decode(c.ids[:-1], skip_special_tokens=True) for s in params.stop
        )
        assert c.text == full[:-1] and not any(s in c.text for s in params.stop)
    for c in (c for g in groups for c in g if c.finish_reason == "length"):
        assert len(c.ids) == 8 and not any(s in c.text for s in params.stop)


def test_greedy_is_argmax_and_repeated(tokenizer, prompts):
    model = tiny(tokenizer)
    groups = HFEngine(model, tokenizer).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=3), n=2, version=0
    )
    for prompt, (a, b) in zip(prompts, groups):
        assert a.ids == b.ids and a is not b
        assert a.ids is not b.ids and a.logprobs is not b.logprobs  # independent copies
        ids = list(prompt.ids)
        for token in a.ids:
            with torch.no_grad():
                assert model(torch.tensor([ids])).logits[0, -1].argmax().item() == token
            ids.append(token)


def test_version_mismatch_raises(tokenizer, prompts):
    engine = HFEngine(tiny(tokenizer), tokenizer)
    with pytest.raises(EngineVersionError, match="holds version 0"):
        engine.generate(prompts, SamplingParams(max_new_tokens=2), n=1, version=1)


def test_seeded_generation_is_reproducible_and_leaves_global_rng_alone(tokenizer, prompts):
    params = SamplingParams(max_new_tokens=5, seed=7)
    other = SamplingParams(max_new_tokens=5, seed=8)
    runs = []
    for calls_before in (0, 2):
        engine = HFEngine(tiny(tokenizer), tokenizer)
        torch.manual_seed(123)
        for _ in range(calls_before):  # e.g. evaluations at this version: they change nothing
            engine.generate(prompts, other, 4, 0)
        runs.append([[c.ids for c in g] for g in engine.generate(prompts, params, 4, 0)])
        runs.append([[c.ids for c in g] for g in engine.generate(prompts, other, 4, 0)])
        after = torch.rand(3)
        torch.manual_seed(123)
        assert torch.equal(after, torch.rand(3)), "generation moved the global RNG"
    assert runs[0] == runs[2] and runs[1] == runs[3]
    assert runs[0] != runs[1], "another seed must draw new samples"


def test_samples_depend_on_seed_and_version_only(tokenizer, prompts):
    """No hidden per-engine call counter: a resumed engine replays the same samples."""
    params = SamplingParams(max_new_tokens=5, seed=7)
    evaluation = SamplingParams(max_new_tokens=5, seed=99)
    used = HFEngine(tiny(tokenizer), tokenizer)
    used.update_weights((), 4)
    used.generate(prompts, evaluation, 2, 4)  # an evaluation bumped the old counter
    fresh = HFEngine(tiny(tokenizer), tokenizer)  # what a resume builds
    fresh.update_weights((), 4)
    assert [[c.ids for c in g] for g in used.generate(prompts, params, 4, 4)] == [
        [c.ids for c in g] for g in fresh.generate(prompts, params, 4, 4)
    ]


def test_train_mode_and_gradient_checkpointing_restored(tokenizer, prompts):
    model = tiny(tokenizer).train()
    model.gradient_checkpointing_enable()
    HFEngine(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=2), 2, 0)
    assert model.training and model.is_gradient_checkpointing
    assert all(m.training for m in model.modules())


def greedy_outputs(engine, prompts, version):
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    return [(c.ids, c.logprobs) for g in engine.generate(prompts, params, 1, version) for c in g]


def test_update_weights_on_own_copy_tracks_the_source(tokenizer, prompts):
    source, other = tiny(tokenizer, seed=0), tiny(tokenizer, seed=1)
    engine = HFEngine(other, tokenizer, share_weights=False)
    expected = greedy_outputs(HFEngine(source, tokenizer), prompts, 0)
    assert greedy_outputs(engine, prompts, 0) != expected
    engine.update_weights(source.named_parameters(), version=1)
    got = greedy_outputs(engine, prompts, 1)
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    for (_, lp), (_, ref) in zip(got, expected):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), atol=1e-6, rtol=0)
    assert greedy_outputs(HFEngine(other, tokenizer), prompts, 0) != expected  # original intact
    with pytest.raises(KeyError, match="no tensor named"):
        engine.update_weights([("nope.weight", torch.zeros(1))], version=2)


def lora_pair(tokenizer):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    trained = get_peft_model(tiny(tokenizer), config)
    fresh = get_peft_model(tiny(tokenizer), config)  # same base, different random adapter
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p))
    return trained, fresh


def test_update_weights_with_peft_adapter_names(tokenizer, prompts):
    from peft import get_peft_model_state_dict

    trained, fresh = lora_pair(tokenizer)
    engine = HFEngine(fresh, tokenizer, share_weights=False)
    expected = greedy_outputs(HFEngine(trained, tokenizer), prompts, 0)
    assert greedy_outputs(engine, prompts, 0) != expected
    engine.update_weights(get_peft_model_state_dict(trained).items(), version=1)
    assert [ids for ids, _ in greedy_outputs(engine, prompts, 1)] == [ids for ids, _ in expected]


def test_load_adapter_from_disk(tokenizer, prompts, tmp_path):
    trained, _ = lora_pair(tokenizer)
    trained.save_pretrained(tmp_path)
    engine = HFEngine(tiny(tokenizer), tokenizer, share_weights=False)  # plain base model
    expected = greedy_outputs(HFEngine(trained, tokenizer), prompts, 0)
    engine.load_adapter(str(tmp_path), version=4)
    assert engine.version == 4
    assert [ids for ids, _ in greedy_outputs(engine, prompts, 4)] == [ids for ids, _ in expected]
    with pytest.raises(ValueError, match="share_weights=False"):
        HFEngine(trained, tokenizer).load_adapter(str(tmp_path), version=1)


def test_closed_engine_refuses(tokenizer, prompts):
    engine = HFEngine(tiny(tokenizer), tokenizer, share_weights=False)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(prompts, SamplingParams(max_new_tokens=2), 1, 0)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 5, 1.0, 0.1),
        (1.5, 0, 0.9, 0.0),
        (0.5, 10, 0.8, 0.05),
    ],
)
def test_process_logits_matches_transformers_warpers(temperature, top_k, top_p, min_p):
    from transformers import GenerationConfig, LogitsProcessorList
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    assert GenerationConfig  # the warpers below are the ones generate() builds, in its order
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    expected = warpers(None, logits.clone())
    got = process_logits(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got, expected)


def test_process_logits_against_a_float64_reference():
    torch.manual_seed(1)
    logits = torch.randn(4, 3, 40, dtype=torch.float64)  # any leading shape
    got = process_logits(logits, temperature=0.8, top_k=7, min_p=0.2)
    scaled = logits / 0.8
    kth = scaled.sort(dim=-1, descending=True).values[..., 6:7]
    probs = scaled.softmax(-1)
    keep = (scaled >= kth) & (probs >= 0.2 * probs.amax(-1, keepdim=True))
    torch.testing.assert_close(got, scaled.float().masked_fill(~keep, float("-inf")))
    greedy = process_logits(logits, temperature=0.0)
    assert torch.equal(greedy, logits.float())
    with pytest.raises(ValueError, match="top_p must be in"):
        process_logits(logits, top_p=0.0)


def test_shared_engine_generates_on_the_models_device(tokenizer):
    model = tiny(tokenizer)
    assert HFEngine(model, tokenizer, device=torch.device("cpu")).device == torch.device("cpu")
    with pytest.raises(ValueError, match="share_weights=True generates on the model's device"):
        HFEngine(model, tokenizer, device="meta")


def test_unseeded_generation_does_not_touch_the_global_rng(tokenizer, prompts):
    engine = HFEngine(tiny(tokenizer), tokenizer)
    torch.manual_seed(11)
    state = torch.get_rng_state()
    groups = engine.generate(prompts, SamplingParams(max_new_tokens=4), 2, 0)
    assert all(len(c.ids) >= 1 for g in groups for c in g)
    assert torch.equal(torch.get_rng_state(), state), "generation drew from the global RNG"


def test_producer_thread_does_not_race_checkpointed_dropout(tokenizer, prompts):
    """The async layout: an engine with its own copy samples in a thread while the trainer
    runs dropout under non-reentrant checkpointing; the recomputed forward must draw the
    same mask as the forward (torch restores the global RNG state for it)."""
    import threading

    from torch.utils.checkpoint import checkpoint

    engine = HFEngine(tiny(tokenizer), tokenizer, share_weights=False)
    params = SamplingParams(max_new_tokens=6, seed=3, top_k=20)
    stop, calls = threading.Event(), [0]

    def producer():
        while not stop.is_set():
            engine.generate(prompts, params, 4, 0)
            calls[0] += 1

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    w = torch.tensor(2.0, requires_grad=True)
    x = torch.rand(4096)

    def layer(x):
        h = x * w
        h = h + 0.0
        return torch.nn.functional.dropout(h, 0.5, training=True)

    bad = 0
    try:
        for _ in range(150):
            w.grad = None
            y = checkpoint(layer, x, use_reentrant=False)
            y.sum().backward()
            expected = (y.detach().sum() / w.detach()).item()  # with the forward's own mask
            bad += abs(w.grad.item() - expected) > 1e-3 * abs(expected)
    finally:
        stop.set()
        thread.join(30)
    assert calls[0] > 0  # the producer really ran alongside
    assert bad == 0, f"backward used another dropout mask than forward in {bad}/150 steps"


@pytest.mark.exact
def test_a_group_samples_the_same_whichever_prompts_share_its_call(tokenizer, prompts):
    """Per-prompt streams seeded from (seed, version, index in the batch): a torchrun rank
    generating its share (prompt_offset) draws what one process drawing the whole batch
    does. One group per forward (max_batch_size = n) makes the logits bitwise equal too."""
    model = with_eos_bias(tiny(tokenizer), tokenizer.eos_token_id, 0.0)  # rows of all lengths
    engine = HFEngine(model, tokenizer, max_batch_size=4)
    params = SamplingParams(temperature=1.3, max_new_tokens=6, seed=11)
    whole = engine.generate(prompts, params, 4, 0)
    shares = engine.generate(prompts[:1], params, 4, 0) + engine.generate(
        prompts[1:], params, 4, 0, prompt_offset=1
    )
    as_lists = [[(c.ids, c.logprobs) for c in g] for g in whole]
    assert as_lists == [[(c.ids, c.logprobs) for c in g] for g in shares]
    shifted = engine.generate(prompts[1:], params, 4, 0)  # the same prompts at other indices
    assert [[c.ids for c in g] for g in shifted] != [[c.ids for c in g] for g in whole[1:]]


def turn_requests(prompts, seeds, caps):
    return [TurnRequest(p.ids, s, cap) for p, s, cap in zip(prompts, seeds, caps)]


@pytest.mark.exact
def test_turns_are_generate_with_one_sample_per_request_seed_and_cap(tokenizer, prompts):
    """generate_turns (the multi-turn rollout's call): request i sampled like generate's
    prompt i with n = 1 when its seed is generate's per-prompt seed; one request per
    forward makes it bitwise."""
    model = with_eos_bias(tiny(tokenizer), tokenizer.eos_token_id, 0.0)
    engine = HFEngine(model, tokenizer, max_batch_size=1)
    params = SamplingParams(temperature=1.3, max_new_tokens=6, seed=11)
    groups = engine.generate(prompts, params, 1, 0)
    seeds = [derive_seed(11, 0, i) for i in range(len(prompts))]
    turns = engine.generate_turns(turn_requests(prompts, seeds, [6] * 4), params, 0)
    assert [(c.ids, c.logprobs, c.finish_reason, c.text) for c in turns] == [
        (g[0].ids, g[0].logprobs, g[0].finish_reason, g[0].text) for g in groups
    ]


def test_each_turn_has_its_own_budget_and_its_own_stream(tokenizer, prompts):
    model = with_eos_bias(tiny(tokenizer), tokenizer.eos_token_id, -20.0)  # never stops
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=99, seed=1)  # neither is read
    caps, seeds = [3, 7, 1, 5], [5, 6, 7, 8]
    turns = engine.generate_turns(turn_requests(prompts, seeds, caps), params, 0)
    assert [len(c.ids) for c in turns] == caps
    assert all(c.finish_reason == "length" and len(c.logprobs) == len(c.ids) for c in turns)
    for c, p in zip(turns, prompts):  # behaviour log-probs of the request's own continuation
        expected = teacher_forced_logprobs(model, p.ids, c.ids, params)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-5, rtol=1e-5)
    # a request draws the same whichever others share the call, and wherever it sits
    alone = engine.generate_turns(turn_requests(prompts[1:2], seeds[1:2], caps[1:2]), params, 0)
    assert alone[0].ids == turns[1].ids
    moved = engine.generate_turns(turn_requests(prompts[::-1], seeds[::-1], caps[::-1]), params, 0)
    assert [c.ids for c in moved[::-1]] == [c.ids for c in turns]


def test_turn_requests_are_checked(tokenizer, prompts):
    engine = HFEngine(tiny(tokenizer), tokenizer)
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="turn request 1 needs token ids and max_new_tokens >= 1"):
        engine.generate_turns(turn_requests(prompts[:2], [1, 2], [3, 0]), params, 0)
    with pytest.raises(EngineVersionError, match="holds version 0"):
        engine.generate_turns(turn_requests(prompts[:1], [1], [3]), params, 1)
