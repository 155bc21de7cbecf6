"""References to reward functions passed by value (the config's `value`): unpickled in the
sandboxed worker only, scored there like any function, and every way a value can fail is
one sentence naming it, before any model loads."""

from __future__ import annotations

import base64
import os
import pickle
import sys
import textwrap
import types

import pytest
from support.configs import rewards_section

from leangrpo.api.shipping import reference
from leangrpo.config.run import RewardSpec
from leangrpo.contracts import Completion, Prompt, RolloutSample
from leangrpo.rewards import RewardPool, RewardSpecError, check_rewards, parse_specs


def cell_function(source: str, name: str, **names):
    namespace = {"__name__": "__main__", **names}
    exec(compile(textwrap.dedent(source), "<cell>", "exec"), namespace)
    return namespace[name]


def by_value(fn) -> RewardSpec:
    ref = reference(fn, "reward_funcs[0]")
    return RewardSpec(name=ref.name, value=ref.value)


def raw_value(name: str, obj) -> RewardSpec:
    return RewardSpec(name=name, value=base64.b64encode(pickle.dumps(obj)).decode())


def samples(texts):
    return [
        RolloutSample(
            group_id=i,
            prompt=Prompt(uid=i, text="q", ids=[1], columns={"answer": "ab"}),
            completion=Completion(ids=[1], text=t, logprobs=[0.0], finish_reason="stop", version=0),
        )
        for i, t in enumerate(texts)
    ]


def test_a_function_sent_by_value_is_scored_in_the_worker_not_the_trainer():
    fn = cell_function(
        """
        import os
        WEIGHTS = {"ab": 2.0}
        def where(prompts, completions, answer, **columns):
            elsewhere = os.getpid() != TRAINER  # the worker is another process
            return [WEIGHTS.get(c, 0.0) * elsewhere + (c == a) for c, a in zip(completions, answer)]
        """,
        "where",
        TRAINER=os.getpid(),
    )
    section = rewards_section(by_value(fn), ("length", 1.0, {"target": 2}))
    assert [s.key for s in check_rewards(section)] == ["where", "length"]
    pool = RewardPool(section)
    try:
        batch = samples(["ab", "x"])
        pool.score(batch)
    finally:
        pool.close()
    assert [s.rewards["where"] for s in batch] == [3.0, 0.0]


def test_a_value_is_checked_as_base64_in_the_trainer():
    spec = RewardSpec(name="fn", value="not base64!")
    with pytest.raises(
        RewardSpecError,
        match=r"rewards.functions\[0\].value: the value of 'fn' is not base64-encoded",
    ):
        parse_specs(rewards_section(spec))


def test_what_cannot_be_unpickled_in_the_worker_is_one_sentence(tmp_path):
    ephemeral = types.ModuleType("leangrpo_test_ephemeral")  # exists in this process only
    exec("def fn(p, c, **k):\n    return [0.0] * len(c)", ephemeral.__dict__)
    sys.modules[ephemeral.__name__] = ephemeral
    try:
        missing = raw_value("fn", ephemeral.fn)
    finally:
        del sys.modules[ephemeral.__name__]
    exits = cell_function(
        """
        import sys
        class Exit:
            def __reduce__(self):
                return (sys.exit, (3,))
        """,
        "Exit",
    )
    cases = [
        (missing, "'fn' (passed by value) could not be unpickled in the worker: ModuleNotFoundError: No module named 'leangrpo_test_ephemeral'; a module it needs must be importable there"),
        (raw_value("number", 3), "'number' (passed by value) is a int, not a function"),
        (raw_value("exits", exits()), "'exits' (passed by value) called sys.exit(3) at import"),
    ]  # fmt: skip
    for spec, expected in cases:
        with pytest.raises(RewardSpecError) as err:
            check_rewards(rewards_section(spec))
        assert str(err.value) == f"rewards.functions[0].name = '{spec.name}': {expected}" or (
            expected in str(err.value)
        ), str(err.value)
        assert str(err.value).startswith(f"rewards.functions[0].name = '{spec.name}': ")


def test_a_value_is_unpickled_in_the_zygotes_prepare_not_in_the_supervisor():
    """The supervisor (sandbox/launch.py) unpickles the start-up message and holds the
    channel to the trainer; a value must cross it as text and be unpickled only in the
    zygote's `prepare`, after confinement. The value's global is the stack it was unpickled
    on (traceback.format_stack, called by pickle.loads), read back by the reward in its box."""
    fn = cell_function(
        """
        import traceback
        class Stack:
            def __reduce__(self):
                return (traceback.format_stack, ())
        STACK = Stack()
        def where(prompts, completions, **columns):
            frames = [line.split("\\n")[0] for line in STACK]
            in_zygote = any(f.endswith(" in prepare") and "rewards/worker.py" in f for f in frames)
            forked = any(f.endswith(" in _fork_zygote") for f in frames)
            return [float(in_zygote and forked)] * len(completions)
        """,
        "where",
    )
    section = rewards_section(by_value(fn))
    check_rewards(section)
    pool = RewardPool(section)
    try:
        batch = samples(["ab"])
        pool.score(batch)
    finally:
        pool.close()
    assert batch[0].rewards["where"] == 1.0
