"""GRPO's arguments become one validated Config: datasets as content-named files, objects as
references, section overrides; each bad argument is one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from support.configs import DEMO, DEMO_YAML, minimal_run

from leangrpo.api.grpo import GRPO
from leangrpo.api.inputs import build_config
from leangrpo.config import ConfigError, load_config
from leangrpo.data.files import DataError
from leangrpo.environments.protocol import ToolEnvironment
from leangrpo.errors import UserError

ROWS = [{"prompt": "1+2=", "answer": 3}, {"prompt": "2+2=", "answer": 4}]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANGRPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_rows_become_a_file_named_by_their_content(cache):
    first = build_config(minimal_run(), train_dataset=ROWS, eval_dataset=ROWS[:1])
    again = build_config(minimal_run(), train_dataset=[dict(r) for r in ROWS])
    other = build_config(minimal_run(), train_dataset=ROWS[::-1])
    assert first.data.path == again.data.path != other.data.path
    assert first.data.path.startswith(str(cache / "datasets"))
    lines = Path(first.data.path).read_text().splitlines()
    assert [json.loads(line) for line in lines] == ROWS
    assert [json.loads(x) for x in Path(first.data.eval_path).read_text().splitlines()] == ROWS[:1]
    from_dataset = build_config(minimal_run(), train_dataset=datasets.Dataset.from_list(ROWS))
    assert from_dataset.data.path == first.data.path  # the same rows, the same file


def test_paths_and_names_are_kept_as_they_are():
    cfg = build_config(
        minimal_run(data={"dataset": "x", "path": None}), train_dataset=str(DEMO / "train.jsonl")
    )
    assert cfg.data.path == str(DEMO / "train.jsonl") and cfg.data.dataset is None
    cfg = build_config(minimal_run(), train_dataset="openai/gsm8k")
    assert cfg.data.dataset == "openai/gsm8k" and cfg.data.path is None


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}),
            "is a DatasetDict of splits ['train']; pass one split",
        ),
        ([{"prompt": "a", "blob": object()}], "train_dataset row 0 cannot be written as JSON"),
        (42, "train_dataset is a int; give a data file's path"),
    ],
)
def test_a_dataset_that_cannot_be_used_is_one_sentence(source, expected):
    with pytest.raises(DataError) as err:
        build_config(minimal_run(), train_dataset=source)
    assert expected in str(err.value)


def test_overrides_merge_into_sections_or_find_their_one_section():
    cfg = build_config(
        DEMO_YAML,
        overrides={"run": {"max_steps": 7}, "model": "other/model", "learning_rate": 1e-5},
    )
    assert cfg.run.max_steps == 7 and cfg.run.output_dir == "runs/demo"  # merged, not replaced
    assert cfg.model.name_or_path == "other/model" and cfg.train.learning_rate == 1e-5
    assert cfg.rewards == load_config(DEMO_YAML).rewards


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            {"temperature": 0.5},
            "GRPO(temperature=...) is ambiguous: rollout.temperature and eval.temperature both have it; say which section, as rollout={'temperature': ...} or eval={'temperature': ...}.",
        ),
        (
            {"learnig_rate": 1.0},
            "GRPO got an unknown keyword argument 'learnig_rate'; did you mean 'learning_rate'?",
        ),
        ({"run": 3}, "GRPO(run=3): a section is given as a mapping of its keys"),
        (
            {"run": {"max_step": 3}},
            "Unknown config key 'run.max_step'; did you mean 'run.max_steps'?",
        ),
        (
            {"max_turns": 3},
            "GRPO(max_turns=...) is a key of the environment section; give it as environment={'max_turns': ...}.",
        ),
    ],
)
def test_a_bad_keyword_is_one_sentence(overrides, expected):
    with pytest.raises(ConfigError) as err:
        build_config(DEMO_YAML, overrides=overrides)
    assert str(err.value).startswith(expected), str(err.value)


def reward_in_a_module(prompts, completions, **columns):
    return [0.0] * len(completions)


def test_reward_functions_in_every_form():
    local = lambda p, c, **k: [1.0] * len(c)  # noqa: E731
    cfg = build_config(
        minimal_run(),
        reward_funcs=[
            "math",
            reward_in_a_module,
            local,
            {"name": local, "weight": 0.5, "kwargs": {"x": 1}},
        ],
    )
    names = [(f.name, f.weight, f.value is not None) for f in cfg.rewards.functions]
    here = reward_in_a_module.__module__
    assert names[0] == ("math", 1.0, False)
    assert names[2:] == [("lambda", 1.0, True), ("lambda", 0.5, True)]
    # this test module is imported by file (pytest's importlib mode): by name only if found
    assert names[1][0] in (f"{here}:reward_in_a_module", "reward_in_a_module")
    assert cfg.rewards.functions[3].kwargs == {"x": 1}
    with pytest.raises(ConfigError, match=r"reward_funcs\[1\] is a int; give a function"):
        build_config(minimal_run(), reward_funcs=["math", 3])


def test_functions_in_a_config_dict_are_sent_like_the_keyword_arguments():
    fn = lambda p, c, **k: [1.0] * len(c)  # noqa: E731
    cfg = build_config(minimal_run(rewards={"functions": [fn, {"name": fn, "weight": 2.0}]}))
    assert [(f.name, f.weight, bool(f.value)) for f in cfg.rewards.functions] == [
        ("lambda", 1.0, True),
        ("lambda", 2.0, True),
    ]


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: first.
        b: second.
    """
    return a + b


