"""Build the bundled demo: a tiny Qwen2 model that knows 2-digit arithmetic but drops carries.

    python scripts/build_demo.py [--out examples/demo]

Deterministic (seeded, one CPU thread), about 2,200 optimizer steps: a few minutes on 2
cores (5.5 minutes on a busy machine). It writes:

- `model/`: a 3-layer Qwen2 causal LM (hidden 64, 0.19 M parameters, fp32 safetensors)
  with a character-level tokenizer (one token per character, 32 tokens with the `<pad>`,
  `<eos>`, `<unk>` specials; no BOS), loadable by transformers, peft and vLLM.
- `train.jsonl` (GRPO prompts) and `eval.jsonl` (held-out prompts), columns `prompt`
  ("37+45=") and `answer` ("82"): the demo trains on raw text prompts.

The task is addition and subtraction of 2-digit numbers (a >= b for subtraction). Every
problem is assigned by a hash of its text to eval (128), GRPO train (2000) or pretraining
(the rest), so eval problems are never seen before evaluation. Pretraining is plain
next-token training on the answer tokens and EOS, in two phases: `--clean-steps` on
correct answers (the model learns the arithmetic; a noisy target from the start learns
far slower), then the rest on *noisy* answers, resampled every time a problem is drawn: a
problem with a carry (or borrow) shows its correct answer 35% of the time and the classic
"dropped carry/borrow" answer 50% of the time; other problems are right 70% of the time;
the rest are near misses (off by 1..10, or a one-digit slip). About 55% of the noisy
answers are right. The model ends up preferring the dropped carry while still giving the
right answer real probability, so a reward for the right answer has something clear and
reachable to fix. The script prints the eval accuracy (greedy and sampled at T=1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_lm import add_model_args, build_model, save_model, write_jsonl  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<unk>"]
# 29 characters, 32 tokens with the specials: arithmetic plus a few common ones ("\n" can stop)
CHARS = "0123456789+-*/=()., :?\nQAabcd"
NUM_EVAL, NUM_TRAIN = 128, 2000
P_CORRECT_CARRY, P_DROPPED_CARRY, P_CORRECT_PLAIN = 0.35, 0.50, 0.70


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    op: str  # "+" or "-"

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def has_carry(self) -> bool:
        if self.op == "+":
            return self.a % 10 + self.b % 10 >= 10
        return self.a % 10 < self.b % 10

    @property
    def dropped_carry(self) -> int:
        """The answer of a student who forgets the carry (or subtracts the smaller digit)."""
        ta, ua, tb, ub = self.a // 10, self.a % 10, self.b // 10, self.b % 10
        if self.op == "+":
            return (ta + tb) * 10 + (ua + ub) % 10
        return (ta - tb) * 10 + abs(ua - ub)


def all_problems() -> list[Problem]:
    adds = [Problem(a, b, "+") for a in range(10, 100) for b in range(10, 100)]
    subs = [Problem(a, b, "-") for a in range(10, 100) for b in range(10, a + 1)]
    return adds + subs


def split_problems(problems: list[Problem]) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """(eval, train, pretrain) by a hash of the prompt text: stable across runs and machines."""
    ranked = sorted(problems, key=lambda p: hashlib.sha256(p.prompt.encode()).hexdigest())
    return (
        ranked[:NUM_EVAL],
        ranked[NUM_EVAL : NUM_EVAL + NUM_TRAIN],
        ranked[NUM_EVAL + NUM_TRAIN :],
    )


def near_miss(answer: int, rng: random.Random) -> int:
    """A plausible wrong answer: off by 1..10, or one digit replaced."""
    while True:
        if rng.random() < 0.6:
            wrong = answer + rng.choice([-1, 1]) * rng.randint(1, 10)
        else:
            digits = list(str(answer))
            i = rng.randrange(len(digits))
            digits[i] = str(rng.randrange(1 if i == 0 and len(digits) > 1 else 0, 10))
            wrong = int("".join(digits))
        if wrong != answer and wrong >= 0:
            return wrong


def noisy_answer(problem: Problem, rng: random.Random) -> int:
    u = rng.random()
    if problem.has_carry:
        if u < P_CORRECT_CARRY:
            return problem.answer
        if u < P_CORRECT_CARRY + P_DROPPED_CARRY and problem.dropped_carry != problem.answer:
            return problem.dropped_carry
        return near_miss(problem.answer, rng)
    return problem.answer if u < P_CORRECT_PLAIN else near_miss(problem.answer, rng)


def build_tokenizer():
    """One token per character: a byte-level BPE with no merges over the demo alphabet.

    Byte-level (like Qwen2's own tokenizer) because transformers v5 loads any qwen2 model
    directory with `Qwen2Tokenizer`, which rebuilds a byte-level pipeline around the saved
    vocabulary; with byte-level symbols (" " is "Ġ", "\\n" is "Ċ") and no merges, that
    class, `TokenizersBackend` and vLLM all give one id per character. Characters outside
    the alphabet become `<unk>` (or are dropped by `Qwen2Tokenizer`).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [byte_level.pre_tokenize_str(c)[0][0] for c in CHARS]
    vocab = {token: i for i, token in enumerate(SPECIALS + symbols)}
    backend = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def make_batch(problems, tokenizer, rng: random.Random, batch_size: int, noisy: bool = True):
    """(input_ids, labels) (B, L): every prompt has 6 characters; loss on the answer + EOS."""
    rows, prompt_lens = [], []
    for problem in rng.choices(problems, k=batch_size):
        prompt = tokenizer(problem.prompt).input_ids
        value = noisy_answer(problem, rng) if noisy else problem.answer
        answer = tokenizer(str(value)).input_ids + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        prompt_lens.append(len(prompt))
    width = max(len(r) for r in rows)
    input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
    labels = torch.full((batch_size, width), -100)
    for i, (row, n_prompt) in enumerate(zip(rows, prompt_lens)):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, n_prompt : len(row)] = torch.tensor(row[n_prompt:])
    return input_ids, labels


