"""`leangrpo plan`: the estimate moves the way each memory switch says it should."""

from __future__ import annotations

from leangrpo.config import config_from_dict
from leangrpo.planner import Dims, plan_memory

LLAMA_8B = Dims(
    vocab=128256,
    hidden=4096,
    intermediate=14336,
    layers=32,
    heads=32,
    kv_heads=8,
    head_dim=128,
    tied=False,
)


def plan(**sections):
    cfg = {
        "model": {"name_or_path": "unused", "dtype": "bfloat16"},
        "data": {"path": "unused.jsonl"},
        "rewards": {"functions": ["math"]},
        "rollout": {"max_new_tokens": 2048, "num_generations": 8},
        "train": {"micro_batch_tokens": 20480},
        "run": {"device": "cuda"},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return plan_memory(config_from_dict(cfg), dims=LLAMA_8B)


def test_parameter_count_matches_llama_8b():
    assert abs(LLAMA_8B.params - 8.03e9) / 8.03e9 < 0.01


def test_each_switch_lowers_its_own_term():
    full = plan(logprobs={"chunked": False})
    chunked = plan()
    assert chunked["lm_head"] < full["lm_head"] / 50
    lora = plan(lora={"enabled": True, "r": 16})
    assert lora["adamw_state"] < full["adamw_state"] / 100
    ckpt = plan(
        model={"name_or_path": "unused", "dtype": "bfloat16", "gradient_checkpointing": True}
    )
    offloaded = plan(
        model={"name_or_path": "unused", "dtype": "bfloat16", "gradient_checkpointing": True},
        offload={"activations": "hidden_states"},
    )
    assert offloaded["activations"] < ckpt["activations"] < full["activations"]
    assert plan(loss={"beta": 0.1})["reference_copy"] == full["weights"]
    assert plan(loss={"beta": 0.1}, lora={"enabled": True})["reference_copy"] == 0
