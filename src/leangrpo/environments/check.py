"""The environment section's checks before the model loads: `check_environment`, called by
preflight.py; each failure is one sentence, and the whole takes well under 2 s.

1. Names and files (registry.py `spec_of`), the chat template's bundled name or file and
   its Jinja syntax (data/templates.py `load_template`; unset: data.chat_template's): nothing is imported for these.
2. One worker in "check" mode (pool.py, worker.py): it imports the environment, its tools
   and parser and builds one environment; the environment must be an `Environment`
   subclass, its tools functions with distinct names whose schemas can be made
   (schema.py: no transformers import); it reports the schemas, its reply roles and the
   reward terms it can give.
3. A run whose rewards can only ever be 0 is refused: no reward function with a non-zero
   weight, and an environment that gives no reward terms (the built-in `tools` one).
4. With the tokenizer's record (model/tokenizer.py `recall`: exactly what the set-up's
   real tokenizer became, left by an earlier run of this model), the template check
   (rendering.py `check_template`) and every prompt's length as its first turn renders,
   tools listed, with environment.chat_template (data/prompts.py with `first_turn`),
   against the prompt limit: of the `LONGEST_PROMPTS` prompts of each split with the most
   characters (a prompt is rendered in the same frame of template text, so these are the
   longest in tokens but for tokenisation effects; rendering 2,000 prompts with Jinja takes
   half a second on a busy machine), for local JSON / JSONL data only, the formats read
   without `datasets`. Whatever these miss, and everything without a record, is checked
   at the set-up (setup.py, trainer.py): every prompt, right after the real tokenizer
   loads, with the same functions and messages.

Nothing here imports torch or transformers; the worker imports only the user's code.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from leangrpo.data.templates import conversation_template
from leangrpo.environments.pool import EnvironmentPool
from leangrpo.environments.registry import spec_of
from leangrpo.environments.rendering import Renderer
from leangrpo.environments.setup import check_renderer, eos_ids
from leangrpo.errors import UserError
from leangrpo.model.tokenizer import recall

log = logging.getLogger("leangrpo")
LONGEST_PROMPTS = 64  # of each split, rendered before the model loads (the set-up renders all)


class NoRewardError(UserError):
    """Every reward of the run would be 0."""


def check_environment(cfg: Any, model_dir: Path | None, limit: Any) -> None:
    """Every check of the environment section that can run before the model loads."""
    env_cfg = cfg.environment
    spec_of(env_cfg)
    template = conversation_template(cfg)
    with EnvironmentPool(env_cfg, mode="check") as pool:
        tools, replies, reward_terms = pool.tools, pool.replies, pool.reward_terms
    check_rewards_possible(cfg, reward_terms)
    tokenizer = recall(model_dir)
    if tokenizer is None:
        log.info("the chat template and the prompts' first turns are checked once the tokenizer loads")
        return
    renderer = Renderer(tokenizer, tools, template)
    check_renderer(renderer, replies, eos_ids(model_dir, tokenizer))
    if _read_without_datasets(cfg.data):
        from leangrpo.data.prompts import load_prompts

        load_prompts(cfg.data, tokenizer, cfg.run.seed, limit, renderer.first_turn, LONGEST_PROMPTS)


def check_rewards_possible(cfg: Any, reward_terms: tuple[str, ...] | None) -> None:
    """Refuse a run whose rewards can only ever be 0 (see the module docstring)."""
    weighted = [spec for spec in cfg.rewards.functions if spec.weight != 0]
    if weighted or reward_terms is None or reward_terms:
        return
    functions = "rewards.functions is empty" if not cfg.rewards.functions else "every rewards.functions[*].weight is 0"
    raise NoRewardError(
        f"{functions} and environment.name = {cfg.environment.name!r} gives no reward terms, so every reward would be 0 and nothing could be learned; add a reward function (e.g. rewards.functions: [{{name: math, kwargs: {{answer_column: answer}}}}]) or use an environment whose steps return rewards (listed in its reward_terms)"
    )


def _read_without_datasets(data_cfg: Any) -> bool:
    paths = [p for p in (data_cfg.path, data_cfg.eval_path) if p is not None]
    return data_cfg.dataset is None and all(Path(p).suffix.lower() in (".json", ".jsonl") for p in paths)
