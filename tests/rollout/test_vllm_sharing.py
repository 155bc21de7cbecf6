"""One copy of the weights: colocated vLLM sharing its tensors with the policy
(rollout/vllm/sharing.py).

Unmarked tests need no vLLM: the config's rules and the planner, the view mapping on a
module laid out as vLLM lays out its parameters, the policy built on views and the checks
against the checkpoint. Tests marked `vllm` run real vLLM (CPU build, `.venv-vllm`), its
engine core in this process:

    .venv-vllm/bin/pytest -m vllm tests/rollout/test_vllm_sharing.py

vLLM engines started: one shared demo engine (module fixture), one per trainer run (demo
model, in this process: 9 runs) and the two SmolLM2 processes of
benchmarks/shared_weights.py --smallest (the memory test).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from support.configs import DEMO_MODEL, DEMO_YAML, ROOT, SRC, minimal_run
from support.models import make_tiny_model
from support.references import teacher_forced_logprobs
from torch import nn

from leangrpo.config import ConfigError, config_from_dict, load_config
from leangrpo.config.run import ModelConfig
from leangrpo.contracts import Prompt, SamplingParams
from leangrpo.errors import RunError
from leangrpo.planner.plan import SAVED_BY_SHARING, plan_memory, render_plan
from leangrpo.preflight import ignored_options
from leangrpo.rollout.vllm.local import IN_MEMORY_ADAPTERS, AdapterSlots
from leangrpo.rollout.vllm.sharing import adapter_config_dict, start_shared_vllm
from leangrpo.rollout.vllm.views import (
    checkpoint_mismatch,
    model_on_views,
    same_memory,
    unshared_parameters,
    vllm_views,
)

# --------------------------------------------------------------------------- no vLLM needed


def colocated(**sections) -> dict:
    sections.setdefault("rollout", {}).update(engine="vllm")
    return minimal_run(**sections)


def test_the_config_says_when_weights_cannot_be_shared():
    assert config_from_dict(colocated()).shares_vllm_weights()
    assert not config_from_dict(minimal_run()).shares_vllm_weights()  # the hf engine
    server = colocated(rollout={"engine": "vllm", "vllm": {"mode": "server"}})
    assert config_from_dict(server).vllm_share_blocker() is None  # nothing to share
    assert not config_from_dict(server).shares_vllm_weights()
    blocked = {
        "pipeline.mode is async with full fine-tuning": colocated(pipeline={"mode": "async"}),
        "model.quantization is nf4": colocated(
            model={"name_or_path": "m", "quantization": "nf4"}, lora={"enabled": True}
        ),
        "trust_remote_code": colocated(model={"name_or_path": "m", "trust_remote_code": True}),
        "tensor_parallel_size is 2": colocated(
            rollout={"engine": "vllm", "vllm": {"engine_kwargs": {"tensor_parallel_size": 2}}}
        ),
        r"rollout.vllm.dtype \(bfloat16\) differs from model.dtype \(float32\)": colocated(
            model={"name_or_path": "m", "dtype": "float32"},
            rollout={"engine": "vllm", "vllm": {"dtype": "bfloat16"}},
        ),
    }
    for why, raw in blocked.items():
        cfg = config_from_dict(raw)  # auto: two copies, said at start-up
        assert not cfg.shares_vllm_weights()
        assert why.replace("\\", "") in cfg.vllm_share_blocker()[0]
        raw["rollout"].setdefault("vllm", {})["share_weights"] = True
        with pytest.raises(ConfigError, match=f"share_weights is true, but .*{why}.*; set "):
            config_from_dict(raw)
    lora_async = colocated(pipeline={"mode": "async"}, lora={"enabled": True})
    assert config_from_dict(lora_async).shares_vllm_weights()  # adapters are copied at sync


def test_dtypes_are_compared_as_dtypes_and_a_worker_elsewhere_rules_sharing_out():
    for vllm_name, model_dtype in (("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")):
        lora = {"enabled": model_dtype == "float16"}  # full float16 fine-tuning is refused
        raw = colocated(model={"name_or_path": "m", "dtype": model_dtype}, lora=lora)
        raw["rollout"]["vllm"] = {"dtype": vllm_name, "share_weights": True}
        cfg = config_from_dict(raw)  # vLLM's own name for the same dtype: no refusal
        assert cfg.vllm_share_blocker() is None and cfg.rollout.vllm.weight_dtype() == model_dtype
    raw = colocated(model={"name_or_path": "m", "dtype": "float32"})
    raw["rollout"]["vllm"] = {"dtype": "half"}
    assert "rollout.vllm.dtype (half) differs from model.dtype (float32)" in config_from_dict(raw).vllm_share_blocker()[0]  # fmt: skip
    raw["rollout"]["vllm"] = {"dtype": "fp16"}  # not a name vLLM takes: one sentence now
    with pytest.raises(ConfigError, match="rollout.vllm.dtype"):
        config_from_dict(raw)
    for executor in ("mp", "ray"):
        raw = colocated(rollout={"engine": "vllm", "vllm": {"engine_kwargs": {"distributed_executor_backend": executor}}})  # fmt: skip
        why, fix = config_from_dict(raw).vllm_share_blocker()
        assert f"distributed_executor_backend is {executor}, so vLLM's worker runs in another process" in why
        raw["rollout"]["vllm"]["share_weights"] = True
        with pytest.raises(ConfigError, match="share_weights is true, but .*distributed_executor_backend"):
            config_from_dict(raw)
    uni = colocated(rollout={"engine": "vllm", "vllm": {"engine_kwargs": {"distributed_executor_backend": "uni"}}})  # fmt: skip
    assert config_from_dict(uni).vllm_share_blocker() is None


def test_async_full_fine_tuning_on_shared_weights_is_refused_naming_the_keys():
    raw = colocated(pipeline={"mode": "async"})
    raw["rollout"]["vllm"] = {"share_weights": True}
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    message = str(err.value)
    for key in ("rollout.vllm.share_weights", "pipeline.mode", "lora.enabled"):
        assert key in message
    assert message.count(".") >= 3 and "\n" not in message  # one sentence


def test_options_sharing_makes_pointless_are_named():
    sync_interval = colocated(pipeline={"sync_interval": 2, "max_staleness": 1})
    assert any("pipeline.sync_interval" in s for s in ignored_options(config_from_dict(sync_interval)))
    server = colocated(rollout={"engine": "vllm", "vllm": {"mode": "server", "adapter_sync": "files"}})
    assert any("rollout.vllm.adapter_sync" in s for s in ignored_options(config_from_dict(server)))


def test_the_planner_counts_one_copy_when_the_weights_are_shared(tmp_path):
    model = make_tiny_model(vocab_size=64, hidden_size=32)
    model.save_pretrained(tmp_path)
    raw = colocated(model={"name_or_path": str(tmp_path), "dtype": "float32"}, run={"device": "cpu"})
    shared = plan_memory(config_from_dict(raw))
    raw["rollout"]["vllm"] = {"share_weights": False}
    copies = plan_memory(config_from_dict(raw))
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert shared["generation_copy"] == 0 and copies["generation_copy"] >= weights
    assert copies["total"] - shared["total"] == copies["generation_copy"]
    assert shared[SAVED_BY_SHARING] == copies["generation_copy"] and SAVED_BY_SHARING not in copies
    shown = render_plan(shared, config_from_dict(colocated(model={"name_or_path": str(tmp_path)})))
    assert "generation_copy is 0 if sharing holds at start-up: colocated vLLM then serves from the policy's weights" in shown
    assert f"  {SAVED_BY_SHARING}" not in shown  # a note, not a term
    hf = colocated(model={"name_or_path": str(tmp_path)})
    hf["rollout"]["engine"] = "hf"
    assert plan_memory(config_from_dict(hf))["generation_copy"] == 0


def bin_only(model: nn.Module, path):
    """`model` saved as pytorch_model.bin only (transformers and vLLM load it)."""
    model.save_pretrained(path)
    for file in path.glob("*.safetensors"):
        file.unlink()
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    assert (path / "pytorch_model.bin").is_file() and not list(path.glob("*.safetensors"))
    return path


def test_the_plan_counts_the_copy_a_run_keeps_for_a_reason_known_before_start(tmp_path):
    model = make_tiny_model(vocab_size=64, hidden_size=32)
    weights = sum(p.numel() for p in model.parameters()) * 4
    raw = colocated(model={"name_or_path": str(bin_only(model, tmp_path / "bin")), "dtype": "float32"}, run={"device": "cpu"})  # fmt: skip
    cfg = config_from_dict(raw)
    plan = plan_memory(cfg)
    assert plan["generation_copy"] >= weights and SAVED_BY_SHARING not in plan
    assert "generation_copy: colocated vLLM keeps its own copy, because " in render_plan(plan, cfg)
    assert "holds no .safetensors checkpoint" in render_plan(plan, cfg)
    model.save_pretrained(tmp_path / "st")  # the same model as safetensors: one copy, hedged
    raw["model"]["name_or_path"] = str(tmp_path / "st")
    raw["model"]["dtype"] = "auto"  # float32 on CPU ...
    raw["rollout"]["vllm"] = {"dtype": "bfloat16"}  # ... so vLLM in bfloat16 keeps its own
    assert plan_memory(config_from_dict(raw))["generation_copy"] >= weights
    raw["rollout"]["vllm"] = {"dtype": "float"}  # vLLM's name for float32
    cfg = config_from_dict(raw)
    assert plan_memory(cfg)["generation_copy"] == 0
    assert "if sharing holds at start-up" in render_plan(plan_memory(cfg), cfg)


def test_a_model_without_safetensors_keeps_two_copies_before_vllm_starts(tmp_path, caplog, monkeypatch):
    """No vLLM is imported: the reason is known from the files (the run used to start the
    engine, change its layers and then refuse, so the first file sync crashed)."""
    import leangrpo.rollout.vllm.sharing as sharing

    def no_vllm():
        raise AssertionError("vLLM was imported for a refusal the files tell")

    monkeypatch.setattr(sharing, "import_vllm", no_vllm)
    model = make_tiny_model(vocab_size=64, hidden_size=32)
    raw = colocated(model={"name_or_path": str(bin_only(model, tmp_path / "bin")), "dtype": "float32"})  # fmt: skip
    with caplog.at_level(logging.INFO, logger="leangrpo"):
        assert start_shared_vllm(config_from_dict(raw), torch.device("cpu")) is None
    (line,) = [r.getMessage() for r in caplog.records if "own copy" in r.getMessage()]
    assert line.endswith("bin holds no .safetensors checkpoint to check vLLM's tensors against")
    raw["rollout"]["vllm"] = {"share_weights": True}
    with pytest.raises(RunError, match=r"share_weights is true, but .*holds no .safetensors checkpoint.*; use the model saved as safetensors"):  # fmt: skip
        start_shared_vllm(config_from_dict(raw), torch.device("cpu"))


class Fused(nn.Module):
    """One parameter holding several transformers weights along dim 0, as vLLM's
    QKVParallelLinear / MergedColumnParallelLinear (`output_partition_sizes`)."""

    def __init__(self, parts: list[torch.Tensor], biases: list[torch.Tensor] | None = None):
        super().__init__()
        self.output_partition_sizes = [p.shape[0] for p in parts]
        self.input_size_per_partition = parts[0].shape[1]
        self.weight = nn.Parameter(torch.cat(parts).clone(), requires_grad=False)
        if biases is not None:
            self.bias = nn.Parameter(torch.cat(biases).clone(), requires_grad=False)


class PaddedVocab(nn.Module):
    """vLLM's VocabParallelEmbedding / ParallelLMHead: rows padded to a multiple of 64."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.org_vocab_size = weight.shape[0]
        rows = -(-weight.shape[0] // 64) * 64
        padded = torch.zeros(rows, weight.shape[1])
        padded[: weight.shape[0]] = weight
        self.weight = nn.Parameter(padded, requires_grad=False)


def vllm_shaped(hf: nn.Module, swap_gate_up: bool = False) -> nn.Module:
    """A module whose parameters are laid out as vLLM lays out a Qwen2's (names included)."""
    root = nn.Module()
    root.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}  # fmt: skip
    root.model = nn.Module()
    root.model.embed_tokens = PaddedVocab(hf.model.embed_tokens.weight.detach())
    root.model.norm = nn.Module()
    root.model.norm.weight = nn.Parameter(hf.model.norm.weight.detach().clone())
    root.model.layers = nn.ModuleList()
    for layer in hf.model.layers:
        a, m = layer.self_attn, layer.mlp
        new = nn.Module()
        new.self_attn = nn.Module()
        new.self_attn.qkv_proj = Fused(
            [a.q_proj.weight.detach(), a.k_proj.weight.detach(), a.v_proj.weight.detach()],
            [a.q_proj.bias.detach(), a.k_proj.bias.detach(), a.v_proj.bias.detach()],
        )
        new.self_attn.o_proj = Fused([a.o_proj.weight.detach()])  # a row-parallel linear
        gate_up = [m.gate_proj.weight.detach(), m.up_proj.weight.detach()]
        new.mlp = nn.Module()
        new.mlp.gate_up_proj = Fused(gate_up[::-1] if swap_gate_up else gate_up)
        new.mlp.down_proj = Fused([m.down_proj.weight.detach()])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            setattr(new, norm, nn.Module())
            getattr(new, norm).weight = nn.Parameter(getattr(layer, norm).weight.detach().clone())
        root.model.layers.append(new)
    root.lm_head = PaddedVocab(hf.lm_head.weight.detach())
    return root


