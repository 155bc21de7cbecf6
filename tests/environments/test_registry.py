"""An environment class and tools passed by value (defined in __main__ or a notebook): the
worker unpickles them after its sandbox is set up and runs them like imported ones; a value
that is not an Environment subclass, or does not unpickle there, is one sentence."""

from __future__ import annotations

import base64
import pickle
import textwrap

import pytest

from leangrpo.api.shipping import reference
from leangrpo.config.environment import EnvironmentConfig
from leangrpo.environments.pool import EnvironmentPool
from leangrpo.environments.registry import EnvironmentSpecError

USER = [{"role": "user", "content": "1+2="}]


def cell(source: str) -> dict:
    namespace = {"__name__": "__main__"}
    exec(compile(textwrap.dedent(source), "<cell>", "exec"), namespace)
    return namespace


CELL = """
import os
import traceback
from leangrpo.environments import Environment, StepResult

class Stack:  # unpickled as the stack it is unpickled on
    def __reduce__(self):
        return (traceback.format_stack, ())

STACK = Stack()

def unpickled_in_zygote():
    frames = [line.split("\\n")[0] for line in STACK]
    prepare = any(f.endswith(" in prepare") and "environments/worker.py" in f for f in frames)
    return float(prepare and any(f.endswith(" in _fork_zygote") for f in frames))

def add(a: int, b: int) -> int:
    '''Add two integers.

    Args:
        a: The first number.
        b: The second number.
    '''
    return a + b

class Sum(Environment):
    replies = ("tool",)
    reward_terms = ("correct", "elsewhere", "zygote")

    def reset(self, messages, row, seed):
        self.answer = str(row["answer"])

    def step(self, turn):
        correct = float(turn.text.strip() == self.answer)
        return StepResult(done=True, rewards={"correct": correct, "elsewhere": float(os.getpid() != TRAINER), "zygote": unpickled_in_zygote()})
"""


def by_value_config() -> EnvironmentConfig:
    code = cell(CELL)
    code["Sum"].step.__globals__["TRAINER"] = __import__("os").getpid()
    env = reference(code["Sum"], "environment")
    tool = reference(code["add"], "tools[0]")
    return EnvironmentConfig(
        name=env.name, value=env.value, tools=[{"name": tool.name, "value": tool.value}],
        num_workers=1, timeout_s=5.0,
    )  # fmt: skip


def test_a_class_and_tool_sent_by_value_are_checked_in_the_worker():
    with EnvironmentPool(by_value_config(), mode="check") as pool:  # the start-up check
        assert [t["function"]["name"] for t in pool.tools] == ["add"]
        assert pool.tools[0]["function"]["parameters"]["required"] == ["a", "b"]
        assert pool.reward_terms == ("correct", "elsewhere", "zygote")


def test_a_trajectory_of_a_class_sent_by_value():
    """Scored in its box; the class was unpickled in the zygote's `prepare`, never in the
    supervisor, which unpickles the start-up message the value crosses as text."""
    cfg = by_value_config()
    with EnvironmentPool(cfg) as pool:
        (key,) = pool.new_sessions(1)
        assert pool.reset([(key, USER, {"answer": "3"}, 0)])[0].ok == {"messages": None}
        step = pool.step([(key, "3", 0)])[0].ok
        assert step["done"] and step["rewards"] == {"correct": 1.0, "elsewhere": 1.0, "zygote": 1.0}


def test_a_value_that_is_no_environment_or_does_not_unpickle_is_one_sentence():
    not_env = base64.b64encode(pickle.dumps(dict)).decode()
    cfg = EnvironmentConfig(name="dict", value=not_env, num_workers=1)
    with pytest.raises(
        EnvironmentSpecError, match="environment.name = 'dict' is the class dict, not a subclass"
    ):
        EnvironmentPool(cfg, mode="check").close()
    bad = EnvironmentConfig(name="Sum", value="%%%", num_workers=1)
    with pytest.raises(EnvironmentSpecError, match="the value of 'Sum' is not base64-encoded"):
        EnvironmentPool(bad, mode="check").close()
