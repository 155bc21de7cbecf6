"""The public API of environments as the README documents it ("Writing an environment"):
its example is examples/tools_demo/checked_sum.py, word for word, and it runs: the tool it
offers is listed and answers calls, its reward term is declared and scored, its metric
is logged as the README says; a run with no reward function is accepted for it."""

from __future__ import annotations

import re

from support.configs import ROOT

from leangrpo.config import config_from_dict
from leangrpo.config.environment import EnvironmentConfig
from leangrpo.environments.check import check_rewards_possible
from leangrpo.environments.pool import EnvironmentPool

EXAMPLE = ROOT / "examples" / "tools_demo" / "checked_sum.py"
PROMPT = [{"role": "user", "content": "40+2="}]


def test_the_readme_example_is_the_example_file():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("#### Writing an environment") :]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    source = EXAMPLE.read_text()
    assert source.endswith(block) and source[: -len(block)].strip().startswith('"""')


def test_the_readme_example_answers_tool_calls_and_scores_the_answer():
    cfg = EnvironmentConfig(name=f"{EXAMPLE}:CheckedSum", num_workers=1, timeout_s=10)
    with EnvironmentPool(cfg) as pool:
        assert [t["function"]["name"] for t in pool.tools] == ["add"]
        assert pool.replies == ["tool"] and pool.reward_terms == ("correct",)
        right, wrong = pool.new_sessions(2)
        pool.reset([(k, PROMPT, {"answer": "42"}, 0) for k in (right, wrong)])
        call = '<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call>'
        first = pool.step([(right, call, 0), (wrong, "41", 0)])
        assert first[0].ok["reply"] == [{"role": "tool", "name": "add", "content": "42"}]
        assert not first[0].ok["done"] and first[0].ok["counts"]["tool_calls/add"] == 1
        assert first[1].ok["done"] and first[1].ok["rewards"] == {"correct": 0.0}
        (second,) = pool.step([(right, " 42\n", 1)])
        assert second.ok["done"] and second.ok["rewards"] == {"correct": 1.0}
        assert second.ok["metrics"] == {"turns": 2.0}
        pool.finish([(right, "stop"), (wrong, "stop")])
    run = config_from_dict({
        "run": {"output_dir": "/tmp/unused"}, "model": {"name_or_path": "unused"},
        "data": {"path": "unused.jsonl", "chat_template": True}, "rewards": {"functions": []},
        "environment": {"name": f"{EXAMPLE}:CheckedSum"},
    })  # fmt: skip
    check_rewards_possible(run, pool.reward_terms)  # it gives a reward term: accepted
