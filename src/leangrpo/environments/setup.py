"""What a run with an environment builds at its set-up, before the model loads.

The checks that need no tokenizer (and, with the tokenizer's record, those that do) ran
already in preflight (check.py). Here, with the real tokenizer: `start_environments(cfg,
tokenizer)` starts the environment workers (importing the environment, its tools and
parser: a failure is one line) and checks the chat template against the environment's
replies and tools (rendering.py `check_template`); the trainer then loads the prompts as
their first turn renders them (`Environments.renderer.first_turn`, data/prompts.py
`load_prompts`), and `Environments.probe` resets and finishes one trajectory on the first
train prompt, so an environment whose reset fails stops the run here with one line rather
than unscoring every sample later. `Environments.rollout(engine)` is then the multi-turn
rollout over an engine. `Environments` is a `contracts.MultiTurn`, as agents' `Agents`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leangrpo.contracts import Prompt, TurnEngine
from leangrpo.data.templates import TemplateError, conversation_template
from leangrpo.environments.driver import MultiTurnRollout, TurnLimits
from leangrpo.environments.pool import EnvironmentPool
from leangrpo.environments.registry import EnvironmentSpecError
from leangrpo.environments.rendering import Renderer, check_template

log = logging.getLogger("leangrpo.environments")


@dataclass
class Environments:
    pool: EnvironmentPool
    renderer: Renderer
    limits: TurnLimits
    eos_ids: set[int]
    name: str = "tools"  # environment.name, for messages
    scheduling: str = "per_trajectory"

    def first_turn(self, messages: list[dict]) -> str:
        return self.renderer.first_turn(messages)

    def rollout(self, engine: Any) -> MultiTurnRollout:
        if not isinstance(engine, TurnEngine):
            raise TypeError(
                f"{type(engine).__name__} cannot generate turns (generate_turns): multi-turn rollouts need the hf or vllm engine"
            )
        return MultiTurnRollout(
            engine, self.pool, self.renderer, self.limits, self.eos_ids, self.scheduling
        )

    def probe(self, prompt: Prompt) -> None:
        """One trajectory reset and finished on `prompt` (the first train prompt)."""
        (session,) = self.pool.new_sessions(1)
        (outcome,) = self.pool.reset([(session, prompt.messages or [], dict(prompt.columns), 0)])
        if outcome.error is not None:
            raise EnvironmentSpecError(
                f"environment.name = {self.name!r}: reset failed on train prompt row {prompt.uid}: {outcome.error}"
            )
        self.pool.finish([(session, "stop")])

    def close(self) -> None:
        self.pool.close()


def start_environments(
    cfg: Any, tokenizer: Any, pool: EnvironmentPool | None = None
) -> Environments | None:
    """None without an environment section; see the module docstring. `pool`: one
    already started (prestart.py), else it is started here."""
    env_cfg = cfg.environment
    if env_cfg is None:
        return None
    pool = pool if pool is not None else EnvironmentPool(env_cfg)
    try:
        renderer = Renderer(tokenizer, pool.tools, conversation_template(cfg))
        eos_ids = generation_eos_ids(cfg, tokenizer)
        check_renderer(renderer, pool.replies, eos_ids)
    except BaseException:
        pool.close()
        raise
    limits = TurnLimits(env_cfg.max_turns, env_cfg.max_total_tokens)
    log.info(
        "environment %s: %d workers, tools %s",
        env_cfg.name,
        pool.num_workers,
        ", ".join(t.get("function", t).get("name", "?") for t in pool.tools) or "none",
    )
    return Environments(pool, renderer, limits, eos_ids, env_cfg.name, env_cfg.scheduling)


def generation_eos_ids(cfg: Any, tokenizer: Any) -> set[int]:
    """The ids a turn stops on: the model's generation config's EOS (what the engines stop
    on), else the tokenizer's. A local model's generation_config.json is read as JSON
    (what GenerationConfig reads from it; no transformers import, so `leangrpo check`
    stays quick); a hub model's through transformers."""
    directory = Path(cfg.model.name_or_path).expanduser()
    if directory.is_dir():
        return eos_ids(directory, tokenizer)
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(
            cfg.model.name_or_path, revision=cfg.model.revision
        ).eos_token_id
    except (OSError, ValueError):
        eos = None
    return _ids(eos if eos is not None else tokenizer.eos_token_id)


def eos_ids(model_dir: Path | None, tokenizer: Any) -> set[int]:
    """generation_config.json's EOS in `model_dir`, else the tokenizer's (no transformers)."""
    eos = None
    if model_dir is not None:
        try:
            eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            eos = None
    return _ids(eos if eos is not None else tokenizer.eos_token_id)


def _ids(eos: Any) -> set[int]:
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}


def check_renderer(renderer: Renderer, replies: list[str], eos_ids: set[int]) -> None:
    """The start-up template check; it passes when the template renders incrementally with
    one of the EOS ids (Llama 3 stops on two; its template closes turns with one)."""
    first: TemplateError | None = None
    for eos in sorted(eos_ids) or [None]:
        try:
            check_template(renderer, replies, eos)
            return
        except TemplateError as e:
            first = first or e
    raise first
