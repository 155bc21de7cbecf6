"""What the mixture-of-experts tests share: tiny Qwen3-MoE / OLMoE policies on the demo's
32-token vocabulary (routing replay on), samples the hf engine generated for them (route
records included), and the experts each MoE block really handed its tokens to."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from transformers import AutoTokenizer

from leangrpo.config import Config
from leangrpo.contracts import Prompt, RolloutSample, SamplingParams
from leangrpo.model.policy import Policy, build_policy
from leangrpo.rollout.hf.engine import HFEngine
from support.configs import DEMO_MODEL
from support.models import make_tiny_model
from support.steps import step_config

VOCAB = 32  # the demo tokenizer's
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)


def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


def moe_config(**sections) -> Config:
    """The step tests' Config with routing replay on (sections update it)."""
    merged = {"rollout": {"routing_replay": True, "max_new_tokens": 8}}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    return step_config(**merged)


def moe_model(arch: str = "qwen3_moe", seed: int = 2, router_scale: float = 1.0, **fields):
    """A tiny MoE (4 experts, top-2) whose experts matter (initializer 0.3); a router
    scaled down makes near-ties, where bf16 rounding flips routes."""
    fields = {"vocab_size": VOCAB, "initializer_range": 0.3, **fields}
    model = make_tiny_model(arch, seed=seed, **fields)
    with torch.no_grad():
        for router in routers(model):
            router.weight.mul_(router_scale)
    return model


def moe_policy(arch: str = "qwen3_moe", cfg: Config | None = None, **model_fields) -> Policy:
    return build_policy(
        moe_model(arch, **model_fields), cfg or moe_config(), tokenizer(), torch.device("cpu")
    )


def routers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def prompts(count: int = 6, seed: int = 0, length: int = 5) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    return [
        Prompt(i, "", torch.randint(3, VOCAB, (length + i % 3,), generator=g).tolist())
        for i in range(count)
    ]


def generate(
    policy: Policy, n: int = 3, count: int = 6, engine_dtype=None, perturb: float = 0.0
) -> list[RolloutSample]:
    """Samples of the hf engine's own copy of the policy (in `engine_dtype`; its routers
    perturbed by `perturb` x noise), each with its route record."""
    engine = HFEngine(policy.model, policy.tokenizer, share_weights=False)
    with torch.no_grad():
        if engine_dtype is not None:
            engine.model.to(engine_dtype)
        noise = torch.Generator().manual_seed(5)
        for router in routers(engine.model):
            router.weight.add_(torch.randn(router.weight.shape, generator=noise) * perturb)
    asked = prompts(count)
    groups = engine.generate(asked, SAMPLING, n, 0)
    return [
        RolloutSample(g, p, c, advantage=float(i % 3) - 1.0)
        for g, (p, cs) in enumerate(zip(asked, groups))
        for i, c in enumerate(cs)
    ]


def with_routes(samples: list[RolloutSample], routes: list[torch.Tensor]) -> list[RolloutSample]:
    """Copies of `samples` carrying the given route records."""
    out = []
    for s, r in zip(samples, routes):
        s = copy.copy(s)
        s.completion = copy.copy(s.completion)
        s.completion.routes = r
        out.append(s)
    return out


def random_routes(samples: list[RolloutSample], layers: int = 2, experts: int = 4, k: int = 2):
    """Valid records that differ from what the model would choose; a group's first tokens
    (predicted by its prompt's last position, one prefill) share one, as an engine's do."""
    g = torch.Generator().manual_seed(9)
    out, first = [], {}
    for s in samples:
        t = s.completion.num_model_tokens
        picks = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t * layers)])
        record = picks.view(t, layers, k).to(torch.uint8)
        record[0] = first.setdefault(s.group_id, record[0].clone())
        out.append(record)
    return out


@contextlib.contextmanager
def experts_received(model) -> Iterator[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Per MoE layer, (indices, gate weights) each call of its experts module received
    (the experts implementation's own inputs, whatever routed them)."""
    blocks = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in blocks]
    handles = []
    for layer, block in enumerate(blocks):

        def hook(module, args, layer=layer):
            calls[layer].append((args[1].detach().clone(), args[2].detach().clone()))

        handles.append(block.register_forward_pre_hook(hook))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def used_routes(calls, call: int = 0) -> torch.Tensor:
    """(rows, layers, k) experts of each layer's `call`-th call, sorted within a row."""
    return torch.stack([layer[call][0] for layer in calls], dim=1).sort(dim=-1).values


def as_sets(routes: torch.Tensor) -> torch.Tensor:
    return routes.long().sort(dim=-1).values


def save_moe_model(directory, arch: str = "qwen3_moe", seed: int = 0):
    """A tiny MoE on the demo's tokenizer, saved as a model directory a run can load
    (safetensors, the demo's tokenizer and generation config)."""
    import shutil
    from pathlib import Path

    directory = Path(directory)
    ids = {"eos_token_id": 1, "pad_token_id": 0, "bos_token_id": None}
    model = make_tiny_model(
        arch, vocab_size=VOCAB, seed=seed, initializer_range=0.1, max_position_embeddings=128, **ids
    )
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO_MODEL / name, directory / name)
    return directory
