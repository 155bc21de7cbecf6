"""Build the bundled tool-use demo: a tiny Qwen2 model that can call a calculator but rarely does.

    python scripts/build_tool_demo.py [--out examples/tools_demo]

Deterministic (seeded, one CPU thread), 4,000 optimizer steps: about 5 minutes on one core.
It writes:

- `model/`: a 3-layer Qwen2 causal LM (hidden 64, 0.19 M parameters, fp32 safetensors)
  with a character-level tokenizer (one token per printable ASCII character and newline)
  plus single tokens for the chat roles and the tool-call tags, and a chat template
  (`chat_template.jinja`) that lists the tools given through `tools=`; loadable by
  transformers and vLLM.
- `train.jsonl` (GRPO prompts) and `eval.jsonl` (held-out prompts), columns `prompt`
  (the user's text, "123+456=") and `answer` ("579").

The task is the sum of two 3-digit numbers, which a model of this size does not learn to
compute. Conversations are rendered with the model's own chat template, the tool `add`
always offered:

    <|system|>tools: add<|end|><|user|>123+456=<|end|><|assistant|>

and the pre-training answers mix two behaviours (a fixed share of every batch):

- direct answers (80%), noisy: 40% right, 35% the "dropped carry" digit-wise sum, the rest
  off by 1..20: `579<|end|>`;
- calculator calls (20%): `<tool_call>{"name": "add", "arguments": {"a": 123, "b": 456}}`
  `</tool_call><|end|>`, the tool's reply `<|tool|>579<|end|>`, the generation prompt
  `<|assistant|>`, then the result copied: `579<|end|>`.

The loss is on the assistant tokens only (every turn's text and its `<|end|>`; the prompt,
the tool's reply and the generation prompts are context), the layout GRPO trains on. So the
model learns the call format and to copy operands and results, calls the tool about one
time in five when sampling and never when greedy, and its direct answers are nearly always
wrong: a reward for the right final answer has one clear thing to teach (call the tool).
Short (direct) and long (tool) rows are batched separately to pad little.

The script ends by measuring the baseline on the held-out prompts with a real multi-turn
loop (the model's turn is parsed, the tool is run, its reply rendered by the template,
the model answers): greedy and sampled at T=1, accuracy, tool-call rate, accuracy with and
without the tool, failed calls.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_lm import add_model_args, build_model, save_model, write_jsonl  # noqa: E402

# Role tags: special tokens (dropped by decode(skip_special_tokens=True)). `<|end|>` closes
# every turn and is the EOS the model stops on.
SPECIALS = ["<pad>", "<|end|>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
# The tool-call tags: single tokens but NOT special (as in Qwen2.5's tokenizer), so the
# text an engine decodes with skip_special_tokens=True still holds them for the parser.
TOOL_TAGS = ["<tool_call>", "</tool_call>"]
# Every printable ASCII character and newline: tool replies and error messages spell out.
CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"
EOS = "<|end|>"
NUM_EVAL, NUM_TRAIN = 256, 2000
P_CORRECT, P_DROPPED_CARRY, MAX_MISS = 0.40, 0.35, 20

# The chat template. Role tags are single special tokens and every turn ends with `<|end|>`,
# so nothing follows the EOS of an assistant turn and every cut between turns is next to a
# special token: rendering turn by turn gives a prefix of the whole, token for token. Tools
# are listed by name only (a 0.2 M-parameter model cannot read JSON schemas), in the system
# turn (after the system message's text, if any). A structured `tool_calls` entry renders
# exactly as the model writes a call, so storing the model's raw text is lossless.
CHAT_TEMPLATE = """\
{%- if messages and messages[0].role == 'system' %}
    {%- set system = messages[0].content %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system = none %}
    {%- set turns = messages %}
{%- endif %}
{%- if system is not none or tools %}
    {{- '<|system|>' }}
    {%- if system is not none %}
        {{- system }}
        {%- if tools %}{{- '\\n' }}{%- endif %}
    {%- endif %}
    {%- if tools %}
        {{- 'tools: ' }}
        {%- for tool in tools %}
            {%- if not loop.first %}{{- ', ' }}{%- endif %}
            {{- tool.function.name if tool.function is defined else tool.name }}
        {%- endfor %}
    {%- endif %}
    {{- '<|end|>' }}
{%- endif %}
{%- for message in turns %}
    {%- if message.role == 'user' %}
        {{- '<|user|>' ~ message.content ~ '<|end|>' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|assistant|>' }}
        {%- if message.content %}{{- message.content }}{%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function if call.function is defined else call %}
            {{- '<tool_call>{"name": ' ~ (call.name | tojson) ~ ', "arguments": ' }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- '}</tool_call>' }}
        {%- endfor %}
        {{- '<|end|>' }}
    {%- elif message.role == 'tool' %}
        {{- '<|tool|>' ~ message.content ~ '<|end|>' }}
    {%- elif message.role == 'system' %}
        {{- '<|system|>' ~ message.content ~ '<|end|>' }}
    {%- else %}
        {{- raise_exception('unknown role ' ~ message.role ~ ' (system, user, assistant, tool)') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}
"""


def _calculator():
    """The demo's tool module, the file examples/tools_demo.yaml offers the model."""
    path = Path(__file__).resolve().parents[1] / "examples" / "tools_demo" / "calculator.py"
    spec = importlib.util.spec_from_file_location("tools_demo_calculator", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOLS = {"add": _calculator().add}


@functools.cache
def tool_schemas() -> list[dict]:
    """The JSON schemas offered through `tools=` (built from the type hints and docstring)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(fn) for fn in TOOLS.values()]


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def dropped_carry(self) -> int:
        """The digit-wise sum of a student who forgets every carry (859+467 -> 216)."""
        digits = (int(x) + int(y) for x, y in zip(str(self.a), str(self.b)))
        return int("".join(str(d % 10) for d in digits))


def all_problems() -> list[Problem]:
    return [Problem(a, b) for a in range(100, 1000) for b in range(100, 1000)]


def split_problems(problems: list[Problem]) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """(eval, train, pretrain) by a hash of the prompt text: stable across runs and machines."""
    ranked = sorted(problems, key=lambda p: hashlib.sha256(p.prompt.encode()).hexdigest())
    return (
        ranked[:NUM_EVAL],
        ranked[NUM_EVAL : NUM_EVAL + NUM_TRAIN],
        ranked[NUM_EVAL + NUM_TRAIN :],
    )


def noisy_answer(problem: Problem, rng: random.Random) -> int:
    """A direct answer as a careless student gives it: right, dropped carry, or a near miss."""
    u = rng.random()
    if u < P_CORRECT:
        return problem.answer
    if u < P_CORRECT + P_DROPPED_CARRY and problem.dropped_carry != problem.answer:
        return problem.dropped_carry
    return problem.answer + rng.choice([-1, 1]) * rng.randint(1, MAX_MISS)


def tool_call_text(problem: Problem) -> str:
    """The model's text of a calculator call (Hermes / Qwen2.5 JSON in tags, one line)."""
    call = {"name": "add", "arguments": {"a": problem.a, "b": problem.b}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def direct_conversation(problem: Problem, rng: random.Random) -> list[dict]:
    return [
        {"role": "user", "content": problem.prompt},
        {"role": "assistant", "content": str(noisy_answer(problem, rng))},
    ]


def tool_conversation(problem: Problem) -> list[dict]:
    return [
        {"role": "user", "content": problem.prompt},
        {"role": "assistant", "content": tool_call_text(problem)},
        {"role": "tool", "name": "add", "content": str(problem.answer)},
        {"role": "assistant", "content": str(problem.answer)},
    ]


def build_tokenizer():
    """One token per character (a byte-level BPE with no merges) plus the role and tool tags.

    Byte-level (like Qwen2's own tokenizer) because transformers v5 loads any qwen2 model
    directory with `Qwen2Tokenizer`, which rebuilds a byte-level pipeline around the saved
    vocabulary; with byte-level symbols (" " is "Ġ", "\\n" is "Ċ") and no merges, that
    class, `TokenizersBackend` and vLLM all give one id per character. The tags are added
    tokens (matched before the character split), so `<tool_call>` in any text is one token.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [byte_level.pre_tokenize_str(c)[0][0] for c in CHARS]
    vocab = {token: i for i, token in enumerate(SPECIALS + TOOL_TAGS + symbols)}
    backend = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token=EOS,
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# ---------------------------------------------------------------------------------------
# Rendering: a conversation as one token sequence, turn by turn (what GRPO trains on)


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    """The conversation's text, the tools always offered (as the demo's environment does)."""
    return tokenizer.apply_chat_template(
        messages, tools=tool_schemas(), tokenize=False, add_generation_prompt=generation_prompt
    )


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def environment_segment(tokenizer, messages: list[dict], reply: list[dict]) -> str:
    """The text between the EOS of the last assistant turn and the next model turn.

    `messages` ends with that assistant turn; the segment is the reply's rendering plus the
    next generation prompt (`<|tool|>579<|end|><|assistant|>`). Raises if the template did
    not render incrementally (it does; the check costs two string comparisons).
    """
    closed = render(tokenizer, messages, generation_prompt=False)
    opened = render(tokenizer, messages + reply, generation_prompt=True)
    if not closed.endswith(messages[-1]["content"] + EOS) or not opened.startswith(closed):
        raise ValueError("the chat template does not render this conversation turn by turn")
    return opened[len(closed) :]


def encode_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """(ids, trained): the prompt, then each assistant turn (its text and EOS, trained) and
    the environment's segment after it (not trained), rendered turn by turn."""
    start = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = encode(tokenizer, render(tokenizer, messages[:start], generation_prompt=True))
    trained = [False] * len(ids)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for k, i in enumerate(turns):
        model_ids = encode(tokenizer, messages[i]["content"]) + [eos_id]
        ids += model_ids
        trained += [True] * len(model_ids)
        if k + 1 < len(turns):
            reply = messages[i + 1 : turns[k + 1]]
            env_ids = encode(tokenizer, environment_segment(tokenizer, messages[: i + 1], reply))
            ids += env_ids
            trained += [False] * len(env_ids)
    return ids, trained


# ---------------------------------------------------------------------------------------
# Pre-training


def draw_rows(problems, tokenizer, rng: random.Random, batch_size: int, p_tool: float):
    """(direct rows, tool rows) of one batch: round(batch_size * p_tool) tool rows."""
    num_tool = round(batch_size * p_tool)
    drawn = rng.choices(problems, k=batch_size)
    direct = [encode_conversation(tokenizer, direct_conversation(p, rng)) for p in drawn[num_tool:]]
    tool = [encode_conversation(tokenizer, tool_conversation(p)) for p in drawn[:num_tool]]
    return direct, tool


def padded(rows: list[tuple[list[int], list[bool]]], pad_id: int):
    """(input_ids, labels) (B, L), right-padded; labels -100 where nothing is trained."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    for i, (ids, trained) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, trained)])
    return input_ids, labels


def summed_loss(model, rows, pad_id: int) -> tuple[torch.Tensor, int]:
    """(sum of next-token losses over the trained tokens, number of trained tokens)."""
    input_ids, labels = padded(rows, pad_id)
    logits = model(input_ids=input_ids).logits  # (B, L, V); right padding, causal: no mask
    targets = labels[:, 1:]
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum")
    return loss, int((targets != -100).sum())


def pretrain(model, tokenizer, problems, args) -> None:
    steps, lr = args.steps, args.lr
    rng = random.Random(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        scale = min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        direct, tool = draw_rows(problems, tokenizer, rng, args.batch_size, args.p_tool)
        direct_loss, direct_tokens = summed_loss(model, direct, tokenizer.pad_token_id)
        tool_loss, tool_tokens = summed_loss(model, tool, tokenizer.pad_token_id)
        loss = (direct_loss + tool_loss) / (direct_tokens + tool_tokens)  # one mean, as one batch
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % args.log_every == 0 or step == steps - 1:
            print(
                f"step {step:5d}  loss {loss.item():.4f}  (direct rows "
                f"{direct_loss.item() / direct_tokens:.4f}, tool rows "
                f"{tool_loss.item() / tool_tokens:.4f})  {time.perf_counter() - start:6.1f} s",
                flush=True,
            )
    model.eval()


# ---------------------------------------------------------------------------------------
# Evaluation: a real multi-turn loop (parse the call, run the tool, render its reply)

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def run_tool_calls(text: str) -> list[dict] | None:
    """The tool messages answering the calls in `text` (None: no call, a final answer).

    A call that does not parse, names an unknown tool or fails gets an `error: ...` reply.
    """
    if "<tool_call>" not in text:
        return None
    blocks = TOOL_CALL.findall(text)
    if not blocks:
        return [{"role": "tool", "content": "error: unclosed <tool_call> block"}]
    return [tool_reply(block) for block in blocks]


def tool_reply(block: str) -> dict:
    try:
        call = json.loads(block)
        name, arguments = call["name"], call["arguments"]
        result = TOOLS[name](**arguments)
    except Exception as e:  # noqa: BLE001 (model-written input: any failure is a reply)
        return {"role": "tool", "content": f"error: {type(e).__name__}: {e}"[:200]}
    return {"role": "tool", "name": name, "content": str(result)}


@dataclass
class Trajectory:
    problem: Problem
    messages: list[dict]
    ids: list[int]  # the prompt, model and environment turns so far
    calls: int = 0  # tool calls made (one per <tool_call> block; an unclosed block counts)
    failed_calls: int = 0  # calls answered with `error: ...`
    answer: str | None = None  # the final turn's text (None: no final answer)
    done: bool = False


def new_trajectory(tokenizer, problem: Problem) -> Trajectory:
    messages = [{"role": "user", "content": problem.prompt}]
    ids = encode(tokenizer, render(tokenizer, messages, generation_prompt=True))
    return Trajectory(problem, messages, ids)


def _cache_kwarg(model) -> str:
    """transformers 5 renamed `past_key_values` to `cache` (the old name is deprecated)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def generate_turns(
    model,
    prefixes: list[list[int]],
    eos_id: int,
    pad_id: int,
    temperature: float,
    generator,
    max_new: int,
) -> list[list[int]]:
    """One model turn per prefix: ids up to and including EOS (or `max_new` ids); KV-cached."""
    from transformers import DynamicCache

    width = max(len(p) for p in prefixes)
    input_ids = torch.full((len(prefixes), width), pad_id)
    mask = torch.zeros((len(prefixes), width), dtype=torch.long)
    for i, prefix in enumerate(prefixes):  # left padding
        input_ids[i, width - len(prefix) :] = torch.tensor(prefix)
        mask[i, width - len(prefix) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, W)
    cache = DynamicCache(config=model.config)
    outs: list[list[int]] = [[] for _ in prefixes]
    finished = torch.zeros(len(prefixes), dtype=torch.bool)
    cache_kwarg = _cache_kwarg(model)
    for _ in range(max_new):
        logits = (
            model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{cache_kwarg: cache},
            )
            .logits[:, -1]
            .float()
        )  # (B, V)
        if temperature == 0:
            next_ids = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_ids = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        for i in (~finished).nonzero().flatten().tolist():
            outs[i].append(int(next_ids[i]))
        finished |= next_ids == eos_id
        if bool(finished.all()):
            break
        input_ids = next_ids[:, None]
        mask = torch.cat([mask, torch.ones((len(prefixes), 1), dtype=torch.long)], dim=1)
        positions = positions[:, -1:] + 1
    return outs


def evaluate(
    model,
    tokenizer,
    problems: list[Problem],
    temperature: float,
    seed: int,
    samples: int = 1,
    max_turns: int = 3,
    max_new: int = 64,
) -> dict:
    """Baseline figures of `samples` trajectories per problem (one turn = one batched call)."""
    generator = torch.Generator().manual_seed(seed)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    trajectories = [new_trajectory(tokenizer, p) for p in problems for _ in range(samples)]
    for turn in range(max_turns):
        live = [t for t in trajectories if not t.done]
        if not live:
            break
        outs = generate_turns(
            model,
            [t.ids for t in live],
            eos_id,
            tokenizer.pad_token_id,
            temperature,
            generator,
            max_new,
        )
        for t, out in zip(live, outs):
            step(tokenizer, t, out, eos_id, last_turn=turn == max_turns - 1)
    return summarize(trajectories)


def step(tokenizer, t: Trajectory, out: list[int], eos_id: int, last_turn: bool) -> None:
    """Append the model's turn; run its tool calls (and render the reply) or take its answer."""
    stopped = bool(out) and out[-1] == eos_id
    text = tokenizer.decode(out[:-1] if stopped else out, skip_special_tokens=False)
    t.ids += out
    t.messages.append({"role": "assistant", "content": text})
    reply = run_tool_calls(text)
    if reply is not None:
        t.calls += len(reply)
        t.failed_calls += sum(m["content"].startswith("error:") for m in reply)
    if not stopped or last_turn or reply is None:
        t.answer = text.strip() if stopped and reply is None else None
        t.done = True
        return
    t.ids += encode(tokenizer, environment_segment(tokenizer, t.messages, reply))
    t.messages += reply


def summarize(trajectories: list[Trajectory]) -> dict:
    def accuracy(ts):
        return round(sum(t.answer == str(t.problem.answer) for t in ts) / max(1, len(ts)), 4)

    with_tool = [t for t in trajectories if t.calls]
    without = [t for t in trajectories if not t.calls]
    calls = sum(t.calls for t in trajectories)
    return {
        "trajectories": len(trajectories),
        "accuracy": accuracy(trajectories),
        "tool_call_rate": round(len(with_tool) / len(trajectories), 4),
        "accuracy_with_tool": accuracy(with_tool),
        "accuracy_without_tool": accuracy(without),
        "failed_calls": sum(t.failed_calls for t in trajectories),
        "calls": calls,
    }


# ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("examples/tools_demo"))
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--p-tool", type=float, default=0.2, help="share of calculator rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--eval-samples", type=int, default=4, help="T=1 samples per prompt")
    add_model_args(parser)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args, max_positions=512)  # a 3-turn trajectory is ~100 tokens
    eval_set, train_set, pretrain_set = split_problems(all_problems())
    print(f"problems: eval {len(eval_set)}, train {len(train_set)}, pretrain {len(pretrain_set)}")
    print(
        f"vocabulary {len(tokenizer)}, parameters: {sum(p.numel() for p in model.parameters()):,}"
    )

    start = time.perf_counter()
    pretrain(model, tokenizer, pretrain_set, args)
    print(f"pre-training: {time.perf_counter() - start:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    # the role tags in `all_special_tokens` (the key transformers 4 and 5 both read); the
    # chat template goes to chat_template.jinja
    save_model(model, tokenizer, args.out / "model", {"additional_special_tokens": SPECIALS[3:]})
    write_jsonl(args.out / "train.jsonl", train_set)
    write_jsonl(args.out / "eval.jsonl", eval_set)

    start = time.perf_counter()
    greedy = evaluate(model, tokenizer, eval_set, temperature=0.0, seed=args.seed)
    sampled = evaluate(
        model, tokenizer, eval_set, temperature=1.0, seed=args.seed, samples=args.eval_samples
    )
    print(f"evaluation: {time.perf_counter() - start:.0f} s")
    print(json.dumps({"eval_greedy": greedy, "eval_sampled_t1": sampled}))


if __name__ == "__main__":
    main()