@pytest.fixture
def tiny_dir(tmp_path):
    hf = make_tiny_model(vocab_size=40, hidden_size=32)  # untied; 40 rows pad to 64
    hf.save_pretrained(tmp_path / "m")
    return hf, ModelConfig(name_or_path=str(tmp_path / "m"))


def test_views_of_fused_and_padded_tensors_build_the_policy_without_a_copy(tiny_dir):
    hf, model_cfg = tiny_dir
    vmodel = vllm_shaped(hf)
    views, problems = vllm_views(vmodel)
    assert problems == [] and sorted(views) == sorted(n for n, _ in hf.named_parameters())
    policy = model_on_views(model_cfg, views, torch.float32)
    storages = {p.untyped_storage().data_ptr() for p in vmodel.parameters()}
    for name, param in policy.named_parameters():
        assert same_memory(param, views[name]) and param.untyped_storage().data_ptr() in storages
    qkv = vmodel.model.layers[1].self_attn.qkv_proj.weight
    k = policy.model.layers[1].self_attn.k_proj.weight  # spelled out: k follows q's rows
    assert k.storage_offset() == qkv.storage_offset() + hf.model.layers[1].self_attn.q_proj.weight.shape[0] * qkv.stride(0)
    assert policy.lm_head.weight.shape[0] == 40 and vmodel.lm_head.weight.shape[0] == 64
    ids = torch.tensor([[1, 5, 9, 39]])
    assert torch.equal(policy(ids).logits, hf(ids).logits)
    assert checkpoint_mismatch(policy, model_cfg) is None
    fused = vmodel.model.layers[0].self_attn.qkv_proj.weight
    v_rows = policy.model.layers[0].self_attn.v_proj.weight.shape[0]
    before = fused[-v_rows:].clone()
    with torch.no_grad():  # an optimizer's in-place update lands in vLLM's tensor
        policy.model.layers[0].self_attn.v_proj.weight.add_(1.0)
    assert torch.equal(fused[-v_rows:], before + 1.0)
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(policy, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    assert unshared_parameters(wrapped, views) == []
    assert unshared_parameters(make_tiny_model(vocab_size=40, hidden_size=32), views)


def test_a_layout_that_maps_by_shape_but_not_by_meaning_is_caught(tiny_dir):
    hf, model_cfg = tiny_dir
    # gate and up swapped: every shape fits (both [I, H]), the values do not
    views, problems = vllm_views(vllm_shaped(hf, swap_gate_up=True))
    assert problems == []
    policy = model_on_views(model_cfg, views, torch.float32)
    assert "mlp.gate_proj.weight differs from the checkpoint" in checkpoint_mismatch(policy, model_cfg)
    vmodel = vllm_shaped(hf)
    vmodel.model.layers[0].self_attn.qkv_proj.output_partition_sizes = [32, 16]
    assert vllm_views(vmodel)[1][0] == "model.layers.0.self_attn.qkv_proj.weight fuses ['q_proj', 'k_proj', 'v_proj'] in sizes [32, 16]"  # fmt: skip


def packed_as_on_cpu(vmodel: nn.Module, dtype=torch.float32) -> nn.Module:
    """As vLLM's CPU path leaves its linears: each weight packed elsewhere, `weight` empty."""
    for module in vmodel.modules():
        if isinstance(module, Fused):
            module.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
    return vmodel


def test_the_layout_is_checked_before_vllms_layers_change(tiny_dir, tmp_path):
    """What refuses sharing before vLLM's emptied CPU weights are made plain again: names,
    ties, shapes and dtypes against the transformers skeleton, and the checkpoint's names;
    each emptied weight is planned from its layer (meta), never read."""
    from leangrpo.rollout.vllm.views import NotShared, check_layout

    hf, model_cfg = tiny_dir
    planned, problems = vllm_views(packed_as_on_cpu(vllm_shaped(hf)), stand_ins=True)
    assert problems == [] and sorted(planned) == sorted(n for n, _ in hf.named_parameters())
    for name, param in hf.named_parameters():
        assert planned[name].shape == param.shape, name
    assert planned["model.layers.0.mlp.down_proj.weight"].is_meta
    assert not planned["model.norm.weight"].is_meta  # kept by vLLM: the real tensor
    check_layout(model_cfg, planned, torch.float32)  # the layout holds

    def refused(views, why, cfg=model_cfg):
        with pytest.raises(NotShared, match=why):
            check_layout(cfg, views, torch.float32)

    fused_qkv = vllm_shaped(hf)  # a checkpoint fused as vLLM is (Phi-3's qkv_proj)
    fused_qkv.packed_modules_mapping = {"qkv_proj": ["qkv_proj"]}
    assert "fuses ['qkv_proj'] in sizes" in vllm_views(packed_as_on_cpu(fused_qkv), stand_ins=True)[1][0]
    renamed = dict(planned)
    renamed["model.layers.0.mlp.fused_gate_up.weight"] = renamed.pop("model.layers.0.mlp.up_proj.weight")
    refused(renamed, "do not map onto Qwen2ForCausalLM: unexpected key model.layers.0.mlp.fused_gate_up.weight")  # fmt: skip
    refused({k: v for k, v in planned.items() if "norm" not in k}, "missing key model.layers.0.input_layernorm.weight")  # fmt: skip
    narrow = dict(planned, **{"model.layers.1.self_attn.o_proj.weight": torch.empty(32, 16, device="meta")})  # fmt: skip
    refused(narrow, r"mismatched key model.layers.1.self_attn.o_proj.weight \(\(32, 16\) in vLLM")
    half = dict(planned, **{"lm_head.weight": planned["lm_head.weight"].to(torch.bfloat16)})
    refused(half, "vLLM holds lm_head.weight in torch.bfloat16, not torch.float32")
    as_bin = ModelConfig(name_or_path=str(bin_only(hf, tmp_path / "bin")))
    refused(planned, "no .safetensors checkpoint of .*bin to check vLLM's tensors against", as_bin)
    from safetensors.torch import save_file

    partial = tmp_path / "partial"
    hf.save_pretrained(partial)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "model.norm.weight"}
    save_file(state, str(partial / "model.safetensors"))
    refused(planned, "model.norm.weight is not in the checkpoint under that name", ModelConfig(name_or_path=str(partial)))  # fmt: skip


