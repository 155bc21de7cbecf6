"""The reasoning-gym adapter (environments/adapters/reasoning_gym.py) on every dataset it can
build: the rows it writes, read back as a data file would be, score each item's gold answer
1.0 through the adapter's reward, as the dataset's own scorer does on the entry it made (a
JSON round trip of the entry turned tuples into lists: arc_agi and rearc scored their gold
answers 0.05). Tasks without a gold answer (answer None: checked by simulation) are scored
as the dataset scores the same completion. Two items each, small configs for the slow
generators, so the whole sweep takes seconds."""

from __future__ import annotations

import json
import warnings

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (extra 'reasoning-gym')")
from reasoning_gym.factory import DATASETS  # noqa: E402

from leangrpo.environments.adapters.reasoning_gym import (  # noqa: E402
    create,
    entry_from_text,
    entry_text,
    rows,
    score,
)

ITEMS = 2
CONFIGS = {  # the slowest generators, made small; composite needs its parts
    "knight_swap": {"min_nodes": 6, "max_nodes": 6, "max_steps": 8},
    "quantum_lock": {"difficulty": 3},
    "composite": {"datasets": [{"name": "basic_arithmetic", "weight": 1.0, "config": {}}]},
}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_the_sweep_covers_every_dataset_reasoning_gym_registers():
    assert len(DATASETS) >= 100 and {"arc_agi", "rearc", "basic_arithmetic"} <= set(DATASETS)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_every_dataset_scores_its_gold_answer_as_reasoning_gym_does(name):
    config = CONFIGS.get(name, {})
    made = rows(name, ITEMS, 0, config)  # checks that each entry decodes equal to the original
    made = [json.loads(json.dumps(row)) for row in made]  # as a JSONL data file holds them
    scorer = create(name, 1, 0, config)
    assert len(made) == ITEMS
    for index, row in enumerate(made):
        entry = entry_from_text(row["rg_entry"])
        assert row["prompt"] == entry["question"] and row["rg_dataset"] == name
        gold = row["answer"]
        completion = gold if gold is not None else "no answer"
        (value,) = score(["q"], [completion], [row["rg_entry"]], [name], [row["rg_config"]])
        assert value == scorer.score_answer(completion, entry)
        if gold is not None:
            assert value == 1.0, f"{name} item {index}: the gold answer scores {value}"
        else:
            assert entry["answer"] is None


def test_entries_keep_tuples_and_keys_that_are_not_strings():
    entry = {"grid": ((1, 2), (3, 4)), "by_node": {0: "red", (1, 2): ["a", ("b",)]}, "x": None,
             "tricky": {"__tuple__": [1]}}  # fmt: skip
    text = entry_text(entry, "a test item")
    assert entry_from_text(text) == entry and json.loads(json.dumps(text)) == text
    assert isinstance(entry_from_text(text)["grid"][0], tuple)
    with pytest.raises(ValueError, match="a test item cannot be written as data: it holds a set value"):
        entry_text({"s": {1, 2}}, "a test item")
    with pytest.raises(ValueError, match="rg_entry is not the entry text this adapter writes"):
        score(["q"], ["1"], [{"question": "1+0=", "answer": "1"}], ["basic_arithmetic"], ["{}"])
