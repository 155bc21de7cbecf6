"""Built-in rewards on hand-picked examples, and name resolution with its errors."""

from __future__ import annotations

import math
import random
import re
import textwrap

import pytest
from support.configs import rewards_section, unvalidated

from leangrpo.config.run import RewardSpec
from leangrpo.rewards import RewardSpecError, check_rewards, resolve
from leangrpo.rewards.builtin import check_kwargs, format_reward, length_reward, math_reward


def test_math_reward_hand_picked():
    cases = [
        ("42", "Adding them up, so the answer is 42", 1.0),
        ("42", "so the answer is 41", 0.0),
        ("0.5", r"Therefore \boxed{\frac{1}{2}}", 1.0),
        (r"\frac{1}{2}", "it is 0.5", 1.0),
        ("42", r"\boxed{42}, not 7", 1.0),  # the boxed answer wins over a later number
        ("42", "first 42, finally 43", 0.0),  # else the last number counts
        (r"\sqrt{2}", r"$\boxed{\sqrt 2}$", 1.0),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "The total is 72.", 1.0),  # GSM8K reference
        ("42", "no idea", 0.0),
        ("", "42", None),  # an unparsable reference is unscored, not wrong
        (None, "42", None),
    ]
    got = math_reward(["q"] * len(cases), [c for _, c, _ in cases], answer=[r for r, _, _ in cases])
    assert got == [expected for _, _, expected in cases]


def test_math_reward_verifies_each_distinct_pair_once(monkeypatch):
    """A group shares its reference and repeats answers: each (reference, completion) pair
    is parsed and verified once per call, with the same values as one sample per call."""
    import math_verify

    refs = ["0.5", "0.5", "0.5", 0.5, "0.5", None, "1.5", "1.5"]  # not integers: math-verify
    comps = ["0.5", "0.5", "0.25", "0.5", "x", "0.5", "0.5", "1.5"]
    want = [math_reward(["q"], [c], answer=[r])[0] for r, c in zip(refs, comps)]
    calls = []
    real_parse = math_verify.parse
    monkeypatch.setattr(
        math_verify, "parse", lambda s, *a, **k: calls.append(s) or real_parse(s, *a, **k)
    )
    assert math_reward(["q"] * len(refs), comps, answer=refs) == want == [1, 1, 0, 1, 0, None, 0, 1]
    # references "0.5" and "1.5" once each; the completions of the pairs (0.5, 0.5)
    # (0.5, 0.25) (0.5, x) (1.5, 0.5) (1.5, 1.5) once each; the None reference parses nothing
    assert sorted(calls) == sorted(["0.5", "1.5", "0.5", "0.25", "x", "0.5", "1.5"])


def test_math_reward_integer_pairs_equal_math_verify():
    """The integer shortcut gives math-verify's own verdict on every pair it takes."""
    from leangrpo.rewards.builtin import _integer_pair, _parse_reference, _score_answer

    rng = random.Random(0)
    pairs = [("60", "60"), ("60", "060"), ("0", "-0"), ("-5", "5"), ("7", " 7\n"), ("9", "\t9 ")]
    pairs += [("x #### 72", "72"), ("123456789012345", "123456789012345"), ("15", "16")]
    pairs += [
        (str(a), str(a + rng.choice([0, 0, 1, -1, 100])))
        for a in rng.sample(range(-3000, 3000), 60)
    ]
    for ref, comp in pairs:
        assert _integer_pair(ref, comp) == _score_answer(_parse_reference(ref), comp), (ref, comp)
    # not taken: more than 15 digits, a sign or separator, other digits, text, no reference
    for ref, comp in [
        ("1" * 16, "1" * 16),
        ("+5", "5"),
        ("1,000", "1000"),
        ("٣", "3"),
        ("5", "5 apples"),
        (None, "5"),
    ]:
        assert _integer_pair(ref, comp) is None


def test_math_reward_answer_column():
    assert math_reward(["q"], ["7"], answer_column="gold", gold=["7"]) == [1.0]
    with pytest.raises(ValueError, match=r"column 'answer' but the data has only \['solution'\]"):
        math_reward(["q"], ["7"], solution=["7"])


def test_format_reward_search_and_fullmatch():
    completions = ["<think>a\nb</think> 42", "x <think>c</think> 1", "no tags"]
    pattern = r"<think>.*</think>.*"
    assert format_reward([""] * 3, completions, pattern=pattern) == [1.0, 1.0, 0.0]
    assert format_reward([""] * 3, completions, pattern=pattern, mode="fullmatch") == [
        1.0,
        0.0,
        0.0,
    ]