def test_a_worker_in_another_process_or_a_copied_model_is_never_shared():
    """The model `collective_rpc` hands over must be the one the worker serves from, in this
    process: a pickled copy (another executor: the mp backend, ray; on GPUs a copy would
    otherwise be "shared" silently) is refused before anything changes."""
    import copy
    from types import SimpleNamespace as NS

    from leangrpo.rollout.vllm.sharing import SharedVLLM
    from leangrpo.rollout.vllm.views import NotShared

    backend = object.__new__(SharedVLLM)  # its methods on a scripted vLLM (no start-up)
    config = NS(parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1), model_config=NS(quantization=None))  # fmt: skip
    backend.llm = NS(llm_engine=NS(engine_core=type("InprocClient", (), {})(), vllm_config=config))
    served = nn.Linear(4, 4)
    storages = sorted({p.untyped_storage().data_ptr() for p in served.parameters()})
    answers = {"leangrpo_whereabouts": [(os.getpid(), storages)], "leangrpo_model": [served]}
    backend.call_workers = lambda method, *args: answers[method]
    assert backend._model_in_this_process() == (served, set(storages))
    answers["leangrpo_model"] = [copy.deepcopy(served)]  # what a serialiser hands back
    with pytest.raises(NotShared, match="the model vLLM's worker handed over is a copy"):
        backend._model_in_this_process()
    answers["leangrpo_whereabouts"] = [(os.getpid() + 1, storages)]
    with pytest.raises(NotShared, match=r"vLLM's worker runs in another process \(pid"):
        backend._model_in_this_process()


