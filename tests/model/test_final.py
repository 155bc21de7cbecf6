"""What a run leaves in final/ (model/final.py): reloaded by `leangrpo.model.load_final` it
computes what the trainer's model computed; merged by `merge_adapter` it is a full model a
new run starts from.

The policies here are built by the trainer's own `load_policy` and saved by its
`save_final_model`, their adapters' B set non-zero (what training does: at init B is 0 and
the adapter would not take part in what is compared)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from support.configs import tiny_run

from leangrpo.checkpoint.local import save_final_model
from leangrpo.config import config_from_dict
from leangrpo.model import load_final, merge_adapter
from leangrpo.model.files import ModelFilesError
from leangrpo.model.policy import load_policy, load_tokenizer

CPU = torch.device("cpu")
needs_bnb = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="QLoRA needs bitsandbytes: pip install 'leangrpo[qlora]'",
)
# logits of the same computation in the run's dtype; the defects were 0.57 (the repack) and
# 2.8 (a bfloat16 run's adapter on a float32 base) away
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def trained_policy(tmp_path, quant: str = "none", dtype: str = "float32", lora: bool = True):
    cfg = tiny_run(tmp_path, lora={"enabled": lora, "r": 4, "alpha": 8})
    cfg["model"].update(quantization=quant, dtype=dtype)
    cfg = config_from_dict(cfg)
    torch.manual_seed(0)  # peft draws lora_A from the global RNG
    policy = load_policy(cfg, load_tokenizer(cfg.model), CPU)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return policy


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Eval mode, no grad: the mode in which bitsandbytes repacks a 4-bit layer on the CPU."""
    model.eval()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")  # plain attention on both sides
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def prompt_ids(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer("12+34=46 and 7+8=15")["input_ids"]])


@pytest.fixture
def repack_on(monkeypatch):
    """bitsandbytes' CPU bf16 repack switched on for every 4-bit layer built from here on, on
    any CPU: bitsandbytes asks the CPU for AVX512-BF16, and where it has none the repack
    stays off and a loader that forgets to turn it off would pass. Switched on elsewhere,
    a repacked layer runs a kernel that was never registered there: wrong, not silent."""
    modules = pytest.importorskip("bitsandbytes.nn.modules")
    monkeypatch.setattr(modules, "has_avx512bf16", lambda: True)


@pytest.mark.parametrize(
    "quant,dtype",
    [
        pytest.param("nf4", "float32", marks=needs_bnb),
        pytest.param("nf4", "bfloat16", marks=needs_bnb),
        pytest.param("fp4", "float32", marks=needs_bnb),
        pytest.param("int8", "float32", marks=needs_bnb),
        ("none", "bfloat16"),  # plain LoRA: the base's dtype is not the checkpoint's
    ],
)
def test_the_final_adapter_reloads_to_the_trainers_outputs(tmp_path, quant, dtype, repack_on):
    policy = trained_policy(tmp_path, quant, dtype)
    final = save_final_model(tmp_path / "run", policy.model, policy.tokenizer)
    assert json.loads((final / "base_model.json").read_text()) == {"dtype": dtype}
    assert (final / "quantization_config.json").is_file() == (quant != "none")
    ids = prompt_ids(policy.tokenizer)
    want = logits(policy.model, ids)

    model = load_final(final)
    assert not model.training
    assert model.get_input_embeddings().weight.dtype == getattr(torch, dtype)
    got = logits(model, ids)
    assert (got - want).abs().max().item() <= TOLERANCE[dtype]
    layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert (len(layers) > 0) == (quant in ("nf4", "fp4"))
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    with model.disable_adapter():  # the adapter is part of what was compared
        assert (got - logits(model, ids)).abs().max().item() > 100 * TOLERANCE[dtype]


def test_a_full_fine_tuning_final_model_reloads_as_saved(tmp_path):
    policy = trained_policy(tmp_path, lora=False)
    with torch.no_grad():
        for param in policy.model.parameters():  # weights that differ from the checkpoint's
            param.add_(0.01)
    final = save_final_model(tmp_path / "run", policy.model, policy.tokenizer)
    assert not (final / "base_model.json").exists()
    ids = prompt_ids(policy.tokenizer)
    torch.testing.assert_close(logits(load_final(final), ids), logits(policy.model, ids))


