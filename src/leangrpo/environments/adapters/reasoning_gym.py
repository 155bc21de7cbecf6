"""reasoning-gym tasks (procedurally generated, with their own scorers) as data and a reward.

    python -m leangrpo.environments.adapters.reasoning_gym basic_arithmetic --size 2000 \\
        --seed 0 --out train.jsonl [--config '{"min_terms": 2}']

writes one prompt row per generated item: `prompt` (the question, with
`--instruction` appended), `answer`, and the columns the reward needs, `rg_dataset`,
`rg_config` and `rg_entry` (the item, its metadata included). Generate the eval file with
another seed. The reward

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
    return reasoning_gym.create_dataset(name, size=size, seed=seed, **(config or {}))


def rows(
    name: str, size: int, seed: int, config: dict[str, Any] | None = None, instruction: str = ""
) -> list[dict[str, Any]]:
    """Prompt rows of `size` items of dataset `name` (deterministic in seed and config)."""
    dataset = create(name, size, seed, config)
    config_text = json.dumps(config or {}, sort_keys=True)
    out = []
    for entry in dataset:
        question = entry["question"] + (f"\n{instruction}" if instruction else "")
        out.append({
            "prompt": question,
            "answer": str(entry["answer"]),
            "rg_dataset": name,
            "rg_config": config_text,
            "rg_entry": json.loads(json.dumps(entry, default=str)),
        })  # fmt: skip
    return out


def score(
    prompts: list[str],
    completions: list[str],
    rg_entry: list[dict],
    rg_dataset: list[str],
    rg_config: list[str],
    **columns: Any,
) -> list[float | None]:
    """The dataset's own score of each completion (see the module docstring)."""
    out = []
    for completion, entry, name, config in zip(completions, rg_entry, rg_dataset, rg_config):
        if entry is None or name is None:
            out.append(None)  # a row that reasoning-gym did not make
            continue
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
