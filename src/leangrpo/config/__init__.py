"""Typed, validated settings, without torch.

Modules: root.py (`Config`, the rules across sections, loading), base.py (`Section`),
run.py (run, model, lora, data, rewards, eval, checkpoint, logging), training.py
(rollout, loss, train, packing, logprobs, offload, pipeline, distributed), environment.py
(environment: multi-turn rollouts), agent.py (agent: agents trained through the
OpenAI-compatible endpoint), sandbox.py (the workers' sandbox sub-section of
environment and rewards), io.py (YAML,
`--set` overrides, one-sentence errors).

`Config`, `ConfigError`, `load_config` and `config_from_dict` are imported from here
(on first use, like every facade of this project); section classes from their modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leangrpo.config.io import ConfigError
    from leangrpo.config.root import Config, config_from_dict, load_config

_HOMES = {"Config": "root", "config_from_dict": "root", "load_config": "root", "ConfigError": "io"}
__all__ = ["Config", "ConfigError", "config_from_dict", "load_config"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'leangrpo.config' has no attribute '{name}'")
    return getattr(importlib.import_module(f"leangrpo.config.{_HOMES[name]}"), name)
