"""Warnings for a run that cannot learn: one line each, with the likely cause.

A GRPO run can go through every step and learn nothing, with no error anywhere. Three
signs are cheap to see and are each said once per run (a log warning):

- every group flat (`frac_reward_zero_std` 1.0) for FLAT_STEPS optimizer steps in a row:
  no reward varies within a group, so every advantage is 0 (unless a distillation
  teacher gives each token its own);
- a loss exactly 0.0 for ZERO_LOSS_STEPS steps in a row (a tiny non-zero loss is normal:
  normalised advantages sum to 0): nothing reaches the gradient;
- a tokenizer that drops most characters of the prompts (`tokenizer_keeps`): decoding the
  prompts' ids gives back less than KEPT_FRACTION of their characters, so the model never
  sees the task (a character-level tokenizer with another alphabet, the wrong model).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

log = logging.getLogger("leangrpo")
FLAT_STEPS = 5
ZERO_LOSS_STEPS = 3
KEPT_FRACTION = 0.5  # below this share of the prompts' characters, warn
SAMPLE_PROMPTS = 64  # prompts decoded for the tokenizer check


class LearningSignal:
    """Watches each step's metrics; warns once per cause when the run cannot learn."""

    def __init__(self, run_dir: Any = ".", flat_groups_matter: bool = True):
        """`flat_groups_matter`: False when flat groups still carry a signal (a
        distillation teacher's, per token): no warning about them then."""
        self.flat_groups_matter = flat_groups_matter
        self.path = f"{run_dir}/metrics.jsonl"
        self.samples = f"{run_dir}/samples.jsonl"
        self.flat_in_a_row = 0
        self.zero_loss_in_a_row = 0
        self.said: set[str] = set()

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        flat = metrics.get("frac_reward_zero_std")
        if flat is not None:
            self.flat_in_a_row = self.flat_in_a_row + 1 if flat >= 1.0 else 0
        loss = metrics.get("loss")
        if loss is not None:
            self.zero_loss_in_a_row = self.zero_loss_in_a_row + 1 if loss == 0.0 else 0
        if self.flat_in_a_row >= FLAT_STEPS and self.flat_groups_matter:
            self._say(
                "flat",
                f"nothing to learn from at step {step}: in each of the last {FLAT_STEPS} steps every group's completions got the same reward (frac_reward_zero_std 1.0), so every advantage is 0; the task is likely too hard or too easy for the model at this temperature, or a reward scores every completion alike (reward/*/mean in {self.path} and the completions in {self.samples} show which)",
            )
        if self.zero_loss_in_a_row >= ZERO_LOSS_STEPS:
            self._say(
                "zero_loss",
                f"the loss has been exactly 0.0 for {ZERO_LOSS_STEPS} steps (step {step}): no gradient reaches the model; likely every advantage is 0 (flat groups, frac_reward_zero_std) or no completion token is trained on (loss/tokens, loss/filtered_tokens in {self.path})",
            )

    def _say(self, cause: str, message: str) -> None:
        if cause not in self.said:
            self.said.add(cause)
            log.warning(message)


def tokenizer_keeps(prompts: list, tokenizer: Any) -> float:
    """The share of the prompts' characters (a sample of them) that decoding their ids
    gives back (multiset intersection: order and merges do not matter, dropped or
    replaced characters do)."""
    kept = total = 0
    for prompt in prompts[:SAMPLE_PROMPTS]:
        text = Counter(prompt.text.replace(" ", ""))
        back = Counter(tokenizer.decode(prompt.ids, skip_special_tokens=False).replace(" ", ""))
        kept += sum((text & back).values())
        total += sum(text.values())
    return kept / total if total else 1.0


def warn_if_tokenizer_drops_text(prompts: list, tokenizer: Any, model_name: str) -> None:
    """One warning when the tokenizer loses most of the prompts' characters."""
    share = tokenizer_keeps(prompts, tokenizer)
    if share < KEPT_FRACTION:
        example = prompts[0]
        back = tokenizer.decode(example.ids, skip_special_tokens=False)
        log.warning(
            "the tokenizer of model.name_or_path = %r keeps only %.0f%% of the prompts' characters (prompt %d %r comes back as %r): the model cannot read the task; use the tokenizer the model was trained with, or data the tokenizer covers",
            model_name,
            100 * share,
            example.uid,
            example.text[:60],
            back[:60],
        )
