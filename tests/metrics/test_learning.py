"""Warnings for runs that cannot learn (metrics/learning.py): flat groups, a zero loss, a
tokenizer that drops the prompts' characters; one line each, said once."""

from __future__ import annotations

import logging

from support.configs import DEMO_MODEL

from leangrpo.contracts import Prompt
from leangrpo.metrics.learning import (
    FLAT_STEPS,
    ZERO_LOSS_STEPS,
    LearningSignal,
    tokenizer_keeps,
    warn_if_tokenizer_drops_text,
)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_flat_groups_for_several_steps_warn_once_with_the_cause(caplog, tmp_path):
    signal = LearningSignal(tmp_path)
    with caplog.at_level(logging.WARNING, logger="leangrpo"):
        for step in range(1, FLAT_STEPS):
            signal.observe(step, {"frac_reward_zero_std": 1.0, "loss": 1e-8})
        signal.observe(FLAT_STEPS, {"frac_reward_zero_std": 0.5, "loss": 1e-8})  # one varied
        assert warnings_of(caplog) == []
        for step in range(FLAT_STEPS + 1, 3 * FLAT_STEPS + 2):
            signal.observe(step, {"frac_reward_zero_std": 1.0, "loss": 1e-8})
    (line,) = warnings_of(caplog)
    assert "frac_reward_zero_std 1.0" in line and "too hard or too easy" in line
    assert str(tmp_path / "samples.jsonl") in line


def test_flat_groups_do_not_warn_when_a_teacher_gives_the_signal(caplog, tmp_path):
    """Pure distillation: every group is flat (no reward function), the teacher's per-token
    advantage is the signal."""
    signal = LearningSignal(tmp_path, flat_groups_matter=False)
    with caplog.at_level(logging.WARNING, logger="leangrpo"):
        for step in range(1, 3 * FLAT_STEPS):
            signal.observe(step, {"frac_reward_zero_std": 1.0, "loss": 0.3})
    assert warnings_of(caplog) == []


def test_a_loss_exactly_zero_warns_a_tiny_one_does_not(caplog, tmp_path):
    signal = LearningSignal(tmp_path)
    with caplog.at_level(logging.WARNING, logger="leangrpo"):
        for step in range(1, 20):
            signal.observe(step, {"loss": -4.8e-08})  # normalised advantages: about 0
        assert warnings_of(caplog) == []
        for step in range(20, 20 + 2 * ZERO_LOSS_STEPS):
            signal.observe(step, {"loss": 0.0})
    (line,) = warnings_of(caplog)
    assert "exactly 0.0" in line and "no gradient" in line


def test_a_tokenizer_that_drops_most_characters_warns(caplog):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)  # one token per known character

    def prompts(texts):
        return [Prompt(i, t, tokenizer(t)["input_ids"]) for i, t in enumerate(texts)]

    ascii_prompts = prompts(["12+34=", "70-8="])  # its alphabet: digits and signs
    assert tokenizer_keeps(ascii_prompts, tokenizer) == 1.0
    greek = prompts(["πόσο κάνει δώδεκα και τρία;", "αθροισμα: 12+34="])
    assert tokenizer_keeps(greek, tokenizer) < 0.5
    with caplog.at_level(logging.WARNING, logger="leangrpo"):
        warn_if_tokenizer_drops_text(ascii_prompts, tokenizer, "m")
        assert warnings_of(caplog) == []
        warn_if_tokenizer_drops_text(greek, tokenizer, "m")
    (line,) = warnings_of(caplog)
    assert "keeps only" in line and "cannot read the task" in line
