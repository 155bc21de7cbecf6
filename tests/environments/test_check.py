"""The environment checks before the model loads (environments/check.py): rewards that can
only be 0 are refused; with the tokenizer's record, the chat template and every prompt's
first turn (tools listed, environment.chat_template) are checked there, in a process that
imports neither transformers nor torch; each failure is one sentence."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from support.configs import ROOT
from transformers import AutoTokenizer

from leangrpo.config import config_from_dict
from leangrpo.environments.check import NoRewardError, check_environment
from leangrpo.model.tokenizer import TOKENIZER_FILES, remember

TOOLS_DEMO = ROOT / "examples" / "tools_demo"
CALCULATOR = str(TOOLS_DEMO / "calculator.py") + ":add"
MATH = [{"name": "math", "kwargs": {"answer_column": "answer"}}]


def tools_config(tmp_path, environment=None, rewards=None, **sections) -> dict:
    cfg = {
        "run": {"output_dir": str(tmp_path / "run")},
        "model": {"name_or_path": str(TOOLS_DEMO / "model")},
        "data": {"path": str(TOOLS_DEMO / "train.jsonl"), "eval_path": str(TOOLS_DEMO / "eval.jsonl"),
                 "chat_template": True},
        "rewards": {"functions": MATH if rewards is None else rewards},
        "environment": {"tools": [CALCULATOR], "num_workers": 1, "max_total_tokens": 192, **(environment or {})},
        "rollout": {"max_new_tokens": 8},
    }  # fmt: skip
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANGRPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize(
    ("environment", "rewards", "refused"),
    [
        ({}, [], "rewards.functions is empty and environment.name = 'tools' gives no reward terms"),
        ({}, [{"name": "math", "weight": 0.0, "kwargs": {"answer_column": "answer"}}], "every rewards.functions[*].weight is 0 and environment.name = 'tools'"),
        ({"name": "support.environments:Unrewarding", "tools": []}, [], "environment.name = 'support.environments:Unrewarding' gives no reward terms"),
        ({"name": "support.environments:Again", "tools": []}, [], None),  # it does not say: it may
        ({"name": "support.environments:Scores", "tools": []}, [], None),
        ({}, MATH, None),
    ],
)  # fmt: skip
def test_a_run_whose_rewards_can_only_be_zero_is_refused(tmp_path, environment, rewards, refused):
    cfg = config_from_dict(tools_config(tmp_path, environment, rewards))
    if refused is None:
        check_environment(cfg, None, None)
        return
    with pytest.raises(NoRewardError) as info:
        check_environment(cfg, None, None)
    message = str(info.value)
    assert refused in message and "nothing could be learned; add a reward function" in message


def recorded_model(tmp_path):
    """The tools demo's tokenizer files, with the record the set-up would leave."""
    directory = tmp_path / "model"
    directory.mkdir()
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (TOOLS_DEMO / "model" / name).is_file():
            shutil.copy2(TOOLS_DEMO / "model" / name, directory / name)
    assert remember(directory, AutoTokenizer.from_pretrained(directory))
    return directory


CHECK = """
import json, sys
from leangrpo.config import config_from_dict
from leangrpo.environments.check import check_environment
from leangrpo.model.files import check_model_files
from leangrpo.preflight import prompt_limit
cfg = config_from_dict(json.loads(sys.argv[1]))
try:
    check_environment(cfg, __import__("pathlib").Path(sys.argv[2]), prompt_limit(cfg, check_model_files(cfg.model)))
    print("passed")
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
print(sorted({m.split(".")[0] for m in sys.modules} & {"transformers", "torch"}))
"""


def check_in_a_fresh_process(cfg: dict, model_dir, cache) -> list[str]:
    import json

    env = {**os.environ, "LEANGRPO_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", CHECK, json.dumps(cfg), str(model_dir)],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


TRIM = "{%- if message.content %}{{- message.content }}{%- endif %}"


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({"max_total_tokens": 20}, "DataError: data.path = '{train}' row 0 has 23 tokens as its first turn renders it (tools listed, with environment.chat_template), more than the 12 allowed by environment.max_total_tokens = 20 minus rollout.max_new_tokens = 8 (64 of the 64 prompts checked are over it"),
        ({"chat_template": "{trimming}"}, "TemplateError: the chat template of {model} trims the whitespace at the edges of an assistant turn"),
        ({"chat_template": "{broken}"}, "TemplateError: environment.chat_template = '{broken}' is not a valid Jinja template: unexpected '}}' (line 1); fix the template"),
        ({"max_total_tokens": 64}, "passed"),
    ],
)  # fmt: skip
def test_the_template_and_the_first_turns_are_checked_before_transformers_loads(tmp_path, cache, environment, expected):
    """With the record, the prompt-length check renders prompts as the first turn does (the
    tools listing included: without it the prompt is 12 tokens and passed, then every
    trajectory ended 'prompt too long'), and the template checks run, all without
    importing transformers or torch."""
    model_dir = recorded_model(tmp_path)
    template = (TOOLS_DEMO / "model" / "chat_template.jinja").read_text()
    assert TRIM in template
    (tmp_path / "trim.jinja").write_text(template.replace(TRIM, TRIM.replace("message.content }}", "message.content | trim }}")))  # fmt: skip
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }{% endfor %}")
    paths = {"trimming": str(tmp_path / "trim.jinja"), "broken": str(tmp_path / "broken.jinja")}
    environment = {k: v.format(**paths) if isinstance(v, str) else v for k, v in environment.items()}
    cfg = tools_config(tmp_path, environment, train={"micro_batch_tokens": 4096})
    lines = check_in_a_fresh_process(cfg, model_dir, cache)
    want = expected.format(train=TOOLS_DEMO / "train.jsonl", model=model_dir, **paths)
    assert lines[0].startswith(want), lines[0]
    assert lines[1] == "[]"