def test_share_weights_true_stops_before_vllm_starts_when_it_cannot_share(caplog):
    raw = colocated(model={"name_or_path": "m", "dtype": "auto"})
    raw["rollout"]["vllm"] = {"dtype": "bfloat16", "share_weights": True}
    cfg = config_from_dict(raw)  # model.dtype auto: only the run knows it is float32 on CPU
    with pytest.raises(RunError, match=r"share_weights is true, but rollout.vllm.dtype \(bfloat16\) differs from the trainer's dtype \(float32\); use rollout.vllm.dtype: auto"):  # fmt: skip
        start_shared_vllm(cfg, torch.device("cpu"))
    cfg.rollout.vllm.share_weights = "auto"
    with caplog.at_level(logging.INFO, logger="leangrpo"):
        assert start_shared_vllm(cfg, torch.device("cpu")) is None
    (line,) = [r.getMessage() for r in caplog.records if "own copy" in r.getMessage()]
    assert line == "colocated vLLM keeps its own copy of the weights: rollout.vllm.dtype (bfloat16) differs from the trainer's dtype (float32)"  # fmt: skip


def test_what_a_vllm_worker_changes_in_the_process_is_put_back():
    """What vLLM's workers do to the trainer's process when they start in it: the GPU
    worker sets 1 thread (`set_torch_threads_for_runtime`; the CPU worker leaves the count,
    so the real-vLLM test below cannot see this one), the CPU worker makes
    `torch.set_num_threads` a no-op, both seed random, numpy and torch."""
    import random

    import numpy as np

    from leangrpo.rollout.vllm.local import keep_process_state

    def draws() -> tuple:
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    own, threads = torch.set_num_threads, torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
        expected = draws()
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
        with keep_process_state():
            torch.set_num_threads(1)
            torch.set_num_threads = lambda n: None
            random.seed(0), np.random.seed(0), torch.manual_seed(0)
        assert torch.set_num_threads is own and torch.get_num_threads() == 3
        assert draws() == expected
    finally:
        torch.set_num_threads = own
        torch.set_num_threads(threads)