def pretrain(model, tokenizer, problems, eval_set, args) -> None:
    steps, batch_size, lr = args.steps, args.batch_size, args.lr
    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        scale = min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        noisy = step >= args.clean_steps
        input_ids, labels = make_batch(problems, tokenizer, rng, batch_size, noisy)
        logits = model(
            input_ids=input_ids
        ).logits  # (B, L, V); right padding, causal: no mask needed
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % args.log_every == 0 or step == steps - 1:
            model.eval()
            greedy = answer_accuracy(model, tokenizer, eval_set, temperature=0.0, seed=0)
            model.train()
            elapsed = time.perf_counter() - start
            print(
                f"step {step:5d}  loss {loss.item():.4f}  eval greedy {greedy:.3f}  {elapsed:6.1f} s"
            )
    model.eval()


@torch.no_grad()
def answer_accuracy(model, tokenizer, problems, temperature: float, seed: int, max_new: int = 4):
    """Fraction of problems answered exactly (greedy when temperature == 0)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([tokenizer(p.prompt).input_ids for p in problems])  # (B, 6): equal lengths
    for _ in range(max_new):
        logits = model(input_ids=ids).logits[:, -1].float()  # (B, V)
        if temperature == 0:
            next_ids = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_ids = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        ids = torch.cat([ids, next_ids[:, None]], dim=1)
    texts = tokenizer.batch_decode(ids[:, 6:].tolist())
    answers = [text.split(tokenizer.eos_token)[0] for text in texts]
    return sum(a == str(p.answer) for a, p in zip(answers, problems)) / len(problems)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("examples/demo"))
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument(
        "--clean-steps", type=int, default=1600, help="steps on correct answers first"
    )
    add_model_args(parser)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args, max_positions=64)
    eval_set, train_set, pretrain_set = split_problems(all_problems())
    print(f"problems: eval {len(eval_set)}, train {len(train_set)}, pretrain {len(pretrain_set)}")
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")

    pretrain(model, tokenizer, pretrain_set, eval_set, args)
    args.out.mkdir(parents=True, exist_ok=True)
    save_model(model, tokenizer, args.out / "model")
    write_jsonl(args.out / "train.jsonl", train_set)
    write_jsonl(args.out / "eval.jsonl", eval_set)

    greedy = answer_accuracy(model, tokenizer, eval_set, temperature=0.0, seed=args.seed)
    sampled = answer_accuracy(model, tokenizer, eval_set, temperature=1.0, seed=args.seed)
    print(json.dumps({"eval_accuracy_greedy": greedy, "eval_accuracy_sampled_t1": sampled}))


if __name__ == "__main__":
    main()
