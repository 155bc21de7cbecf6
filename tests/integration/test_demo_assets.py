"""The bundled demo: model and tokenizer load, data is right and held out, the model is unsure."""

from __future__ import annotations

import pytest
import torch
from support.configs import DEMO, DEMO_MODEL
from support.files import assert_files_are_the_held_out_split, read_jsonl
from support.scripts import load_script


@pytest.fixture(scope="module")
def build_demo():
    return load_script("build_demo")


@pytest.fixture(scope="module")
def demo_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    return model.eval(), tokenizer


def test_tokenizer_is_character_level_and_round_trips(demo_model):
    model, tokenizer = demo_model
    text = "37+45=82\n"
    ids = tokenizer(text).input_ids
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert len(tokenizer) == model.config.vocab_size
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True) == text


def test_weights_are_small():
    assert (DEMO_MODEL / "model.safetensors").stat().st_size < 8 * 2**20


def test_data_columns_answers_and_held_out_split(build_demo):
    train, evals = read_jsonl(DEMO / "train.jsonl"), read_jsonl(DEMO / "eval.jsonl")
    assert len(train) == build_demo.NUM_TRAIN and len(evals) == build_demo.NUM_EVAL
    for row in train + evals:
        assert set(row) == {"prompt", "answer"} and row["prompt"].endswith("=")
        assert int(row["answer"]) == eval(row["prompt"][:-1])  # noqa: S307 (our own digits)
    split = build_demo.split_problems(build_demo.all_problems())
    assert_files_are_the_held_out_split(split, train, evals)


def test_noisy_answers_are_plausible(build_demo):
    import random

    rng = random.Random(0)
    problems = build_demo.all_problems()
    draws = [(p, build_demo.noisy_answer(p, rng)) for p in rng.choices(problems, k=4000)]
    correct = sum(a == p.answer for p, a in draws) / len(draws)
    assert 0.45 < correct < 0.65
    assert all(
        a >= 0
        and (
            a == p.answer
            or a == p.dropped_carry
            or abs(a - p.answer) <= 10
            or len(str(a)) == len(str(p.answer))
        )
        for p, a in draws
    )
    assert build_demo.Problem(37, 45, "+").dropped_carry == 72
    assert build_demo.Problem(52, 27, "-").dropped_carry == 35


def test_pretrained_model_is_unsure_on_held_out_problems(demo_model, build_demo):
    """Greedy accuracy well above chance but far from solved: GRPO has something to fix."""
    model, tokenizer = demo_model
    eval_set, _, _ = build_demo.split_problems(build_demo.all_problems())
    greedy = build_demo.answer_accuracy(model, tokenizer, eval_set, temperature=0.0, seed=0)
    assert 0.2 <= greedy <= 0.8