def test_environment_and_tools():
    cfg = build_config(
        minimal_run(data={"chat_template": True}),
        tools=["examples/tools_demo/calculator.py:add", lambda x: x],
        environment={"max_turns": 2},
    )
    env = cfg.environment
    assert env.name == "tools" and env.max_turns == 2 and env.value is None
    assert env.tools[0] == "examples/tools_demo/calculator.py:add"
    assert env.tools[1].name == "lambda" and env.tools[1].value
    named = build_config(
        minimal_run(data={"chat_template": True}), environment=ToolEnvironment, tools=[add]
    )
    assert named.environment.name == "leangrpo.environments.protocol:ToolEnvironment"
    with pytest.raises(
        ConfigError, match="is the class dict, not a subclass of leangrpo.environments.Environment"
    ):
        build_config(minimal_run(data={"chat_template": True}), environment=dict)


@pytest.mark.parametrize(
    "key, value, sections",
    [
        ("num_workers", 3, "rewards={'num_workers': ...} or environment={'num_workers': ...}"),
        ("memory_limit_mb", 512, "rewards={'memory_limit_mb': ...} or environment={'memory_limit_mb': ...}"),
        ("allow_network", True, "rewards={'sandbox': {'allow_network': ...}} or environment={'sandbox': {'allow_network': ...}}"),
        ("pass_env", ["MY_API_KEY"], "rewards={'sandbox': {'pass_env': ...}} or environment={'sandbox': {'pass_env': ...}}"),
        ("chat_template", "chatml", "data={'chat_template': ...} or environment={'chat_template': ...}"),
    ],
)  # fmt: skip
def test_a_key_the_environment_shares_is_ambiguous_in_a_run_with_one(key, value, sections):
    """api_env_kwargs.py: GRPO(environment=Env, allow_network=True) set the *rewards*
    sandbox's allow_network, silently, the environment's staying off. In a run with an
    environment (given as an argument, or a section of the config) such a key names both
    sections; without one it is the other section's, as before."""
    plain = build_config(DEMO_YAML, overrides={key: value})
    assert plain.environment is None
    given = [
        {"environment": ToolEnvironment, "tools": [add]},
        {"tools": [add]},
        {"overrides": {"environment": {"name": "tools", "tools": ["examples/tools_demo/calculator.py:add"]}}},
    ]  # fmt: skip
    for how in given:
        arguments = {**how, "overrides": {**how.get("overrides", {}), key: value}}
        with pytest.raises(ConfigError) as err:
            build_config(minimal_run(), **arguments)
        message = str(err.value)
        assert message.startswith(f"GRPO({key}=...) is ambiguous: ") and "\n" not in message
        assert f"both have it; say which section, as {sections}." in message
    with pytest.raises(ConfigError, match="is ambiguous"):  # the section in the config itself
        build_config("examples/tools_demo.yaml", overrides={key: value})


def test_a_key_only_the_environment_has_sets_it_in_a_run_with_one():
    cfg = build_config(
        minimal_run(data={"chat_template": True}),
        tools=[add],
        overrides={"max_turns": 3, "learning_rate": 0.5},
    )
    assert cfg.environment.max_turns == 3 and cfg.train.learning_rate == 0.5


def test_a_config_round_trips_and_a_run_cannot_be_pickled(tmp_path):
    run = GRPO(
        DEMO_YAML,
        reward_funcs=[lambda p, c, **k: [0.0] * len(c)],
        run={"output_dir": str(tmp_path)},
    )
    again = GRPO(run.config)
    assert again.config == run.config
    path = run.config.save(tmp_path / "cfg.yaml")
    assert load_config(path) == run.config  # the YAML holds the value: the CLI runs it
    with pytest.raises(TypeError, match="a leangrpo.GRPO run stays in the process that trains"):
        __import__("pickle").dumps(run)
    with pytest.raises(UserError, match="GRPO's config is a int"):
        GRPO(3)