def test_adapters_handed_over_in_memory_have_unique_paths_that_exist_nowhere(tmp_path):
    slots = AdapterSlots(tmp_path / "adapters")
    first, second = slots.in_memory("run", 1), slots.in_memory("run", 2)
    assert first.path.parent == IN_MEMORY_ADAPTERS and first.path.is_absolute()
    assert first.path != second.path and first.int_id != second.int_id and not first.path.exists()
    slots.add(first)
    slots.add(second)
    assert [s.key for s in slots.retire(1, lambda key: False)] == [("run", 1)]
    from peft import LoraConfig

    config = adapter_config_dict(LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["r"] == 4
    json.dumps(config)  # what adapter_config.json would hold


# --------------------------------------------------------------------------- real vLLM

BLOCK = 32  # vLLM's CPU block size must be a multiple of 32
ENGINE_KWARGS = "{kv_cache_memory_bytes: 67108864}"  # 64 MiB: several engines in one process
RUN = [
    "rollout.engine=vllm",
    "run.max_steps=4",
    "rollout.prompts_per_batch=8",
    "eval.every_steps=2",
    "eval.num_prompts=16",
    "checkpoint.every_steps=1",
    "checkpoint.keep_last=2",
    "checkpoint.save_final_model=false",
    "logging.progress_bar=false",
    "logging.samples_every=0",
    f"rollout.vllm.engine_kwargs={ENGINE_KWARGS}",
]
# not all-linear: a subset of what vLLM serves LoRA on (embed_tokens it does not serve)
LORA = ["lora.enabled=true", "lora.r=8", "train.learning_rate=2e-3", "lora.target_modules=[q_proj, v_proj, up_proj, down_proj]"]  # fmt: skip


@dataclass
class SharedDemo:
    cfg: object
    started: object
    policy: object
    engines: object
    process_kept: dict


@pytest.fixture(scope="module")
def shared_demo(tmp_path_factory):
    """The demo model's policy (full fine-tuning) on a colocated engine's tensors, prefix
    caching on (blocks of 32 tokens)."""
    from leangrpo.model.policy import load_tokenizer
    from leangrpo.rollout.factory import make_engines, start_shared_engine

    kwargs = "{kv_cache_memory_bytes: 67108864, enable_prefix_caching: true, block_size: 32}"
    cfg = load_config(
        DEMO_YAML,
        [f"run.output_dir={tmp_path_factory.mktemp('demo')}", "rollout.engine=vllm",
         f"rollout.vllm.engine_kwargs={kwargs}", "rollout.vllm.share_weights=true"],
    )  # fmt: skip
    tokenizer = load_tokenizer(cfg.model)
    torch.set_num_threads(3)  # not 1, which vLLM's GPU worker sets
    own_set_num_threads, rng = torch.set_num_threads, torch.get_rng_state()
    started = start_shared_engine(cfg, torch.device("cpu"))
    kept = {
        "set_num_threads": torch.set_num_threads is own_set_num_threads,
        "threads": torch.get_num_threads(),
        "rng": torch.equal(torch.get_rng_state(), rng),
    }
    torch.set_num_threads(1)
    policy = started.build_policy(cfg, tokenizer, torch.device("cpu"))
    engines = make_engines(cfg, policy, None, None, started=started.engine)
    yield SharedDemo(cfg, started, policy, engines, kept)
    engines.close()


@pytest.mark.vllm
def test_every_base_parameter_of_the_demo_policy_is_a_view_of_vllms_tensor(shared_demo):
    policy, views = shared_demo.policy, shared_demo.started.views
    (vmodel,) = shared_demo.engines.rollout.backend.call_workers("leangrpo_model")
    storages = {p.untyped_storage().data_ptr() for p in vmodel.parameters()}
    params = dict(policy.model.named_parameters())
    assert len(params) == len(views) - 1  # lm_head is embed_tokens (tied): one parameter
    for name, param in params.items():
        assert same_memory(param, views[name]), name  # pointer, offset, shape, strides
        assert param.untyped_storage().data_ptr() in storages, name
    qkv = vmodel.model.layers[2].self_attn.qkv_proj.weight
    q, k = policy.model.model.layers[2].self_attn.q_proj.weight, policy.model.model.layers[2].self_attn.k_proj.weight  # fmt: skip
    assert q.storage_offset() == qkv.storage_offset()
    assert k.storage_offset() == qkv.storage_offset() + q.shape[0] * qkv.stride(0)
    embed = policy.model.model.embed_tokens.weight
    assert embed.shape[0] == 32 and vmodel.model.embed_tokens.weight.shape[0] == 64  # padding off
    assert policy.model.lm_head.weight is embed
    assert shared_demo.engines.rollout_shares_weights  # full fine-tuning: live weights


@pytest.mark.vllm
def test_starting_vllm_in_process_leaves_the_trainers_process_as_it_was(shared_demo):
    assert shared_demo.process_kept == {"set_num_threads": True, "threads": 3, "rng": True}


def no_files(*args, **kwargs):
    raise AssertionError("a sync of shared weights wrote files")


def perturb(model: nn.Module, scale: float, seed: int) -> None:
    """An optimizer-like in-place update of every parameter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def demo_prompts(tokenizer) -> list[Prompt]:
    return [Prompt(uid=i, text=t, ids=tokenizer(t)["input_ids"]) for i, t in enumerate(["12+3=", "47-9=", "5+5="])]  # fmt: skip


def max_logprob_gap(model, prompts, groups, params) -> float:
    gaps = [
        (teacher_forced_logprobs(model, p.ids, c.ids, params).double() - torch.tensor(c.logprobs, dtype=torch.float64)).abs()  # fmt: skip
        for p, g in zip(prompts, groups)
        for c in g
    ]
    return float(torch.cat(gaps).max())


@pytest.mark.vllm
def test_logprobs_of_the_policy_and_of_vllm_agree_on_shared_weights(shared_demo, monkeypatch):
    """After an in-place update of every weight and a sync that writes no files: an engine
    serving a copy (two copies, a stale engine) would sample from the old weights."""
    engine, policy = shared_demo.engines.rollout, shared_demo.policy
    prompts = demo_prompts(policy.tokenizer)
    perturb(policy.model, scale=0.05, seed=3)
    monkeypatch.setattr("leangrpo.rollout.vllm.engine.write_weight_buckets", no_files)
    version = engine.version + 1
    engine.update_weights(policy.named_trainable_tensors(), version)
    for params in (
        SamplingParams(temperature=0.8, max_new_tokens=6, seed=5),
        SamplingParams(temperature=1.2, top_k=6, min_p=0.05, max_new_tokens=6, seed=6),
    ):
        groups = engine.generate(prompts, params, 4, version)
        gaps = [
            (teacher_forced_logprobs(policy.model, p.ids, c.ids, params).double() - torch.tensor(c.logprobs, dtype=torch.float64)).abs()  # fmt: skip
            for p, g in zip(prompts, groups)
            for c in g
        ]
        assert float(torch.cat(gaps).mean()) < 1e-3  # as tests/rollout/test_vllm.py, unshared
        assert float(torch.cat(gaps).max()) < 1e-4


@pytest.mark.vllm
def test_an_optimizer_step_is_what_vllm_serves_next(shared_demo, monkeypatch):
    """After one AdamW step on the policy, vLLM's greedy completion equals the hf engine's
    with the new weights, and its first request does not reuse the prefix cache that the
    old weights filled (which it would have, without the reset: asserted before the sync)."""
    from vllm import SamplingParams as VLLMSampling
    from vllm.inputs import TokensPrompt

    from leangrpo.rollout.hf.engine import HFEngine

    engine, policy = shared_demo.engines.rollout, shared_demo.policy
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 32, (48,), generator=gen).tolist()  # one full block + 16 (0: pad, 1: EOS)
    prompt = [Prompt(uid=0, text="", ids=ids)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)

    def vllm_itself() -> tuple[list[int], int]:
        """vLLM's greedy ids, and how many prompt tokens its prefix cache served."""
        (out,) = engine.backend.llm.generate(
            [TokensPrompt(prompt_token_ids=ids)], VLLMSampling(temperature=0.0, max_tokens=16), use_tqdm=False
        )  # fmt: skip
        return list(out.outputs[0].token_ids), out.num_cached_tokens

    before = engine.generate(prompt, greedy, 1, engine.version)[0][0].ids
    assert vllm_itself()[1] == BLOCK  # the prompt's first block is cached
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    x = torch.tensor([ids + before])
    policy.model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    hf = HFEngine(policy.model, policy.tokenizer, share_weights=True)
    want = hf.generate(prompt, greedy, 1, 0)[0][0].ids
    assert want != before  # the step changed what greedy decoding writes
    assert vllm_itself()[1] == BLOCK  # without a sync, the stale block would be served

    monkeypatch.setattr("leangrpo.rollout.vllm.engine.write_weight_buckets", no_files)
    version = engine.version + 1
    engine.update_weights(policy.named_trainable_tensors(), version)
    first, cached = vllm_itself()
    assert cached == 0 and first == want  # recomputed, with the new weights
    assert engine.generate(prompt, greedy, 1, version)[0][0].ids == want


@pytest.mark.vllm
def test_a_sync_of_tensors_that_are_not_vllms_own_writes_into_the_one_copy(shared_demo, monkeypatch):
    """Full weights from elsewhere (a checkpoint's, say): copied into the tensors vLLM and
    the policy share (vLLM's own reload would replace them, or crash on CPU), checked
    name by name first; vLLM then serves them, and the next in-place sync too."""
    import copy

    engine, policy = shared_demo.engines.rollout, shared_demo.policy
    backend, prompts = engine.backend, demo_prompts(policy.tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=7)
    monkeypatch.setattr("leangrpo.rollout.vllm.engine.write_weight_buckets", no_files)
    other = copy.deepcopy(policy.model)
    perturb(other, scale=0.05, seed=4)
    named = list(other.state_dict().items())  # tied: embed_tokens and lm_head, one tensor
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    version = engine.version
    with pytest.raises(ValueError, match="model.extra.weight is not one of the weights colocated vLLM shares"):
        engine.update_weights([*named, ("model.extra.weight", torch.zeros(2))], version + 1)
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(4, 64\), the shared weight \(32, 64\)"):
        engine.update_weights([("lm_head.weight", torch.zeros(4, 64))], version + 1)
    assert engine.version == version
    assert all(torch.equal(p, before[n]) for n, p in policy.model.named_parameters())  # untouched
    engine.update_weights(named, version + 1)
    for name, param in policy.model.named_parameters():
        assert torch.equal(param, other.get_parameter(name)), name
    (vmodel,) = backend.call_workers("leangrpo_model")
    assert unshared_parameters(policy.model, vllm_views(vmodel)[0]) == []  # still one copy
    assert max_logprob_gap(policy.model, prompts, engine.generate(prompts, params, 4, version + 1), params) < 1e-4  # fmt: skip
    perturb(policy.model, scale=0.05, seed=5)
    engine.update_weights(policy.named_trainable_tensors(), version + 2)
    assert max_logprob_gap(policy.model, prompts, engine.generate(prompts, params, 4, version + 2), params) < 1e-4  # fmt: skip


@dataclass
class Run:
    rows: list[dict]
    params: dict[str, torch.Tensor]
    shared: bool
    unshared: list[str] | None = None  # base parameters not on vLLM's tensors (shared runs)
    in_memory_adapters: bool | None = None


def run_demo(out, overrides: list[str], arm=None) -> Run:
    """The demo run on colocated vLLM to run.max_steps (or a resume of it); `arm(trainer)`
    may instrument the trainer before it trains."""
    from leangrpo.metrics.logger import read_metrics
    from leangrpo.train import Trainer

    cfg = load_config(DEMO_YAML, [f"run.output_dir={out}", *RUN, *overrides])
    trainer = Trainer(cfg)
    backend = trainer.engines.rollout.backend
    shared = bool(getattr(backend, "storages", None))
    unshared = None
    if shared:
        (vmodel,) = backend.call_workers("leangrpo_model")
        unshared = unshared_parameters(trainer.policy.model, vllm_views(vmodel)[0])
    if arm is not None:
        arm(trainer)
    try:
        trainer.train()
    finally:
        params = {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}
        slots = list(backend.adapters.slots.values())
    in_memory = all(s.path.parent == IN_MEMORY_ADAPTERS for s in slots) if slots else None
    return Run(read_metrics(out), params, shared, unshared, in_memory)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted runs, made once: (mode, variant) -> Run."""
    made: dict[tuple[str, str], Run] = {}

    def get(mode: str, variant: str) -> Run:
        if (mode, variant) not in made:
            overrides = (LORA if mode == "lora" else []) + [
                f"rollout.vllm.share_weights={'true' if variant == 'shared' else 'false'}"
            ]
            out = tmp_path_factory.mktemp(f"{mode}-{variant}") / "run"
            made[mode, variant] = run_demo(out, overrides)
        return made[mode, variant]

    return get


def assert_same_run(a: Run, b: Run, tol: float, param_tol: float) -> None:
    """Same samples (rewards, lengths, evaluations exactly), losses within `tol`, weights
    within `param_tol` (AdamW turns any difference in a near-zero gradient into one of up
    to the learning rate: vLLM's CPU kernels differ from F.linear by ~1e-6 in log-probs)."""
    exact = ("reward/mean", "completions/mean_length", "loss/tokens", "eval/reward")
    rows_a = [r for r in a.rows if "loss" in r or "eval/reward" in r]
    rows_b = [r for r in b.rows if "loss" in r or "eval/reward" in r]
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b):
        assert {k: ra.get(k) for k in exact} == {k: rb.get(k) for k in exact}, ra["step"]
        if "loss" in ra:
            assert abs(ra["loss"] - rb["loss"]) <= tol and abs(ra["loss/entropy"] - rb["loss/entropy"]) <= tol
    assert max(float((a.params[k] - b.params[k]).abs().max()) for k in a.params) <= param_tol


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_grpo_on_shared_weights_equals_grpo_on_two_copies(straight, mode):
    shared, copies = straight(mode, "shared"), straight(mode, "two_copies")
    assert shared.shared and not copies.shared
    assert shared.unshared == []  # every frozen base parameter (LoRA: under peft) is vLLM's
    if mode == "lora":
        assert shared.in_memory_adapters and copies.in_memory_adapters is False
    lr = 2e-3 if mode == "lora" else 2e-4
    assert_same_run(shared, copies, tol=1e-5, param_tol=0.1 * lr)
    versions = [r["version"] for r in shared.rows if "loss" in r]
    assert versions == [1.0, 2.0, 3.0, 4.0]
    assert all(r["staleness/max"] == 0 for r in shared.rows if "loss" in r)


def computes_with_plain_weights(backend) -> list[str]:
    """vLLM's layers that `leangrpo_plain_weights` switched to F.linear (CPU)."""
    import torch.nn.functional as F

    (vmodel,) = backend.call_workers("leangrpo_model")
    return [n for n, m in vmodel.named_modules() if getattr(m, "cpu_linear", None) is F.linear]


@pytest.mark.vllm
def test_a_refusal_after_vllms_layers_changed_leaves_an_engine_that_trains_as_two_copies(straight, tmp_path, monkeypatch, caplog):  # fmt: skip
    """share_weights auto, refused by a check that needs the weights' values (run after the
    CPU layers became plain): vLLM's own processing comes back, and the run (file syncs
    every step, evaluations, checkpoints) equals the two-copy run."""
    forced = "vLLM's tensor for model.norm.weight differs from the checkpoint's (forced)"
    monkeypatch.setattr("leangrpo.rollout.vllm.sharing.checkpoint_mismatch", lambda model, cfg: forced)
    restored: list = []

    def check(trainer) -> None:
        backend = trainer.engines.rollout.backend
        assert type(backend).__name__ == "SharedVLLM" and not backend.storages
        restored.append(computes_with_plain_weights(backend))

    with caplog.at_level(logging.INFO, logger="leangrpo"):
        run = run_demo(tmp_path / "run", ["rollout.vllm.share_weights=auto"], arm=check)
    lines = [r.getMessage() for r in caplog.records if "own copy" in r.getMessage()]
    assert lines == [f"colocated vLLM keeps its own copy of the weights: {forced}"]
    assert restored == [[]] and not run.shared  # packed again, as vLLM left them at load
    assert_same_run(run, straight("full", "two_copies"), tol=1e-5, param_tol=0.1 * 2e-4)


def phi3_model(path):
    """A tiny Phi-3 (q/k/v and gate/up fused in the checkpoint too) with the demo's tokenizer."""
    from transformers import AutoTokenizer, Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=1, tie_word_embeddings=False)  # fmt: skip
    Phi3ForCausalLM(config).to(torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(DEMO_MODEL).save_pretrained(path)
    return path


@pytest.mark.vllm
def test_a_layout_the_views_cannot_express_is_refused_before_vllms_layers_change(tmp_path, caplog):
    """Phi-3 (fused in its checkpoint too): the planned views already fail, so vLLM's layers
    are never touched; the policy loads its own copy and file syncs are served."""
    from leangrpo.model.policy import load_policy, load_tokenizer
    from leangrpo.rollout.factory import make_engines, start_shared_engine

    cfg = load_config(DEMO_YAML, [f"run.output_dir={tmp_path / 'run'}", f"model.name_or_path={phi3_model(tmp_path / 'phi3')}", "rollout.engine=vllm", f"rollout.vllm.engine_kwargs={ENGINE_KWARGS}"])  # fmt: skip
    with caplog.at_level(logging.INFO, logger="leangrpo"):
        started = start_shared_engine(cfg, torch.device("cpu"))
    (line,) = [r.getMessage() for r in caplog.records if "own copy" in r.getMessage()]
    assert line.startswith("colocated vLLM keeps its own copy of the weights: vLLM's model.layers.0.self_attn.qkv_proj.weight fuses ['qkv_proj'] in sizes [128, 128, 128]")  # fmt: skip
    assert started.views is None and computes_with_plain_weights(started.engine.backend) == []
    tokenizer = load_tokenizer(cfg.model)
    policy = started.build_policy(cfg, tokenizer, torch.device("cpu")) or load_policy(cfg, tokenizer, torch.device("cpu"))  # fmt: skip
    engines = make_engines(cfg, policy, None, None, started=started.engine)
    try:
        assert not engines.rollout_shares_weights
        prompts, params = demo_prompts(tokenizer), SamplingParams(temperature=1.0, max_new_tokens=6, seed=2)
        perturb(policy.model, scale=0.05, seed=6)
        engines.rollout.update_weights(policy.named_trainable_tensors(), 1)  # through files
        groups = engines.rollout.generate(prompts, params, 4, 1)
        assert max_logprob_gap(policy.model, prompts, groups, params) < 1e-4
    finally:
        engines.close()


@pytest.mark.vllm
def test_an_adapter_on_a_module_vllm_serves_no_lora_on_is_refused_before_training(tmp_path):
    """LoRA on q_proj and embed_tokens (Qwen2: vLLM serves no LoRA on embed_tokens), shared
    weights: the in-memory sync refuses it naming the module (vLLM would serve the q_proj
    part alone), and the engines are refused before any training, the engine closed."""
    from leangrpo.model.policy import load_tokenizer
    from leangrpo.rollout.factory import make_engines, start_shared_engine

    cfg = load_config(DEMO_YAML, [f"run.output_dir={tmp_path / 'run'}", "rollout.engine=vllm", f"rollout.vllm.engine_kwargs={ENGINE_KWARGS}", "rollout.vllm.share_weights=true", *LORA[:3], "lora.target_modules=[q_proj, embed_tokens]"])  # fmt: skip
    tokenizer = load_tokenizer(cfg.model)
    started = start_shared_engine(cfg, torch.device("cpu"))
    policy = started.build_policy(cfg, tokenizer, torch.device("cpu"))
    engine = started.engine
    try:
        assert engine.backend.lora_modules() == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]  # fmt: skip
        engine.adapter_config = policy.model.peft_config["default"]
        perturb(policy.model, scale=0.5, seed=1)  # every adapter part non-zero
        why = r"lora.target_modules puts adapters on embed_tokens \(model.embed_tokens\), which vLLM does not serve LoRA on"
        with pytest.raises(ValueError, match=why):  # in memory: vLLM would keep the q_proj part
            engine.update_weights(policy.named_trainable_tensors(), 1)
        assert engine.version == 0 and not engine.backend.adapters.slots
        with pytest.raises(RunError, match=why):
            make_engines(cfg, policy, None, None, started=engine)
        assert engine.backend.llm is None  # closed by the refusal
    finally:
        engine.close()


