"""`leangrpo plan` on mixtures of experts (Qwen3-MoE, OLMoE): every expert's weight is
counted (config.json alone gives the parameters exactly), only the k active experts'
activations are (what autograd keeps saved after the packed forward equals the inventory
byte for byte: full fine-tuning, LoRA on attention and on the experts, routing replay, the
aux loss, checkpointing), and the live peak of a training micro-batch lies within the dense
models' tolerance of the plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.memory_probe import (
    LiveBytes,
    batch_storages,
    group,
    saved_alive_bytes,
    step_config,
    storages,
)
from support.models import make_tiny_model
from support.moe import random_routes, with_routes

from leangrpo.config import config_from_dict
from leangrpo.model.policy import build_policy
from leangrpo.model.scoring import row_hidden
from leangrpo.ops.context_parallel.shards import whole_row
from leangrpo.planner.inventory import final_norm_bytes, layer_saved, moe_layer_bytes, rotary_bytes
from leangrpo.planner.plan import (
    TRAINING_PASS,
    PlanError,
    dims_from_json,
    make_setup,
    plan_memory,
)
from leangrpo.train.packing import pack_samples

VOCAB, PROMPT, COMPLETION, GENERATIONS, EXPERTS = 384, 40, 24, 4, 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXPERT_FIELDS = {
    "qwen3_moe": {"moe_intermediate_size": 40, "head_dim": 24},
    "olmoe": {"intermediate_size": 40},
}


def tiny_moe(arch: str, dtype: str):
    model = make_tiny_model(
        arch, vocab_size=VOCAB, hidden_size=64, num_layers=3, dtype=DTYPES[dtype],
        num_experts=EXPERTS, num_experts_per_tok=2, **EXPERT_FIELDS[arch],
    )  # fmt: skip
    return model.train()


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])
def test_every_experts_weights_are_counted(arch):
    model = tiny_moe(arch, "float32")
    d = dims_from_json(model.config.to_dict())
    assert d.params == sum(p.numel() for p in model.parameters())
    assert d.param_tensors == len(list(model.parameters()))
    assert d.active_intermediate == 2 * 40 and d.moe_params == EXPERTS * 64 * (1 + 3 * 40)


@pytest.mark.parametrize("lora", ["attention", "all-linear"])
def test_lora_adapters_on_attention_and_experts_are_counted(lora):
    """peft's adapters (all-linear: per-weight ParamWrappers on the experts and router) are
    counted exactly: the plan's gradients are the trainable parameters' bytes."""
    cfg, d, policy, batch = moe_setup("qwen3_moe", "float32", lora, False)
    plan = plan_memory(cfg, tokens=batch.input_ids.numel(), dims=d, prompt_tokens=PROMPT)
    trainable = policy.trainable_parameters()
    assert plan["gradients"] == sum(p.numel() * p.element_size() for p in trainable)
    assert any("experts" in n for n, p in policy.model.named_parameters() if p.requires_grad) == (
        lora == "all-linear"
    )


def test_layers_with_a_dense_mlp_among_experts_are_refused():
    model = make_tiny_model("qwen3_moe", mlp_only_layers=[0])
    with pytest.raises(PlanError, match="dense MLP"):
        dims_from_json(model.config.to_dict())


def moe_setup(arch, dtype, lora, ckpt, replay=False, aux=False):
    model = tiny_moe(arch, dtype)
    dims = dims_from_json(model.config.to_dict())
    lora_cfg = {"enabled": bool(lora)}
    if lora:
        lora_cfg["target_modules"] = (
            lora if lora == "all-linear" else ["q_proj", "k_proj", "v_proj", "o_proj"]
        )
    cfg = step_config(
        model={"dtype": dtype, "gradient_checkpointing": ckpt},
        lora=lora_cfg,
        rollout={"max_new_tokens": COMPLETION, "num_generations": GENERATIONS,
                 "routing_replay": replay},
        train={"router_aux_loss_coef": 0.1 if aux else 0.0},
        data={"max_prompt_tokens": PROMPT},
    )  # fmt: skip
    policy = build_policy(model, cfg, None, torch.device("cpu"))
    samples = [
        dataclasses.replace(sample, group_id=g)
        for g in range(2)
        for sample in group(VOCAB, GENERATIONS, PROMPT, COMPLETION, seed=g)
    ]
    if replay:
        samples = with_routes(samples, random_routes(samples, layers=3, experts=EXPERTS))
    return cfg, dims, policy, pack_samples(samples)


SAVED_CASES = [
    ("qwen3_moe", "float32", False, False, False),
    ("qwen3_moe", "bfloat16", False, True, True),
    ("qwen3_moe", "float32", "attention", True, False),
    ("qwen3_moe", "float32", "all-linear", False, True),
    ("olmoe", "float32", False, True, True),
    ("olmoe", "bfloat16", "attention", False, False),
]


@pytest.mark.parametrize("arch,dtype,lora,replay,aux", SAVED_CASES)
@pytest.mark.parametrize("ckpt", [False, True])
def test_saved_tensors_equal_the_inventory(arch, dtype, lora, replay, aux, ckpt):
    cfg, d, policy, batch = moe_setup(arch, dtype, lora, ckpt, replay, aux)
    model = policy.model
    exclude = storages(model.parameters()) | storages(model.buffers()) | batch_storages(batch)
    exclude |= storages([batch.routes])
    out: dict = {}
    row = whole_row(batch)
    torch.manual_seed(0)
    with saved_alive_bytes(out, exclude), torch.enable_grad():
        policy.routing.prepare(row)
        hidden = row_hidden(model, row)  # noqa: F841  (its graph holds what is saved)
        kept = policy.routing.last  # noqa: F841  (the aux loss's graph, when on)
    s, n, L = make_setup(cfg, "cpu"), batch.input_ids.numel(), d.layers
    assert s.replay == replay and s.aux == aux and s.adapts_experts == (lora == "all-linear")
    if ckpt:  # one input per layer
        layers = L * n * s.b * d.hidden
    else:
        layers = n * (layer_saved(d, s, first=True) + (L - 1) * layer_saved(d, s))
        layers += n * rotary_bytes(d, s) + L * moe_layer_bytes(d, s)
    assert out["bytes"] == layers + n * final_norm_bytes(d, s)


def train_pass_with_aux(policy, mb, cfg):
    """The forward and loss of one micro-batch as step.train_step runs them (aux loss in)."""
    from leangrpo.model.scoring import score
    from leangrpo.train.inputs import loss_inputs, normalisers
    from leangrpo.train.loss import compute_loss

    norm = normalisers([mb], cfg.loss, cfg.rollout.max_new_tokens)
    sampling = cfg.rollout.sampling_params()
    logprobs, entropy = score(policy.model, mb, sampling, cfg.logprobs, with_entropy=True)
    inputs, _ = loss_inputs(mb, logprobs, entropy, cfg.loss)
    return policy.routing.loss_with_aux(compute_loss(inputs, norm, cfg.loss).loss, inputs, norm)


@pytest.mark.parametrize(
    "arch,dtype,lora,ckpt",
    [("qwen3_moe", "float32", False, False), ("olmoe", "bfloat16", "attention", True)],
)
def test_train_pass_peak_is_within_the_dense_tolerance(arch, dtype, lora, ckpt):
    cfg, d, policy, batch = moe_setup(arch, dtype, lora, ckpt, replay=True, aux=True)
    cfg = config_from_dict(
        {**cfg.model_dump(mode="json"), "logprobs": {"row_tile": 32, "vocab_tile": 128}}
    )
    measured = LiveBytes().peak_of(lambda: train_pass_with_aux(policy, batch, cfg).backward())
    plan = plan_memory(cfg, tokens=batch.input_ids.numel(), dims=d, prompt_tokens=PROMPT)
    planned = plan[TRAINING_PASS]
    error = (planned - measured) / measured
    assert -0.05 <= error <= 0.11, (planned, measured, error)
