"""User code given as objects: by name when a worker can import it, by value otherwise, and
refused in one sentence naming what it holds when it cannot (or must not) be sent; the
trainer never unpickles what it sends."""

from __future__ import annotations

import base64
import json
import pickle
import socket
import textwrap
import threading

import pytest
import torch

from leangrpo.api.grpo import GRPO
from leangrpo.api.shipping import MAX_VALUE_BYTES, ByValue, ShippingError, reference
from leangrpo.environments.protocol import ToolEnvironment
from leangrpo.rewards.builtin import BUILTINS


def main_module(source: str, **names) -> dict:
    """Run `source` as a notebook cell or script would: in a module named __main__."""
    namespace = {"__name__": "__main__", **names}
    exec(compile(textwrap.dedent(source), "<cell>", "exec"), namespace)
    return namespace


def unpickled(ref: ByValue):
    return pickle.loads(base64.b64decode(ref.value))


def test_what_a_module_defines_goes_by_name():
    assert reference(json.dumps, "x") == "json:dumps"
    assert reference(ToolEnvironment, "x") == "leangrpo.environments.protocol:ToolEnvironment"
    fn = BUILTINS["math"]
    assert reference(fn, "x") == f"{fn.__module__}:{fn.__name__}"


def test_a_cell_function_goes_by_value_with_what_it_uses():
    cell = main_module(
        """
        import math
        OFFSET = 0.5
        def helper(text):
            return len(text) + OFFSET
        def make(scale):
            def reward(prompts, completions, **columns):
                return [math.floor(helper(c) * scale) for c in completions]
            return reward
        reward = make(2)
        """
    )
    ref = reference(cell["reward"], "reward_funcs[0]")
    assert isinstance(ref, ByValue) and ref.name == "reward"
    assert unpickled(ref)([""], ["abc", "a"]) == [7, 3]
    lam = reference(lambda p, c, **k: [0.0] * len(c), "reward_funcs[1]")
    assert isinstance(lam, ByValue) and lam.name == "lambda"


class _Thing:
    def __init__(self):
        self.sock = socket.socket()

    def __call__(self, prompts, completions, **columns):
        return [0.0] * len(completions)