class Interrupt:
    """Instruments a trainer's engine: `action(trainer)` once, when the `batch`-th training
    generation (8 prompts: evaluations have 16) has run `steps` engine steps, inside vLLM's
    own loop; or at the sync to `version` (`at_sync`)."""

    def __init__(self, action, batch: int = 0, steps: int = 2, at_sync: int = 0):
        self.action, self.batch, self.steps, self.at_sync = action, batch, steps, at_sync

    def __call__(self, trainer) -> None:
        backend = trainer.engines.rollout.backend
        llm_engine = backend.llm.llm_engine
        generate, step = backend.generate, llm_engine.step
        seen = {"batches": 0, "steps": 0, "armed": False}

        def counted_generate(prompt_ids, *args, **kwargs):
            if len(prompt_ids) == 8:
                seen["batches"] += 1
                seen["armed"] = seen["batches"] == self.batch
            try:
                return generate(prompt_ids, *args, **kwargs)
            finally:
                seen["armed"] = False

        def counted_step(*args, **kwargs):
            if seen["armed"]:
                seen["steps"] += 1
                if seen["steps"] == self.steps:
                    seen["armed"] = False
                    self.action(trainer)
            return step(*args, **kwargs)

        backend.generate, llm_engine.step = counted_generate, counted_step
        if self.at_sync:
            for name in ("weights_updated", "load_adapter_tensors"):
                method = getattr(backend, name)

                def at_sync(*args, _method=method, **kwargs):
                    version = kwargs.get("version", args[-1] if args else None)
                    if version == self.at_sync:
                        self.action(trainer)
                    return _method(*args, **kwargs)

                setattr(backend, name, at_sync)


