"""The packed scoring forward and the reference pass (LoRA adapters disabled)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from support.configs import minimal_run
from support.files import copy_demo_model
from support.models import make_tiny_model
from support.references import per_sequence_logprobs

from leangrpo.config.training import LogprobsConfig
from leangrpo.contracts import Completion, Prompt, RolloutSample, SamplingParams
from leangrpo.model.policy import Policy
from leangrpo.model.scoring import reference_logprobs, score
from leangrpo.ops.attention.adapter import enable_packed_attention
from leangrpo.train.packing import pack_samples

LOGPROBS = LogprobsConfig(chunked=True, row_tile=4, vocab_tile=16)


def samples(seed: int = 0) -> list[RolloutSample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, c) in enumerate([(5, 3), (2, 1), (7, 6), (3, 4)]):
        prompt = torch.randint(1, 64, (p,), generator=g).tolist()
        comp = torch.randint(1, 64, (c,), generator=g).tolist()
        out.append(
            RolloutSample(
                i // 2,
                Prompt(i, "", prompt),
                Completion(comp, "", [0.0] * c, "stop", 0),
                advantage=1.0,
            )
        )
    return out


def test_packed_chunked_score_equals_per_sequence_full_logits():
    model = make_tiny_model("qwen2")
    enable_packed_attention(model, "sdpa_segments")
    batch_samples = samples()
    batch = pack_samples(batch_samples)
    params = SamplingParams(temperature=0.7)
    with torch.no_grad():
        got, _ = score(model, batch, params, LOGPROBS)
        want = per_sequence_logprobs(model, batch_samples, 0.7)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_lora_reference_is_the_model_with_adapters_disabled():
    from peft import LoraConfig, get_peft_model

    base = make_tiny_model("llama")
    enable_packed_attention(base, "sdpa_segments")
    batch_samples = samples(1)
    batch = pack_samples(batch_samples)
    with torch.no_grad():
        base_logp = per_sequence_logprobs(base, batch_samples, 1.0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)  # move the policy away from the base
    policy = Policy(model, None, None, torch.device("cpu"), is_lora=True)
    params = SamplingParams()
    with torch.no_grad():
        ref = reference_logprobs(policy, batch, params, LOGPROBS)
        current, _ = score(model, batch, params, LOGPROBS)
    torch.testing.assert_close(ref, base_logp, atol=1e-5, rtol=1e-5)
    assert (current - ref).abs().max() > 1e-3


def test_reference_logprobs_are_unfiltered():
    """With top-k / min-p sampling the reference keeps the whole vocabulary: a token outside
    the reference's top-k has a finite log-prob (KL stays finite), the temperature applies."""
    model = make_tiny_model("qwen2")
    enable_packed_attention(model, "sdpa_segments")
    reference = make_tiny_model("qwen2", seed=1)
    enable_packed_attention(reference, "sdpa_segments")
    batch = pack_samples(samples(2))
    policy = Policy(model, None, reference, torch.device("cpu"), is_lora=False)
    filtered = SamplingParams(temperature=0.7, top_k=2, min_p=0.3)
    with torch.no_grad():
        ref = reference_logprobs(policy, batch, filtered, LOGPROBS)
        unfiltered, _ = score(reference, batch, SamplingParams(temperature=0.7), LOGPROBS)
        reference_filtered, _ = score(reference, batch, filtered, LOGPROBS)
    assert torch.isneginf(reference_filtered).any()  # the case: tokens outside its top-2
    assert torch.isfinite(ref).all()
    assert torch.equal(ref, unfiltered)


def dropout_model_dir(tmp_path):
    model = make_tiny_model(max_position_embeddings=64, attention_dropout=0.5)
    model.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def first_iteration_ratio(tmp_path, **model_section):
    """Old log-probs (eval mode, no grad) vs the training pass (train mode) on one batch."""
    from leangrpo.config import config_from_dict
    from leangrpo.model.policy import load_policy
    from leangrpo.model.scoring import eval_mode

    model = {"name_or_path": dropout_model_dir(tmp_path), "dtype": "float32",
             "gradient_checkpointing": True, **model_section}  # fmt: skip
    cfg = config_from_dict(minimal_run(model=model))
    policy = load_policy(cfg, None, torch.device("cpu"))
    batch = pack_samples(samples())
    with eval_mode(policy.model), torch.no_grad():
        old, _ = score(policy.model, batch, SamplingParams(), LOGPROBS)
    torch.manual_seed(1)
    current, _ = score(policy.model, batch, SamplingParams(), LOGPROBS, with_entropy=True)
    current.sum().backward()  # checkpointed recomputation in train mode
    return torch.exp(current.detach() - old)


