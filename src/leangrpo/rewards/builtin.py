"""Built-in reward functions: math answer checking, a format regex, length shaping.

- `math`: math-verify parses the reference answer (column `answer`, or kwarg
  `answer_column`; for GSM8K-style references only the text after the last `####` counts)
  and the completion, and checks them for mathematical equivalence (1.0 or 0.0). The
  completion's final answer is math-verify's default extraction: the last `\\boxed{}` if
  there is one, else the last LaTeX expression or plain number. A completion with no
  answer scores 0.0; the reward is None only when the *reference* cannot be parsed.
- `format`: 1.0 when kwarg `pattern` (a regex, compiled with re.DOTALL so `.` spans lines)
  matches the completion, else 0.0; kwarg `mode` is "search" (default: anywhere) or
  "fullmatch" (the whole completion).
- `length`: shaping towards kwarg `target` *characters* (characters, not tokens, so the
  reward is tokenizer-independent): 1.0 within `tolerance` characters of the target, then
  falling linearly to 0.0 at a distance of `tolerance + target`:
  `1 - min(1, max(0, |len - target| - tolerance) / target)`.
"""

from __future__ import annotations

import re
from typing import Any


def math_reward(
    prompts: list[str], completions: list[str], answer_column: str = "answer", **columns: Any
) -> list[float | None]:
    if answer_column not in columns:
        raise ValueError(
            f"the math reward needs the reference answers in column '{answer_column}' but the "
            f"data has only {sorted(columns) or 'no extra columns'}; set data.column_map or "
            f"the reward's kwargs.answer_column"
        )
    golds: dict[str | None, list] = {}
    scores: dict[tuple[str | None, str], float | None] = {}
    out = []
    for reference, completion in zip(columns[answer_column], completions):
        ref = None if reference is None else str(reference)
        if (ref, completion) not in scores:
            scores[ref, completion] = _integer_pair(ref, completion)
            if scores[ref, completion] is None and ref is not None:
                if ref not in golds:
                    golds[ref] = _parse_reference(ref)
                scores[ref, completion] = _score_answer(golds[ref], completion)
        out.append(scores[ref, completion])
    return out


_INTEGER = re.compile(r"-?[0-9]{1,15}")


def _integer_pair(reference: str | None, completion: str) -> float | None:
    """1.0 / 0.0 when both are plain integers (math-verify's verdict there), else None."""
    if reference is None:
        return None
    gold, answer = reference.rpartition("####")[2].strip(), completion.strip()
    if _INTEGER.fullmatch(gold) and _INTEGER.fullmatch(answer):
        return 1.0 if int(gold) == int(answer) else 0.0
    return None


def _score_answer(gold: list, completion: str) -> float | None:
    from math_verify import parse, verify  # imported on first use: sympy takes a second

    if not gold:
        return None
    predicted = parse(completion)
    return 1.0 if predicted and verify(gold, predicted) else 0.0


def _parse_reference(reference: str | None) -> list:
    from math_verify import parse  # imported on first use: sympy takes a second

    if reference is None:
        return []
    text = reference.rpartition("####")[2].strip()
    if not text:
        return []
    gold = parse(text)
    if not gold and "$" not in text:  # bare LaTeX such as \sqrt{2} or x^2+1
        gold = parse(f"${text}$")
    return gold


def format_reward(
    prompts: list[str],
    completions: list[str],
    pattern: str = "",
    mode: str = "search",
    **columns: Any,
) -> list[float]:
    check_kwargs("format", {"pattern": pattern, "mode": mode})
    regex = re.compile(pattern, re.DOTALL)
    match = regex.search if mode == "search" else regex.fullmatch
    return [1.0 if match(completion) else 0.0 for completion in completions]


def length_reward(
    prompts: list[str],
    completions: list[str],
    target: float = 0,
    tolerance: float = 0,
    **columns: Any,
) -> list[float]:
    check_kwargs("length", {"target": target, "tolerance": tolerance})
    scores = []
    for completion in completions:
        excess = max(0.0, abs(len(completion) - target) - tolerance)
        scores.append(1.0 - min(1.0, excess / target))
    return scores


def warm_up(name: str) -> None:
    """Pay one-off costs (math-verify's first parse builds its grammars) before timing starts."""
    if name == "math":
        math_reward([""], ["\\boxed{\\frac{1}{2}}"], answer=["0.5"])


BUILTINS = {"math": math_reward, "format": format_reward, "length": length_reward}
_KWARGS = {
    "math": {"answer_column"},
    "format": {"pattern", "mode"},
    "length": {"target", "tolerance"},
}


def columns_read(name: str, kwargs: dict[str, Any]) -> list[str]:
    """The data columns built-in `name` reads (checked against the data before the model
    loads: preflight.py)."""
    return [kwargs.get("answer_column", "answer")] if name == "math" else []


def check_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """Raise ValueError naming the first bad kwarg of built-in `name`."""
    unknown = sorted(set(kwargs) - _KWARGS[name])
    if unknown:
        raise ValueError(
            f"unknown kwarg(s) {unknown} for the '{name}' reward; it takes {sorted(_KWARGS[name])}"
        )
    if name == "format":
        pattern = kwargs.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("the 'format' reward needs kwargs.pattern, a non-empty regex")
        try:
            re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise ValueError(f"kwargs.pattern {pattern!r} is not a valid regex: {e}") from None
        if kwargs.get("mode", "search") not in ("search", "fullmatch"):
            raise ValueError(f"kwargs.mode = {kwargs['mode']!r}; use 'search' or 'fullmatch'")
    if name == "length":
        target, tolerance = kwargs.get("target"), kwargs.get("tolerance", 0)
        if not isinstance(target, (int, float)) or isinstance(target, bool) or target <= 0:
            raise ValueError("the 'length' reward needs kwargs.target, a number of characters > 0")
        if not isinstance(tolerance, (int, float)) or tolerance < 0:
            raise ValueError(f"kwargs.tolerance = {tolerance!r} must be a number >= 0")
    if name == "math" and not isinstance(kwargs.get("answer_column", "answer"), str):
        raise ValueError("kwargs.answer_column must be a column name (a string)")
