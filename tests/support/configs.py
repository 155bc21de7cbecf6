"""Configs the tests run, real and validated (no stand-ins), and the paths they point at.

Whole configs, as plain dicts for `config_from_dict` (a section given updates the
defaults): `minimal_run`, the fewest keys a valid config needs (for code that reads a few
sections and never the files); `tiny_run`, the demo model's few-step run in one process;
`demo_config`, the torchrun tests' run (2 ranks vs 1 process). Typed sections, for the
code that takes one: `rewards_section`. `unvalidated` builds a section holding values its
own validators refuse, for the checks a consumer repeats on configs that never went
through validation. Paths: the repository (`ROOT`, `SRC`) and the bundled demo (`DEMO`,
its `DEMO_MODEL` and `DEMO_YAML`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from leangrpo.config.base import Section
from leangrpo.config.run import RewardsConfig

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
DEMO = ROOT / "examples" / "demo"
DEMO_MODEL = DEMO / "model"
DEMO_YAML = ROOT / "examples" / "demo.yaml"


def updated(cfg: dict, sections: dict[str, dict]) -> dict:
    """`cfg` with each section given updated by its values (one level deep)."""
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def minimal_run(**sections) -> dict:
    """A model name, a prompt file name and the math reward: nothing is read from them."""
    cfg = {
        "model": {"name_or_path": "m"},
        "data": {"path": "unused.jsonl"},
        "rewards": {"functions": ["math"]},
    }
    return updated(cfg, sections)


def tiny_run(tmp_path: Path, **sections) -> dict:
    """A 4-step run of the demo model (mu 2, two rewards), as a config dict: each section
    given updates the defaults."""
    cfg = {
        "run": {"output_dir": str(tmp_path / "run"), "seed": 3, "max_steps": 4, "device": "cpu"},
        "model": {"name_or_path": str(DEMO_MODEL), "dtype": "float32"},
        "data": {"path": str(DEMO / "train.jsonl"), "eval_path": str(DEMO / "eval.jsonl")},
        # a format reward (starts with a digit) keeps rewards varied, so steps move weights
        "rewards": {
            "functions": [
                {"name": "math"},
                {"name": "format", "weight": 0.5, "kwargs": {"pattern": "^\\d"}},
            ],
            "num_workers": 1,
            "timeout_s": 20,
        },
        "rollout": {"num_generations": 4, "prompts_per_batch": 3, "max_new_tokens": 6},
        "loss": {"mu": 2},
        "train": {
            "learning_rate": 1e-3,
            "micro_batch_tokens": 40,
            "warmup_steps": 1,
            "lr_scheduler": "linear",
        },
        "eval": {"every_steps": 0, "num_prompts": 4},
        "checkpoint": {"every_steps": 0, "keep_last": 3},
        "logging": {"progress_bar": False, "samples_every": 0},
    }
    return updated(cfg, sections)


STEPS = 10
BUDGET = 32  # tokens per micro-batch per rank; the single process gets 2 x BUDGET


def demo_config(out: Path, mode: str, world_size: int, **sections) -> dict:
    """The demo, small: 4 prompts x 4 completions per batch, 6 new tokens, 10 steps."""
    cfg = {
        "run": {"output_dir": str(out), "seed": 5, "max_steps": STEPS, "device": "cpu",
                "num_threads": 1},
        "model": {"name_or_path": str(DEMO_MODEL), "dtype": "float32"},
        "data": {"path": str(DEMO / "train.jsonl"), "eval_path": str(DEMO / "eval.jsonl")},
        "rewards": {"functions": [{"name": "math"}], "num_workers": 1, "timeout_s": 30},
        # temperature 1.5: varied groups, so every step moves the weights
        "rollout": {"num_generations": 4, "prompts_per_batch": 4, "max_new_tokens": 6,
                    "temperature": 1.5, "hf_prompts_per_forward": 1},
        # adam_eps 1e-6: Adam divides tiny gradients by their own size; a larger eps keeps
        # reduction-order noise in near-zero gradient elements from becoming whole updates
        "train": {"learning_rate": 1e-3, "micro_batch_tokens": BUDGET * (3 - world_size),
                  "adam_eps": 1e-6},
        "eval": {"every_steps": 0, "num_prompts": 4},
        "checkpoint": {"every_steps": 3, "keep_last": 5},
        "logging": {"progress_bar": False, "samples_every": 0},
        "distributed": {"timeout_s": 60},
    }  # fmt: skip
    if mode == "full_sync":  # + a KL term (a sharded reference) and checkpointed layers;
        # 3 groups: one rank trains 2 micro-batches, the other 1 and a padding one
        cfg["rollout"]["prompts_per_batch"] = 3
        cfg["loss"] = {"mu": 2, "beta": 0.05}
        cfg["pipeline"] = {"mode": "sync"}
        cfg["model"]["gradient_checkpointing"] = True
        cfg["train"]["learning_rate"] = 3e-4  # 1e-3 moves all weights too far for the KL
    else:  # lora_async
        cfg["lora"] = {"enabled": True, "r": 4, "alpha": 8}
        cfg["loss"] = {"mu": 1}
        cfg["pipeline"] = {"mode": "async", "max_staleness": 0, "stall_timeout_s": 60}
    return updated(cfg, sections)


def rewards_section(
    *functions: Any, timeout_s: float = 5.0, num_workers: int = 1, **fields: Any
) -> RewardsConfig:
    """A rewards section with one worker and a 5 s limit unless given; each function is a
    name, a (name, weight, kwargs) triple or a `RewardSpec`."""
    specs = [
        {"name": f[0], "weight": f[1], "kwargs": f[2]} if isinstance(f, tuple) else f
        for f in functions
    ]
    return RewardsConfig(functions=specs, timeout_s=timeout_s, num_workers=num_workers, **fields)


S = TypeVar("S", bound=Section)


def unvalidated(section: type[S], **fields: Any) -> S:
    """`section` with these fields and the other defaults, none of them checked (pydantic's
    `model_construct`): what a caller that skipped validation could hand over."""
    return section.model_construct(**fields)