@pytest.mark.parametrize("lora", [False, True])
def test_a_reloaded_final_is_laid_out_as_the_trainers_policy(tmp_path, lora):
    """Aligned memory (model.policy.own_aligned_memory), not views into the safetensors
    file 40 bytes off a boundary: oneMKL's one-row products round by alignment on the
    kernels AMD CPUs pick, so an unaligned reload decoded other bits than the trainer."""
    policy = trained_policy(tmp_path, lora=lora)
    final = save_final_model(tmp_path / "run", policy.model, policy.tokenizer)
    model = load_final(final)
    tensors = [*model.parameters(), *model.buffers()]
    misaligned = [t.shape for t in tensors if t.numel() and t.data_ptr() % 64]
    assert not misaligned, misaligned


def test_a_directory_without_a_model_or_its_base_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(ModelFilesError, match="holds neither a model"):
        load_final(tmp_path)
    with pytest.raises(ModelFilesError, match="holds no LoRA adapter"):
        merge_adapter(tmp_path, tmp_path / "merged")
    policy = trained_policy(tmp_path)
    final = save_final_model(tmp_path / "run", policy.model, policy.tokenizer)
    with pytest.raises(
        ModelFilesError, match=r"the base model of the adapter.*could not be loaded.*pass base="
    ):
        load_final(final, base=str(tmp_path / "moved"))
    (final / "base_model.json").write_text("[1, 2]")
    with pytest.raises(ModelFilesError, match="base_model.json holds no JSON object"):
        load_final(final)


@pytest.mark.parametrize("quant", ["none", pytest.param("nf4", marks=needs_bnb)])
def test_an_adapter_merged_into_its_base_is_a_model_of_its_own(tmp_path, quant):
    """merge_adapter(run directory): the base unquantized in the run's dtype plus the
    adapter, with the tokenizer. For LoRA its logits are the adapter's on that base; a
    QLoRA adapter is merged into the full-precision base (the nf4 base was a rounding of
    it), so its logits are those of the adapter on that base, not on the 4-bit one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = trained_policy(tmp_path, quant)
    save_final_model(tmp_path / "run", policy.model, policy.tokenizer)
    merged_dir = merge_adapter(tmp_path / "run", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert getattr(merged.config, "quantization_config", None) is None
    ids = prompt_ids(AutoTokenizer.from_pretrained(merged_dir))
    unquantized = trained_policy(tmp_path / "fp", "none")  # same seed: the same adapter
    trained = dict(policy.model.named_parameters())
    with torch.no_grad():
        for name, param in unquantized.model.named_parameters():
            if "lora_" in name:
                param.copy_(trained[name])
    # merged (W + s B A) and unmerged (W x + s B A x) round differently: 1e-5 here
    torch.testing.assert_close(
        logits(merged, ids), logits(unquantized.model, ids), atol=1e-4, rtol=0
    )
    with pytest.raises(ModelFilesError, match="exists already"):
        merge_adapter(tmp_path / "run", merged_dir)


def test_the_final_adapter_reloads_onto_the_base_revision_it_trained_on(tmp_path, monkeypatch):
    """A LoRA run from a hub model pinned at model.revision: adapter_config.json recorded no
    revision, so load_final (and merge) took the base from the hub's main branch, another
    model than the one trained (logits 21.9 apart here). Two cached revisions of one hub
    id, offline: the run trains on the one that is not main."""
    import huggingface_hub.constants as hub
    from safetensors.torch import load_file, save_file
    from support.configs import DEMO_MODEL

    main, pinned = "a" * 40, "b" * 40
    repo = tmp_path / "hub" / "models--leangrpo-test--tiny"
    for revision, shift in ((main, 0.0), (pinned, 0.05)):
        snapshot = repo / "snapshots" / revision
        shutil.copytree(DEMO_MODEL, snapshot)
        weights = load_file(snapshot / "model.safetensors")
        shifted = {k: v + shift for k, v in weights.items()}
        save_file(shifted, snapshot / "model.safetensors", metadata={"format": "pt"})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(main)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)

    cfg = tiny_run(tmp_path, lora={"enabled": True, "r": 4, "alpha": 8})
    cfg["model"].update(name_or_path="leangrpo-test/tiny", revision=pinned)
    cfg = config_from_dict(cfg)
    torch.manual_seed(0)
    policy = load_policy(cfg, load_tokenizer(cfg.model), CPU)
    final = save_final_model(tmp_path / "run", policy.model, policy.tokenizer)
    ids = prompt_ids(policy.tokenizer)
    want = logits(policy.model, ids)
    torch.testing.assert_close(logits(load_final(final), ids), want, atol=1e-5, rtol=0)
    merged = merge_adapter(tmp_path / "run", tmp_path / "merged")
    from transformers import AutoModelForCausalLM

    got = logits(AutoModelForCausalLM.from_pretrained(merged), ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
