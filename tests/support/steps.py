"""What the tests of one optimizer step share (tests/train/test_{planning,inputs,inflight,
step}.py): a real Config of the sections a step reads, made-up samples, a tiny policy."""

from __future__ import annotations

from pathlib import Path

import torch

from leangrpo.config import Config, config_from_dict
from leangrpo.contracts import Completion, Prompt, RolloutSample
from leangrpo.model.policy import Policy
from leangrpo.ops.attention.adapter import enable_packed_attention
from support.configs import tiny_run
from support.models import make_tiny_model

# the step's sections: 8-token completions, groups of 2, 12-token micro-batches, plain packing
STEP_SECTIONS = {
    "rollout": {"max_new_tokens": 8, "num_generations": 2},
    "loss": {"mu": 1},
    "train": {"micro_batch_tokens": 12},
    "packing": {"balance": "tokens", "shared_prefix": "off"},
}


def step_config(**sections) -> Config:
    """The demo run's Config with STEP_SECTIONS, each section given updating them."""
    merged = {name: dict(values) for name, values in STEP_SECTIONS.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return config_from_dict(tiny_run(Path("unused"), **merged))


def step_samples(advantages: list[float]) -> list[RolloutSample]:
    """Groups of 2 with 4-token prompts and 3-5-token completions, one per advantage."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i, adv in enumerate(advantages):
        prompt = torch.randint(2, 64, (4,), generator=g).tolist()
        comp = torch.randint(2, 64, (3 + i % 3,), generator=g).tolist()
        out.append(
            RolloutSample(
                i // 2,
                Prompt(i, "", prompt),
                Completion(comp, "", [-4.0] * len(comp), "stop", 0),
                advantage=adv,
            )
        )
    return out


def policy_and_optimizer():
    """A tiny Qwen2 with per-segment SDPA, and AdamW at lr 1e-2."""
    model = make_tiny_model("qwen2").train()
    enable_packed_attention(model, "sdpa_segments")
    policy = Policy(model, None, None, torch.device("cpu"), is_lora=False)
    return policy, torch.optim.AdamW(model.parameters(), lr=1e-2)