def test_dropout_is_off_for_rl_by_default(tmp_path):
    ratio = first_iteration_ratio(tmp_path)
    assert torch.equal(ratio, torch.ones_like(ratio))  # exactly 1 on the first iteration
    kept = first_iteration_ratio(tmp_path, disable_dropout=False)
    assert (kept - 1).abs().max() > 1e-3  # what the default prevents: dropout noise in r


def test_lora_dropout_needs_dropout_kept():
    from leangrpo.config import ConfigError, config_from_dict

    lora = {"enabled": True, "dropout": 0.05}
    with pytest.raises(ConfigError, match="lora.dropout.*model.disable_dropout"):
        config_from_dict(minimal_run(lora=lora))
    kept = config_from_dict(minimal_run(lora=lora, model={"disable_dropout": False}))
    assert kept.lora.dropout == 0.05


def test_chunked_head_module_keeps_names_tying_and_log_probs():
    """The lm_head as a module: same parameters and names, plain logits without targets,
    the same log-probs through `score` and through the PackedScorer root."""
    from leangrpo.model.scoring import ChunkedLMHead, PackedScorer, install_chunked_head

    model = make_tiny_model("qwen2")
    model.lm_head.weight = model.model.embed_tokens.weight  # tie them, as the demo model is
    enable_packed_attention(model, "sdpa_segments")
    batch = pack_samples(samples())
    params = SamplingParams(temperature=0.7, top_k=20)
    names = list(model.state_dict())
    with torch.no_grad():
        want, _ = score(model, batch, params, LOGPROBS)
        hidden = torch.randn(3, 32)
        logits = model.lm_head(hidden)
        head = install_chunked_head(model)
        assert install_chunked_head(model) is head and isinstance(head, ChunkedLMHead)
        assert head.weight is model.model.embed_tokens.weight
        assert list(model.state_dict()) == names
        torch.testing.assert_close(head(hidden), logits, rtol=0, atol=0)
        got, _ = score(model, batch, params, LOGPROBS)
        root, _ = score(PackedScorer(model), batch, params, LOGPROBS)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(root, want, rtol=0, atol=0)


def damaged_demo_model(tmp_path: Path, damage) -> str:
    """The demo model copied to tmp_path, its tensors edited by damage(dict of tensors)."""
    from safetensors.torch import load_file, save_file

    def edit(directory: Path) -> None:
        tensors = load_file(directory / "model.safetensors")
        damage(tensors)
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})

    return str(copy_demo_model(tmp_path, edit))


def nan_layer_norm(tensors):
    tensors["model.layers.0.input_layernorm.weight"][0] = float("nan")


def wrong_shape(tensors):
    tensors["model.embed_tokens.weight"] = torch.zeros(3, 3)


def missing_tensor(tensors):
    del tensors["model.layers.0.mlp.down_proj.weight"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (missing_tensor, "tensors missing from the weights: model.layers.0.mlp.down_proj.weight"),
        (wrong_shape, "model.embed_tokens.weight (3, 3) instead of (32, 64)"),
        (nan_layer_norm, "tensors holding NaN or inf: model.layers.0.input_layernorm.weight"),
    ],
)
def test_weights_that_do_not_fit_the_config_are_refused(tmp_path, damage, message):
    """transformers initialised a missing tensor at random with a warning (the run trained
    on it), raised a traceback for a wrong shape; NaN weights crashed in sampling."""
    from leangrpo.config import config_from_dict
    from leangrpo.errors import UserError
    from leangrpo.model.policy import load_policy, load_tokenizer

    path = damaged_demo_model(tmp_path, damage)
    cfg = config_from_dict(minimal_run(model={"name_or_path": path, "dtype": "float32"}))
    with pytest.raises(UserError, match=re.escape(message)):
        load_policy(cfg, load_tokenizer(cfg.model), torch.device("cpu"))


def test_an_unknown_model_type_is_one_sentence(tmp_path):
    import json

    from leangrpo.config import config_from_dict
    from leangrpo.errors import UserError
    from leangrpo.model.policy import load_policy

    path = Path(damaged_demo_model(tmp_path, lambda tensors: None))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "nosuchmodel"}))
    cfg = config_from_dict(minimal_run(model={"name_or_path": str(path)}))
    with pytest.raises(UserError, match="could not be loaded.*nosuchmodel.*check config.json"):
        load_policy(cfg, None, torch.device("cpu"))