def ctrl_c(trainer) -> None:
    assert signal.getsignal(signal.SIGINT) == trainer.signals._on_signal  # never pytest's
    os.kill(os.getpid(), signal.SIGINT)


class Crash(Exception):
    pass


def crash(trainer) -> None:
    raise Crash("the engine failed in the middle of generating")


@pytest.mark.vllm
def test_ctrl_c_or_a_crash_during_generation_loses_nothing_a_resume_needs(straight, tmp_path):
    """Full fine-tuning on shared weights: Ctrl-C inside vLLM's decoding of batch 2 stops
    the run at step 1 (the batch abandoned); the resume crashes inside the decoding of
    batch 4, after the checkpoint of step 3; the next resume ends as the straight run."""
    from leangrpo.stopping import RunStopped

    out, shared = tmp_path / "run", ["rollout.vllm.share_weights=true"]
    with pytest.raises(RunStopped) as stopped:
        run_demo(out, shared, arm=Interrupt(ctrl_c, batch=2))
    assert stopped.value.step == 1 and stopped.value.checkpoint == out / "checkpoints" / "step-1"
    with pytest.raises(Crash):
        run_demo(out, shared, arm=Interrupt(crash, batch=3))  # the resume's 3rd: batch 4
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-3"]
    resumed = run_demo(out, shared)
    assert_same_run(resumed, straight("full", "shared"), tol=1e-6, param_tol=1e-6)


