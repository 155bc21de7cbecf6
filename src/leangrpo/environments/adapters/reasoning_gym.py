"""reasoning-gym tasks (procedurally generated, with their own scorers) as data and a reward.

    python -m leangrpo.environments.adapters.reasoning_gym basic_arithmetic --size 2000 \\
        --seed 0 --out train.jsonl [--config '{"min_terms": 2}']

(composite: --config '{"datasets": [{"name": "basic_arithmetic", "weight": 1, "config": {}}]}')

writes one prompt row per generated item: `prompt` (the question, with
`--instruction` appended), `answer` (null for the tasks that have no single gold answer,
e.g. graph_color, scored by checking the completion), and the columns the reward needs,
`rg_dataset`, `rg_config` and `rg_entry`: the item, its metadata included, as a JSON text
that keeps what plain JSON loses (tuples, dict keys that are not strings), so the scorer
gets the entry exactly as reasoning-gym made it (arc_agi's and rearc's scorers compare
tuples: a plain JSON round trip made their exact gold answers score 0.05). Each entry is
checked to decode equal to the original when written; one that cannot is refused.
Generate the eval file with another seed. The reward

    rewards: {functions: [{name: "leangrpo.environments.adapters.reasoning_gym:score"}]}

scores each completion with the dataset's own `score_answer` (built once per reward
worker from the dataset name and config), on the text in `<answer>...</answer>` tags when
there are some, else on the whole completion: reasoning-gym's scorers give partial credit
for near misses and 0 to a missing answer. Needs `pip install 'leangrpo[reasoning-gym]'`;
without it the reward fails to import at start-up, with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import numbers
from typing import Any

try:
    import reasoning_gym
    from reasoning_gym.utils import extract_answer
except ImportError as e:  # named at start-up by the reward check, in its worker
    raise ImportError(
        "the reasoning-gym adapter needs reasoning-gym: pip install 'leangrpo[reasoning-gym]'"
    ) from e

_SCORERS: dict[tuple[str, str], Any] = {}  # (dataset, config JSON) -> dataset (its scorer)


def create(name: str, size: int, seed: int, config: dict[str, Any] | None = None):
    """The dataset; `config` as JSON gives it (composite's parts as {name, weight, config})."""
    config = dict(config or {})
    if name == "composite" and isinstance(config.get("datasets"), list):
        from reasoning_gym.composite import DatasetSpec

        config["datasets"] = [DatasetSpec(**d) if isinstance(d, dict) else d for d in config["datasets"]]
    return reasoning_gym.create_dataset(name, size=size, seed=seed, **config)


def rows(
    name: str, size: int, seed: int, config: dict[str, Any] | None = None, instruction: str = ""
) -> list[dict[str, Any]]:
    """Prompt rows of `size` items of dataset `name` (deterministic in seed and config)."""
    dataset = create(name, size, seed, config)
    config_text = json.dumps(config or {}, sort_keys=True)
    out = []
    for index, entry in enumerate(dataset):
        question = entry["question"] + (f"\n{instruction}" if instruction else "")
        out.append({
            "prompt": question,
            "answer": None if entry["answer"] is None else str(entry["answer"]),
            "rg_dataset": name,
            "rg_config": config_text,
            "rg_entry": entry_text(entry, f"{name} item {index}"),
        })  # fmt: skip
    return out


# -- the entry as JSON text, types kept ------------------------------------------------------
_TUPLE, _PAIRS = "__tuple__", "__pairs__"  # {"__tuple__": [...]}, {"__pairs__": [[k, v], ...]}


def _encoded(value: Any) -> Any:
    if isinstance(value, str):
        return str(value)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, tuple):
        return {_TUPLE: [_encoded(v) for v in value]}
    if isinstance(value, list):
        return [_encoded(v) for v in value]
    if isinstance(value, dict):
        if all(type(k) is str for k in value) and not {_TUPLE, _PAIRS} & value.keys():
            return {k: _encoded(v) for k, v in value.items()}
        return {_PAIRS: [[_encoded(k), _encoded(v)] for k, v in value.items()]}
    raise TypeError(f"a {type(value).__name__} value, which the entry encoding does not hold")


def _decoded(value: Any) -> Any:
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    if not isinstance(value, dict):
        return value
    if value.keys() == {_TUPLE}:
        return tuple(_decoded(v) for v in value[_TUPLE])
    if value.keys() == {_PAIRS}:
        return {_decoded(k): _decoded(v) for k, v in value[_PAIRS]}
    return {k: _decoded(v) for k, v in value.items()}


def entry_text(entry: dict[str, Any], what: str) -> str:
    """The entry as JSON text that `entry_from_text` turns back into an equal entry."""
    try:
        text = json.dumps(_encoded(entry), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"reasoning-gym {what} cannot be written as data: it holds {e}") from None
    if entry_from_text(text) != entry:
        raise ValueError(f"reasoning-gym {what} does not survive being written as data (its values change type)")
    return text


def entry_from_text(text: str) -> dict[str, Any]:
    return _decoded(json.loads(text))


def score(
    prompts: list[str],
    completions: list[str],
    rg_entry: list[str],
    rg_dataset: list[str],
    rg_config: list[str],
    **columns: Any,
) -> list[float | None]:
    """The dataset's own score of each completion (see the module docstring)."""
    out = []
    for completion, text, name, config in zip(completions, rg_entry, rg_dataset, rg_config):
        if text is None or name is None:
            out.append(None)  # a row that reasoning-gym did not make
            continue
        if not isinstance(text, str):
            raise ValueError(
                "rg_entry is not the entry text this adapter writes (a file from an earlier leangrpo, "
                "whose JSON round trip changed the entries); write the data again with "
                "python -m leangrpo.environments.adapters.reasoning_gym"
            )
        entry = entry_from_text(text)
        key = (name, config or "{}")
        if key not in _SCORERS:
            _SCORERS[key] = create(name, 1, 0, json.loads(key[1]))
        answer = extract_answer(completion, tag_name="answer")
        out.append(float(_SCORERS[key].score_answer(answer if answer is not None else completion.strip(), entry)))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m leangrpo.environments.adapters.reasoning_gym",
        description="Write reasoning-gym items as leangrpo prompt rows (JSONL).",
    )
    parser.add_argument("dataset", help="a reasoning-gym dataset name, e.g. basic_arithmetic")
    parser.add_argument("--size", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default="{}", help="the dataset's settings as JSON")
    parser.add_argument("--instruction", default="", help="text appended to each question")
    parser.add_argument("--out", required=True)
    ns = parser.parse_args(argv)
    made = rows(ns.dataset, ns.size, ns.seed, json.loads(ns.config), ns.instruction)
    with open(ns.out, "w") as f:
        for row in made:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(made)} rows of {ns.dataset} to {ns.out}")


if __name__ == "__main__":
    main()