def test_an_adapter_on_a_module_scoring_bypasses_is_refused():
    """a9_lm_head_target.py: lm_head in lora.target_modules was accepted, but scoring reads the
    head's weight as a plain matrix (the chunked log-probs), so its adapter got no gradient
    and scoring ignored it while generation used it. The config refuses the name; at load,
    an adapter on any module outside the decoder (a head of another name, a config that
    skipped validation) is refused in the same sentence. 'all-linear' leaves the head out,
    and every adapter it makes gets a gradient from scoring."""
    from support.configs import unvalidated

    from leangrpo.config import ConfigError, config_from_dict
    from leangrpo.config.run import LoRAConfig
    from leangrpo.model.policy import build_policy

    bypassed = "adapts lm_head, which leangrpo's scoring bypasses"
    head = {"enabled": True, "target_modules": ["q_proj", "lm_head"]}
    with pytest.raises(ConfigError, match=f"'lora.target_modules'.*{bypassed}"):
        config_from_dict(minimal_run(lora=head))
    cfg = config_from_dict(minimal_run(lora={"enabled": True, "r": 4}))
    cfg.lora = unvalidated(LoRAConfig, **{**cfg.lora.model_dump(), **head})
    with pytest.raises(ConfigError, match=f"^lora.target_modules {bypassed}"):
        build_policy(make_tiny_model("qwen2"), cfg, None, torch.device("cpu"))

    cfg = config_from_dict(minimal_run(lora={"enabled": True, "r": 4}))
    policy = build_policy(make_tiny_model("qwen2"), cfg, None, torch.device("cpu"))
    for name, param in policy.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)
    logp, _ = score(policy.model, pack_samples(samples()), SamplingParams(), LOGPROBS)
    logp.sum().backward()
    trainable = [(n, p) for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None and p.grad.abs().max() > 0 for _, p in trainable)


def test_lora_targets_the_model_lacks_are_one_sentence_at_load():
    """What the cheap check (model/files.py) cannot see, a hub model or .bin weights: peft's
    NoMatchingPeftModuleError traceback became one sentence naming the linear modules."""
    from leangrpo.config import ConfigError, config_from_dict
    from leangrpo.model.policy import build_policy

    cfg = config_from_dict(minimal_run(lora={"enabled": True, "target_modules": ["foo_proj"]}))
    with pytest.raises(ConfigError) as err:
        build_policy(make_tiny_model("qwen2"), cfg, None, torch.device("cpu"))
    message = str(err.value)
    assert message.startswith("lora.target_modules = ['foo_proj'] cannot be adapted")
    assert "linear modules are named" in message and "q_proj" in message and "\n" not in message


def test_float16_full_finetuning_is_refused_at_load_where_auto_resolves_to_it():
    """model.dtype: auto is float16 on a GPU without bfloat16; config/root.py refuses an
    explicit float16 before anything loads."""
    from leangrpo.config import ConfigError, config_from_dict
    from leangrpo.model.policy import refuse_float16_full_finetuning

    cfg = config_from_dict(minimal_run())
    with pytest.raises(ConfigError, match="resolves to float16 on this device"):
        refuse_float16_full_finetuning(cfg, torch.float16)
    refuse_float16_full_finetuning(cfg, torch.bfloat16)
    lora = config_from_dict(minimal_run(lora={"enabled": True}))
    refuse_float16_full_finetuning(lora, torch.float16)


@pytest.mark.exact
def test_a_loaded_policy_decodes_as_a_copy_of_it_does_bitwise():
    """transformers leaves CPU weights in the memory-mapped safetensors file, where the tool
    demo's tensors start 40 bytes past a 64-byte boundary; oneMKL's one-row products (every
    decode step) round by the weights' alignment, so the async engine's copy of the model
    decoded other behaviour log-probs than the trainer's own model (sync) and async at
    staleness 0 did not equal sync. The loaded policy's tensors are aligned as a copy's."""
    from transformers import AutoModelForCausalLM

    from leangrpo.config import config_from_dict
    from leangrpo.model.policy import ALIGNMENT_BYTES, load_policy, load_tokenizer
    from leangrpo.rollout.hf.engine import HFEngine

    name = str(Path(__file__).resolve().parents[2] / "examples" / "tools_demo" / "model")
    mapped = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
    assert any(p.data_ptr() % ALIGNMENT_BYTES for p in mapped.parameters())  # the case
    cfg = config_from_dict(minimal_run(model={"name_or_path": name, "dtype": "float32"}))
    tokenizer = load_tokenizer(cfg.model)
    policy = load_policy(cfg, tokenizer, torch.device("cpu"))
    model = policy.model
    assert all(t.data_ptr() % ALIGNMENT_BYTES == 0 for t in [*model.parameters(), *model.buffers()])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    prompts = [
        Prompt(i, "", tokenizer(text).input_ids) for i, text in enumerate(["12+30=", "7+5="])
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    decoded = [  # one row per forward (the multi-turn batch-invariant mode): M = 1
        [(c.ids, c.logprobs) for group in engine.generate(prompts, params, 1, 0) for c in group]
        for engine in (
            HFEngine(model, tokenizer, max_batch_size=1),  # sync: the trainer's model
            HFEngine(model, tokenizer, max_batch_size=1, share_weights=False),  # async: a copy
        )
    ]
    assert decoded[0] == decoded[1]
