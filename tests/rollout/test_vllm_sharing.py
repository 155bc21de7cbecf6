"""One copy of the weights: colocated vLLM sharing its tensors with the policy
(rollout/vllm/sharing.py).

Unmarked tests need no vLLM: the config's rules and the planner, the view mapping on a
module laid out as vLLM lays out its parameters, the policy built on views and the checks
against the checkpoint. Tests marked `vllm` run real vLLM (CPU build, `.venv-vllm`), its
engine core in this process:

    .venv-vllm/bin/pytest -m vllm tests/rollout/test_vllm_sharing.py

vLLM engines started: one shared demo engine (module fixture), one per trainer run (demo
model, in this process: 9 runs) and the two SmolLM2 processes of
benchmarks/shared_weights.py --quick (the memory test).
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
from leangrpo.rollout.vllm.sharing import (
    adapter_config_dict,
    checkpoint_mismatch,
    model_on_views,
    same_memory,
    start_shared_vllm,
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
        raw = colocated(model={"name_or_path": "m", "dtype": model_dtype})
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
    assert "generation_copy is 0: colocated vLLM serves from the policy's weights" in shown
    assert f"  {SAVED_BY_SHARING}" not in shown  # a note, not a term
    hf = colocated(model={"name_or_path": str(tmp_path)})
    hf["rollout"]["engine"] = "hf"
    assert plan_memory(config_from_dict(hf))["generation_copy"] == 0


class Fused(nn.Module):
    """One parameter holding several transformers weights along dim 0, as vLLM's
    QKVParallelLinear / MergedColumnParallelLinear (`output_partition_sizes`)."""

    def __init__(self, parts: list[torch.Tensor], biases: list[torch.Tensor] | None = None):
        super().__init__()
        self.output_partition_sizes = [p.shape[0] for p in parts]
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
        new.self_attn.o_proj = nn.Module()
        new.self_attn.o_proj.weight = nn.Parameter(a.o_proj.weight.detach().clone())
        gate_up = [m.gate_proj.weight.detach(), m.up_proj.weight.detach()]
        new.mlp = nn.Module()
        new.mlp.gate_up_proj = Fused(gate_up[::-1] if swap_gate_up else gate_up)
        new.mlp.down_proj = nn.Module()
        new.mlp.down_proj.weight = nn.Parameter(m.down_proj.weight.detach().clone())
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
LORA = ["lora.enabled=true", "lora.r=8", "train.learning_rate=2e-3"]


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
    torch.set_num_threads(1)
    own_set_num_threads, rng = torch.set_num_threads, torch.get_rng_state()
    started = start_shared_engine(cfg, torch.device("cpu"))
    kept = {
        "set_num_threads": torch.set_num_threads is own_set_num_threads,
        "threads": torch.get_num_threads(),
        "rng": torch.equal(torch.get_rng_state(), rng),
    }
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
    assert shared_demo.process_kept == {"set_num_threads": True, "threads": 1, "rng": True}


@pytest.mark.vllm
def test_logprobs_of_the_policy_and_of_vllm_agree_on_shared_weights(shared_demo):
    engine, policy = shared_demo.engines.rollout, shared_demo.policy
    tokenizer = policy.tokenizer
    prompts = [
        Prompt(uid=i, text=t, ids=tokenizer(t)["input_ids"]) for i, t in enumerate(["12+3=", "47-9=", "5+5="])
    ]  # fmt: skip
    for params in (
        SamplingParams(temperature=0.8, max_new_tokens=6, seed=5),
        SamplingParams(temperature=1.2, top_k=6, min_p=0.05, max_new_tokens=6, seed=6),
    ):
        groups = engine.generate(prompts, params, 4, engine.version)
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

    def no_files(*args, **kwargs):
        raise AssertionError("a sync of shared weights wrote files")

    monkeypatch.setattr("leangrpo.rollout.vllm.engine.write_weight_buckets", no_files)
    version = engine.version + 1
    engine.update_weights(policy.named_trainable_tensors(), version)
    first, cached = vllm_itself()
    assert cached == 0 and first == want  # recomputed, with the new weights
    assert engine.generate(prompt, greedy, 1, version)[0][0].ids == want


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
    """benchmarks/shared_weights.py --quick: SmolLM2-135M (Llama layout, tied embeddings),
    full fine-tuning, each variant in a process of its own: the peak RSS of trainer +
    colocated vLLM is at least one fp32 copy (~0.5 GiB) lower when they share the weights,
    and every base parameter of the policy is a view of vLLM's tensor (pointer, offset)."""
    from leangrpo.model.smollm2 import find_converted, missing_reason, smollm2_dir

    model = smollm2_dir() if missing_reason() is None else find_converted()
    if model is None:
        pytest.skip(f"SmolLM2 is not converted here: {missing_reason()}")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "shared_weights.py"), "--quick", "--model", str(model)],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {(r["case"], r["variant"]): r for r in map(json.loads, done.stdout.splitlines())}
    shared, copies = rows["full/memory", "shared"], rows["full/memory", "two_copies"]
    assert "error" not in shared and "error" not in copies
    assert shared["unshared_params"] == 0 and shared["shared_params"] == 272  # 30 layers x 9 + 2
    assert copies["peak_bytes"] - shared["peak_bytes"] >= 0.5 * 2**30, (copies, shared)
    assert shared["mem_ratio"] < 1 and rows["full/sync", "shared"]["time_ratio"] < 0.1
    assert rows["full/generate", "shared"]["tokens_per_s"] > 0
    gemm = {case for case, variant in rows if case.startswith("gemm/")}  # CPU: per-layer cost
    assert len(gemm) == 3 * 5, gemm  # M 1, 8, 32 x q/k/v, o, gate/up, down, lm_head
    assert all(rows[case, "f_linear"]["time_ratio"] > 0 for case in gemm)
    assert DEMO_MODEL.is_dir()  # the other tests' model, bundled