@pytest.fixture
def held_objects(tmp_path):
    (tmp_path / "data.txt").write_text("secret")
    readable = open(tmp_path / "data.txt")  # noqa: SIM115  held on purpose
    thing = _Thing()
    yield {
        "lock": threading.Lock(),
        "model": torch.nn.Linear(2, 2),
        "handle": readable,
        "big": list(range(MAX_VALUE_BYTES // 4)),
        "run_": GRPO(
            {"model": {"name_or_path": "m"}, "data": {"path": "x.jsonl"}},
            reward_funcs=["math"],
        ),
        "thing": thing,
    }
    readable.close()
    thing.sock.close()


CASES = {
    "a lock": (
        "def reward(p, c, **k):\n    with lock:\n        return [0.0] * len(c)",
        "it holds the global `lock` (a lock), which cannot be pickled (TypeError: cannot pickle '_thread.lock' object)",
    ),
    "a model in a closure": (
        "def make(m):\n    return lambda p, c, **k: [float(m.weight.sum())] * len(c)\nreward = make(model)",
        "it holds the closure variable `m`, a model (a Linear, a torch.nn.Module): every worker would get a copy of it, not the model being trained",
    ),
    "a readable file": (
        "def reward(p, c, **k):\n    return [float(len(handle.read()))] * len(c)",
        "it holds the global `handle`, an open file (a TextIOWrapper): its descriptor is the trainer's",
    ),
    "a lock through a helper": (
        "def helper():\n    return lock\ndef reward(p, c, **k):\n    helper()\n    return [0.0] * len(c)",
        "it holds the global `helper` (a function), which holds the global `lock` (a lock), which cannot be pickled",
    ),
    "the run": (
        "def reward(p, c, **k):\n    return [float(run_.config.run.seed)] * len(c)",
        "it holds the global `run_`, leangrpo's own GRPO, which stays in the trainer",
    ),
    "a model in a dict": (
        "models = {'m': model}\ndef reward(p, c, **k):\n    return [0.0] * len(models)",
        "it holds the global `models` (a dict), which holds a model (a Linear",
    ),
    "a bound method's socket": (
        "reward = thing.__call__",
        "it holds its object (self) (a _Thing), which cannot be pickled",
    ),
    "the environment": (
        "from os import environ\ndef reward(p, c, **k):\n    return [float('HF_TOKEN' in environ)] * len(c)",
        "it holds the global `environ`, the trainer's environment variables (os.environ)",
    ),
    "a weight": (
        "w = model.weight\ndef reward(p, c, **k):\n    return [float(w.sum())] * len(c)",
        "it holds the global `w`, a model's weight (a torch.nn.Parameter)",
    ),
    "too much data": (
        "def reward(p, c, **k):\n    return [float(len(big))] * len(c)",
        "KiB, most of it the global `big`",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_what_cannot_be_sent_is_refused_in_one_sentence_naming_it(held_objects, case):
    source, expected = CASES[case]
    reward = main_module(source, **held_objects)["reward"]
    with pytest.raises(ShippingError) as err:
        reference(reward, "reward_funcs[0]")
    text = str(err.value)
    assert text.startswith("reward_funcs[0] (") and expected in text, text
    assert "\n" not in text


def test_a_copy_of_a_secret_from_the_environment_is_refused_naming_the_variable(monkeypatch):
    """environ_copy.py: os.environ itself was refused, but `ENV = dict(os.environ)` sent
    every variable, a token included, into config.yaml. A held object (or the code) whose
    pickled bytes hold the value of a secret-looking variable is refused, naming it; a
    function reading os.environ when it runs goes (the sandbox passes what pass_env names)."""
    monkeypatch.setenv("LEANGRPO_TEST_API_TOKEN", "hunter2-very-secret")
    sources = {
        "import os\nENV = dict(os.environ)\ndef reward(p, c, **k):\n    return [float(bool(ENV))] * len(c)": (
            "it holds the global `ENV` (a dict), which holds the value of the environment variable LEANGRPO_TEST_API_TOKEN, a secret"
        ),
        "import os\nclass S:\n    token = os.environ['LEANGRPO_TEST_API_TOKEN']\ndef reward(p, c, **k):\n    return [float(bool(S.token))] * len(c)": (
            "it holds the global `S` (a class), which holds the class attribute `S.token` (a str), which holds the value of the environment variable LEANGRPO_TEST_API_TOKEN"
        ),
        "def reward(p, c, **k):\n    return [float('hunter2-very-secret' in x) for x in c]": (
            "it holds the value of the environment variable LEANGRPO_TEST_API_TOKEN"
        ),
    }  # fmt: skip
    for source, expected in sources.items():
        with pytest.raises(ShippingError) as err:
            reference(main_module(source)["reward"], "reward_funcs[0]")
        text = str(err.value)
        assert text.startswith("reward_funcs[0] ('reward') cannot be sent") and expected in text
        assert "pass_env" in text and "\n" not in text
    reads = "import os\ndef reward(p, c, **k):\n    return [float('LEANGRPO_TEST_API_TOKEN' in os.environ)] * len(c)"
    assert isinstance(reference(main_module(reads)["reward"], "r"), ByValue)
    monkeypatch.setenv("LEANGRPO_TEST_API_TOKEN", "short")  # too short to tell from chance
    literal = "def reward(p, c, **k):\n    return [float('short' in x) for x in c]"
    assert isinstance(reference(main_module(literal)["reward"], "r"), ByValue)


def test_an_environment_class_holding_a_model_is_refused(held_objects):
    cell = main_module(
        """
        from leangrpo.environments import Environment, StepResult
        class Judge(Environment):
            def step(self, turn):
                return StepResult(done=True, rewards={"r": float(model(turn.text))})
        """,
        **held_objects,
    )
    with pytest.raises(ShippingError, match=r"the global `model` of Judge\.step, a model"):
        reference(cell["Judge"], "environment")


def test_the_trainer_never_unpickles_what_it_sends(tmp_path):
    """A value whose unpickling has an effect (a marker file) has none while it is made:
    only `pickle.loads`, which the workers run, makes the file."""
    marker = tmp_path / "unpickled"
    cell = main_module(
        """
        class Effect:
            def __reduce__(self):
                return (open, (MARKER, "w"))
        EFFECT = Effect()
        def reward(prompts, completions, **columns):
            return [float(EFFECT is not None)] * len(completions)
        """,
        MARKER=str(marker),
    )
    ref = GRPO(
        {"model": {"name_or_path": "m"}, "data": {"path": "x.jsonl"}}, reward_funcs=[cell["reward"]]
    ).config.rewards.functions[0]
    assert ref.value is not None and not marker.exists()
    pickle.loads(base64.b64decode(ref.value)).__globals__["EFFECT"].close()
    assert marker.exists()  # the test can see an unpickling
