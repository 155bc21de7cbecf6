"""A quantized base (model/quantization.py): the checks before the model loads, and the
load-time fixes, on the bundled demo model (3 layers, 64 wide: bitsandbytes quantizes
it in a fraction of a second, so these tests take seconds).

The checks are torch-free functions of what they read (a version string, CPU flags, the
installed vLLM), tested here on given values; the CLI test runs the real detection in a
subprocess where `import bitsandbytes` fails."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from support.configs import DEMO, ROOT, tiny_run

from leangrpo.config import ConfigError, config_from_dict
from leangrpo.model.quantization import (
    QuantizationError,
    check_bitsandbytes,
    check_vllm,
    cpu_problem,
    starts_vllm,
)
from leangrpo.preflight import check_world, ignored_options

CPU = torch.device("cpu")
needs_bnb = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="QLoRA needs bitsandbytes: pip install 'leangrpo[qlora]'",
)


def qlora_run(tmp_path: Path, quant: str = "nf4", **sections) -> dict:
    cfg = tiny_run(tmp_path, lora={"enabled": True, "r": 4, "alpha": 8}, **sections)
    cfg["model"]["quantization"] = quant
    return cfg


# -- config rules and preflight checks (no torch needed) ------------------------------------


def test_quantization_without_lora_is_refused_in_one_sentence(tmp_path):
    cfg = qlora_run(tmp_path)
    cfg["lora"]["enabled"] = False
    with pytest.raises(ConfigError, match=r"model.quantization \(nf4\) freezes the base model in 4 bits.*set lora.enabled: true") as err:
        config_from_dict(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"model": {"quantization": "int8", "gradient_checkpointing": True}}, "int8 keeps every linear layer's input alive"),
        ({"model": {"quantization": "int8"}, "offload": {"activations": "hidden_states"}}, "int8 keeps every linear layer's input alive"),
        ({"model": {"quantization": "fp4"}, "rollout": {"engine": "vllm"}}, "in nf4 only, not fp4"),
        ({"model": {"quantization_double_quant": False}, "rollout": {"engine": "vllm"}}, "with double quantization always"),
    ],
    ids=["int8_checkpointing", "int8_offload", "vllm_fp4", "vllm_no_double_quant"],
)  # fmt: skip
def test_combinations_that_cannot_work_are_refused(tmp_path, change, match):
    cfg = qlora_run(tmp_path)
    for section, values in change.items():
        cfg.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=match):
        config_from_dict(cfg)


def test_missing_or_old_bitsandbytes_names_the_install():
    with pytest.raises(QuantizationError, match=r"needs bitsandbytes >= 0.47, which is not installed; pip install 'leangrpo\[qlora\]'"):
        check_bitsandbytes("nf4", None)
    with pytest.raises(QuantizationError, match="but 0.46.1 is installed"):
        check_bitsandbytes("int8", "0.46.1")
    check_bitsandbytes("nf4", "0.47.0")
    check_bitsandbytes("nf4", "0.50.2")


def test_an_unsupported_cpu_is_refused():
    assert "needs an x86-64 CPU with AVX2" in cpu_problem("x86_64", {"sse4_2", "avx"})
    assert "x86-64 and ARM64 CPUs only, not ppc64le" in cpu_problem("ppc64le", None)
    assert cpu_problem("x86_64", {"avx", "avx2", "fma"}) is None
    assert cpu_problem("aarch64", set()) is None
    assert cpu_problem("x86_64", None) is None  # flags unknown: bitsandbytes is left to try


def test_vllm_without_in_flight_bitsandbytes_is_refused_before_it_starts(tmp_path):
    with pytest.raises(QuantizationError, match="runs on CUDA GPUs only, and this run trains on the CPU"):
        check_vllm("cpu", True)
    with pytest.raises(QuantizationError, match="the installed vLLM does not have"):
        check_vllm("cuda", False)
    check_vllm("cuda", True)
    check_vllm("auto", None)  # no vLLM installed: the engine's own install hint says so
    cfg = config_from_dict(qlora_run(tmp_path, rollout={"engine": "vllm"}))
    assert starts_vllm(cfg)
    cfg.rollout.vllm.mode, cfg.rollout.vllm.urls = "server", ["http://gpu-node:8000"]
    assert not starts_vllm(cfg)  # servers elsewhere: started with --quantization bitsandbytes


def test_int8_is_refused_under_torchrun_and_4_bit_is_not(tmp_path):
    with pytest.raises(ConfigError, match="int8 cannot be sharded by FSDP2.*2 torchrun processes"):
        check_world(config_from_dict(qlora_run(tmp_path, "int8")), 2)
    check_world(config_from_dict(qlora_run(tmp_path, "int8")), 1)
    check_world(config_from_dict(qlora_run(tmp_path, "nf4")), 2)


def test_quantization_settings_without_quantization_are_listed_as_ignored(tmp_path):
    cfg = qlora_run(tmp_path, "none")
    cfg["model"]["quantization_compute_dtype"] = "bfloat16"
    assert any("model.quantization_compute_dtype" in x for x in ignored_options(config_from_dict(cfg)))
    cfg = qlora_run(tmp_path, "int8")
    cfg["model"]["quantization_double_quant"] = False
    assert any("model.quantization_double_quant" in x and "int8" in x for x in ignored_options(config_from_dict(cfg)))


PROBE_NO_BNB = (
    "import atexit, sys\n"
    "sys.modules['bitsandbytes'] = None  # as if not installed: import and find_spec fail\n"
    "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules))\n"
    "from leangrpo.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_the_cli_says_bitsandbytes_is_missing_before_torch_is_imported(tmp_path):
    cfg = qlora_run(tmp_path)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, "-c", PROBE_NO_BNB, "train", str(path)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs bitsandbytes >= 0.47, which is not installed" in lines[0]
    assert out.stdout.strip().endswith("torch imported: False")


# -- loading (bitsandbytes) ------------------------------------------------------------------


CHUNKS = SimpleNamespace(chunked=True, row_tile=None, vocab_tile=None)


def load_policy(cfg):
    from leangrpo.model.policy import load_policy as load
    from leangrpo.model.policy import load_tokenizer

    torch.manual_seed(0)  # peft draws lora_A from the global RNG
    return load(cfg, load_tokenizer(cfg.model), CPU)


def load(tmp_path: Path, quant: str = "nf4", **sections):
    return load_policy(config_from_dict(qlora_run(tmp_path, quant, **sections)))


def demo_batch(tokenizer, n: int = 6):
    """n sums in the demo's prompt format, two completions per prompt, packed."""
    from leangrpo.contracts import Completion, Prompt, RolloutSample
    from leangrpo.train.packing import pack_samples

    samples = []
    for i in range(n):
        prompt = Prompt(i // 2, "", tokenizer(f"{10 + i}+{20 + 3 * i}=")["input_ids"])
        ids = tokenizer(f"{30 + 4 * i}")["input_ids"] + [tokenizer.eos_token_id]
        comp = Completion(ids, "", [0.0] * len(ids), "stop", 0)
        samples.append(RolloutSample(i // 2, prompt, comp, advantage=1.0 - i % 2))
    return pack_samples(samples)


@needs_bnb
@pytest.mark.parametrize("quant", ["nf4", "fp4", "int8"])
def test_the_base_loads_quantized_with_the_head_and_embeddings_in_full_precision(tmp_path, quant):
    import bitsandbytes as bnb

    policy = load(tmp_path, quant)
    kind = bnb.nn.Linear8bitLt if quant == "int8" else bnb.nn.Linear4bit
    layers = [m for m in policy.model.modules() if isinstance(m, kind)]
    assert len(layers) == 3 * 7  # every linear of the decoder layers
    head = policy.model.get_output_embeddings()
    assert type(head) is torch.nn.Linear and head.weight.dtype == torch.float32
    assert head.weight is policy.model.get_input_embeddings().weight  # still tied
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert policy.model.config.quantization_config.quant_method == "bitsandbytes"


@needs_bnb
def test_the_unquantized_tensors_no_longer_view_the_checkpoint_file(tmp_path):
    """Fix 3: quantizing reads every page of the safetensors file, and while a tensor views
    its memory map the pages stay resident (SmolLM2: 0.4 GiB, the run's peak RSS above
    the fp32 run's). After loading, the file must no longer be mapped."""
    policy = load(tmp_path)
    weights = str(DEMO / "model" / "model.safetensors")
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else None
    if maps is None:
        pytest.skip("no /proc/self/maps on this OS")
    assert weights not in maps
    assert policy.model.get_output_embeddings().weight.is_floating_point()


@needs_bnb
def test_int8_layers_compute_alike_in_eval_and_train_mode(tmp_path):
    """Fix 2: bitsandbytes' int8 eval mode (LLM.int8: fp16 activations, int8 matmul) moved
    SmolLM2's log-probs by 1.5 nats from train mode, which generation and the old-log-prob
    passes (eval) against the training pass (train) would turn into a wrong ratio."""
    from leangrpo.contracts import SamplingParams
    from leangrpo.model.scoring import eval_mode, score

    policy = load(tmp_path, "int8")
    batch = demo_batch(policy.tokenizer)
    with torch.no_grad():
        trained, _ = score(policy.model, batch, SamplingParams(), CHUNKS)
        with eval_mode(policy.model):
            evaluated, _ = score(policy.model, batch, SamplingParams(), CHUNKS)
    assert torch.equal(trained, evaluated)


@needs_bnb
@pytest.mark.parametrize("quant", ["nf4", "fp4"])
def test_checkpointing_and_offload_leave_the_4_bit_gradients_unchanged(tmp_path, quant):
    """The 4-bit matmul saves no activation (its weight is a ctx attribute), so
    checkpointing and hidden-state offload see what they see for a frozen nn.Linear."""
    from leangrpo.contracts import SamplingParams
    from leangrpo.model.scoring import score

    offload = {"activations": "hidden_states", "keep_last_layers": 0, "min_tensor_bytes": 0}
    grads, offloaded = [], []
    for checkpointing, sections in [(False, {}), (True, {}), (True, {"offload": offload})]:
        cfg = qlora_run(tmp_path, quant, **sections)
        cfg["model"]["gradient_checkpointing"] = checkpointing
        policy = load_policy(config_from_dict(cfg))
        with torch.no_grad():
            for name, param in policy.model.named_parameters():
                if "lora_B" in name:  # the same non-zero B in each variant
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
        batch = demo_batch(policy.tokenizer)
        step = policy.offloader.step() if policy.offloader is not None else contextlib.nullcontext()
        with step:
            logp, _ = score(policy.model, batch, SamplingParams(), CHUNKS)
            grads.append(torch.autograd.grad(logp.sum(), policy.trainable_parameters()))
        offloaded.append(policy.offloader.stats.offloaded if policy.offloader else 0)
    assert offloaded[2] > 0  # the offload really ran
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))
    assert max(g.abs().max().item() for g in grads[0]) > 0


def test_vllm_is_asked_to_quantize_the_base_in_flight(tmp_path, monkeypatch):
    """colocated and server engines get quantization="bitsandbytes" (a server the trainer
    starts through its --engine-kwargs); a plain base gets nothing."""
    from leangrpo.rollout.vllm.engine import VLLMEngine, make_vllm_engine

    calls = []
    for kind in ("colocated", "server"):
        monkeypatch.setattr(VLLMEngine, kind, classmethod(lambda cls, *a, _k=kind, **k: calls.append((_k, k))))
    policy = SimpleNamespace(model=SimpleNamespace(peft_config={"default": None}))
    cfg = config_from_dict(qlora_run(tmp_path, rollout={"engine": "vllm"}))
    make_vllm_engine(cfg, policy)
    cfg.rollout.vllm.mode = "server"
    make_vllm_engine(cfg, policy)
    assert [(k, c["engine_kwargs"].get("quantization")) for k, c in calls] == [
        ("colocated", "bitsandbytes"), ("server", "bitsandbytes")]  # fmt: skip
    plain = config_from_dict(qlora_run(tmp_path, "none", rollout={"engine": "vllm"}))
    make_vllm_engine(plain, policy)
    assert "quantization" not in calls[-1][1]["engine_kwargs"]


@pytest.mark.parametrize("flags", [{"avx2", "fma"}, None])
def test_atens_generic_kernels_are_no_statement_about_the_cpu(monkeypatch, flags):
    """ATEN_CPU_CAPABILITY=default (make test's generic-kernel pass, or a user's setting)
    makes torch report DEFAULT on any CPU: a CPU whose /proc/cpuinfo lists AVX2 still takes
    a 4-bit base; only where cpuinfo cannot be read does torch's DEFAULT mean no AVX2."""
    from leangrpo.model import quantization

    monkeypatch.setattr(quantization.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(quantization, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    if flags is None:
        with pytest.raises(quantization.QuantizationError, match="AVX2"):
            quantization.check_quantized_device("nf4", torch.device("cpu"), "model.quantization")
    else:
        quantization.check_quantized_device("nf4", torch.device("cpu"), "model.quantization")
