"""The verifiers adapter (environments/adapters/verifiers.py) driven turn by turn through
the environment workers, each value checked: its replies, when it is done, the rubric's
weighted reward as the reward term and its functions' values as metrics."""

from __future__ import annotations

import sys

import pytest
from support.configs import ROOT

from leangrpo.config.environment import EnvironmentConfig
from leangrpo.environments.pool import EnvironmentPool

if sys.version_info < (3, 11):
    pytest.skip("verifiers needs Python >= 3.11", allow_module_level=True)
pytest.importorskip("verifiers", reason="verifiers is not installed (extra 'verifiers')")

GUESS = str(ROOT / "tests" / "support" / "guess_env.py") + ":load_environment"
PROMPT = [{"role": "user", "content": "395+136="}]


def test_a_guessing_environment_answers_each_turn_and_scores_with_its_rubric():
    cfg = EnvironmentConfig(name="verifiers", kwargs={"load": GUESS}, num_workers=1, timeout_s=30)
    with EnvironmentPool(cfg) as pool:
        assert pool.reward_terms == ("reward",) and pool.replies == ["user"] and pool.tools == []
        slow, fast, never = pool.new_sessions(3)
        resets = pool.reset([(k, PROMPT, {"answer": "531", "example_id": 0}, 0) for k in (slow, fast, never)])
        assert [o.ok["messages"] for o in resets] == [PROMPT] * 3
        first = pool.step([(slow, "500", 0), (fast, "531", 0), (never, "600", 0)])
        assert [(o.ok["reply"], o.ok["done"]) for o in first] == [
            ([{"role": "user", "content": "higher"}], False),
            ([{"role": "user", "content": "right"}], True),
            ([{"role": "user", "content": "lower"}], False),
        ]
        (second,) = pool.step([(slow, "531", 1)])
        assert second.ok["done"] and second.ok["rewards"] == {}  # rewards come at the end
        ends = pool.finish([(slow, "stop"), (fast, "stop"), (never, "max_turns")])
    # reward = 1.0 x solved + 0.0 x short; short = 1 / (1 + the completion's messages)
    assert [o.ok["rewards"] for o in ends] == [{"reward": 1.0}, {"reward": 1.0}, {"reward": 0.0}]
    assert [(o.ok["metrics"]["solved"], o.ok["metrics"]["short"]) for o in ends] == [
        (1.0, 1 / 4), (1.0, 1 / 2), (0.0, 1 / 2)  # the last reply is not yet in the completion
    ]