def test_length_reward_matches_formula():
    target, tolerance = 10, 2
    completions = ["x" * n for n in (0, 5, 8, 10, 12, 13, 20, 40)]
    expected = [
        1 - min(1, max(0, abs(n - target) - tolerance) / target) for n in map(len, completions)
    ]
    got = length_reward([""] * len(completions), completions, target=target, tolerance=tolerance)
    assert got == pytest.approx(expected)
    assert got[3] == 1.0 and got[4] == 1.0 and got[5] == pytest.approx(0.9) and got[-1] == 0.0


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("format", {}, "needs kwargs.pattern"),
        ("format", {"pattern": "("}, "not a valid regex"),
        ("format", {"pattern": "a", "mode": "match"}, "use 'search' or 'fullmatch'"),
        ("length", {"target": 0}, "kwargs.target, a number of characters > 0"),
        ("length", {"target": 5, "tolerance": -1}, "tolerance = -1 must be a number >= 0"),
        ("math", {"answer_col": "x"}, r"unknown kwarg\(s\) \['answer_col'\]"),
    ],
)
def test_builtin_kwargs_are_checked(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_kwargs(name, kwargs)


# ---- registry -------------------------------------------------------------------------------

USER_CODE = textwrap.dedent(
    """
    def contains_yes(prompts, completions, **columns):
        return [1.0 if "yes" in c else 0.0 for c in completions]

    NOT_A_FUNCTION = 3
    """
)


def spec(name, weight=1.0, **kwargs):
    return RewardSpec(name=name, weight=weight, kwargs=kwargs)


def test_resolve_by_module_and_by_file(tmp_path, monkeypatch):
    (tmp_path / "my_user_rewards.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = resolve("my_user_rewards:contains_yes")
    by_file = resolve(f"{tmp_path / 'my_user_rewards.py'}:contains_yes")
    for fn in (by_module, by_file):
        assert fn(["p", "p"], ["yes!", "no"]) == [1.0, 0.0]
    assert resolve("math") is math_reward
    monkeypatch.chdir(tmp_path)
    assert resolve("my_user_rewards.py:contains_yes")(["p"], ["yes"]) == [1.0]  # relative path


def test_check_rewards_keys_and_specs(tmp_path):
    (tmp_path / "u.py").write_text(USER_CODE)
    specs = check_rewards(
        rewards_section(
            spec("math"),
            spec("format", 0.5, pattern="a"),
            spec("format", 0.0, pattern="b"),
            spec(f"{tmp_path / 'u.py'}:contains_yes"),
        )
    )
    assert [s.key for s in specs] == ["math", "format", "format_2", "contains_yes"]
    assert [s.weight for s in specs] == [1.0, 0.5, 0.0, 1.0]
    assert specs[3].file == str((tmp_path / "u.py").resolve()) and specs[0].file is None


@pytest.mark.parametrize(
    ("name", "message", "static"),
    [  # static: found without importing anything, and the message lists the accepted forms
        ("maths", r"'maths' is not a reward name", True),
        ("missing_dir/r.py:fn", r"file .*missing_dir/r\.py not found", True),
        ("{dir}/u.py:not-a-name", r"'not-a-name' is not a Python function name", True),
        ("my pkg:fn", r"'my pkg' is not a module name", True),
        ("no_such_module_xyz:fn", r"module 'no_such_module_xyz' not found", False),
        ("{dir}/u.py:nope", r"no attribute 'nope' \(its public callables: contains_yes\)", False),
        ("{dir}/u.py:NOT_A_FUNCTION", r"is a int, not a function", False),
        ("{dir}/broken.py:fn", r"executing .*broken\.py failed: ZeroDivisionError", False),
    ],
)
def test_resolution_errors_name_the_key(tmp_path, name, message, static):
    (tmp_path / "u.py").write_text(USER_CODE)
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    name = name.format(dir=tmp_path)
    with pytest.raises(RewardSpecError) as err:
        check_rewards(rewards_section(spec("math"), spec(name)))
    text = str(err.value)
    assert text.startswith(f"rewards.functions[1].name = '{name}'")
    assert re.search(message, text) and "\n" not in text
    assert ("'package.module:function'" in text) == static


def test_check_rewards_bad_weight_and_kwargs():
    with pytest.raises(RewardSpecError, match=r"rewards.functions\[0\].weight = nan"):
        # a NaN weight is refused by RewardSpec itself; parse_specs checks again for
        # configs that skipped validation
        check_rewards(rewards_section(unvalidated(RewardSpec, name="math", weight=math.nan)))
    with pytest.raises(
        RewardSpecError, match=r"rewards.functions\[0\].kwargs: .*needs kwargs.pattern"
    ):
        check_rewards(rewards_section(spec("format")))