@pytest.mark.vllm
def test_ctrl_c_during_an_in_memory_adapter_sync_loses_nothing_a_resume_needs(straight, tmp_path):
    """LoRA on shared weights: Ctrl-C while the adapter of version 2 is handed to vLLM; the
    sync completes, the run stops at step 2's boundary, the resume ends as the straight run."""
    from leangrpo.stopping import RunStopped

    out, shared = tmp_path / "run", [*LORA, "rollout.vllm.share_weights=true"]
    with pytest.raises(RunStopped) as stopped:
        run_demo(out, shared, arm=Interrupt(ctrl_c, at_sync=2))
    assert stopped.value.step == 2
    resumed = run_demo(out, shared)
    assert resumed.in_memory_adapters
    assert_same_run(resumed, straight("lora", "shared"), tol=1e-6, param_tol=1e-6)


@pytest.mark.vllm
def test_sharing_saves_one_fp32_copy_of_smollm2(tmp_path):
    """benchmarks/shared_weights.py --smallest: SmolLM2-135M (Llama layout, tied
    embeddings), full fine-tuning, each variant in a process of its own (generation, a
    training step, a weight sync, generation again): the peak RSS of trainer + colocated
    vLLM is at least one fp32 copy (~0.5 GiB) lower when they share the weights, and after
    the sync every base parameter of the policy is still a view of vLLM's tensor (pointer,
    offset): the sync left them in place. Its times are measured, not judged."""
    from leangrpo.model.smollm2 import find_converted, missing_reason, smollm2_dir

    model = smollm2_dir() if missing_reason() is None else find_converted()
    if model is None:
        pytest.skip(f"SmolLM2 is not converted here: {missing_reason()}")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "shared_weights.py"), "--smallest", "--model", str(model)],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {(r["case"], r["variant"]): r for r in map(json.loads, done.stdout.splitlines())}
    shared, copies = rows["full/memory", "shared"], rows["full/memory", "two_copies"]
    assert "error" not in shared and "error" not in copies
    assert shared["unshared_params"] == 0 and shared["shared_params"] == 272  # 30 layers x 9 + 2
    assert copies["peak_bytes"] - shared["peak_bytes"] >= 0.5 * 2**30, (copies, shared)
    assert shared["mem_ratio"] < 1
    assert all(rows["full/sync", variant]["time_s"] >= 0 for variant in ("shared", "two_copies"))
    assert rows["full/generate", "shared"]["tokens_per_s"] > 0
    gemm = {case for case, variant in rows if case.startswith("gemm/")}  # CPU: per-layer cost
    assert len(gemm) == 3 * 5, gemm  # M 1, 8, 32 x q/k/v, o, gate/up, down, lm_head
    assert all(rows[case, "f_linear"]["time_ratio"] > 0 for case in gemm)
    assert DEMO_MODEL.is_dir()  # the other tests' model, bundled
