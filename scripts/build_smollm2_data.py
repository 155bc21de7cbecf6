"""Writes examples/smollm2/{train,eval}.jsonl: small additions for the SmolLM2 LoRA example.

Each prompt is a short chat (a list of messages, rendered by the model's chat template
with the system prompt of examples/smollm2_cpu.yaml): one solved example, then the
question. `answer` is the reference for the `math` reward; the `format` reward checks
the required form `Answer: N`. a and b run over 1..15 (225 problems); 48 are held out
for evaluation by a fixed shuffle (seed 0), the other 177 are GRPO prompts.

    python scripts/build_smollm2_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "examples" / "smollm2"
EXAMPLE = [
    {"role": "user", "content": "What is 2 + 5?"},
    {"role": "assistant", "content": "Answer: 7"},
]
EVAL_SIZE = 48


def rows() -> list[dict]:
    problems = [(a, b) for a in range(1, 16) for b in range(1, 16)]
    random.Random(0).shuffle(problems)
    return [
        {
            "prompt": [*EXAMPLE, {"role": "user", "content": f"What is {a} + {b}?"}],
            "answer": str(a + b),
        }
        for a, b in problems
    ]


def main() -> None:
    data = rows()
    OUT.mkdir(parents=True, exist_ok=True)
    for name, part in [("eval", data[:EVAL_SIZE]), ("train", data[EVAL_SIZE:])]:
        with open(OUT / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"{OUT / name}.jsonl: {len(part)} prompts")


if __name__ == "__main__":
    main()
