"""The bundled tool-use demo: model, tokenizer and chat template load; the template lists the
tools and renders turn by turn; the tool-call format survives the tokenizer; the data is
right and held out; the model calls the calculator sometimes and cannot add alone."""

from __future__ import annotations

import json
import random

import pytest
import torch
from support.configs import ROOT
from support.files import assert_files_are_the_held_out_split, read_jsonl
from support.scripts import load_script

DEMO = ROOT / "examples" / "tools_demo"
TOOLS = [{"type": "function", "function": {"name": "add"}}]


@pytest.fixture(scope="module")
def build():
    return load_script("build_tool_demo")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO / "model")


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO / "model", dtype=torch.float32).eval()


def render(tokenizer, messages, generation_prompt, tools=TOOLS) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def test_tokenizer_is_character_level_with_single_token_tags(tokenizer, model):
    text = 'Error: {"a": 1}, [x_y] ~ 100%!\n'
    ids = encode(tokenizer, text)
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
    for tag in [
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|tool|>",
        "<tool_call>",
        "</tool_call>",
    ]:
        assert len(encode(tokenizer, tag)) == 1, tag
    assert tokenizer.eos_token == "<|end|>" and tokenizer.pad_token == "<pad>"
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert {"<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"} <= set(
        tokenizer.all_special_tokens
    )
    assert len(tokenizer) == model.config.vocab_size
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.config.max_position_embeddings >= 256
    config = json.loads((DEMO / "model" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # vLLM and transformers 4


def test_tool_call_format_round_trips_and_keeps_its_tags_without_specials(tokenizer, build):
    call = build.tool_call_text(build.Problem(123, 456))
    assert call == '<tool_call>{"name": "add", "arguments": {"a": 123, "b": 456}}</tool_call>'
    ids = encode(tokenizer, "<|assistant|>" + call + "<|end|>")
    assert len(ids) == len(call) - len("<tool_call></tool_call>") + 4
    # an engine decodes with skip_special_tokens=True: the role tags and EOS go, the tags stay
    assert tokenizer.decode(ids, skip_special_tokens=True) == call
    assert tokenizer.decode(ids) == "<|assistant|>" + call + "<|end|>"
    assert build.run_tool_calls(call) == [{"role": "tool", "name": "add", "content": "579"}]
    assert build.run_tool_calls("579") is None
    assert build.run_tool_calls('<tool_call>{"name": "add", "argu')[0]["content"].startswith(
        "error:"
    )


def test_committed_tokenizer_and_template_are_the_scripts(tokenizer, build):
    built = build.build_tokenizer()
    assert built.get_vocab() == tokenizer.get_vocab()
    assert (DEMO / "model" / "chat_template.jinja").read_text() == build.CHAT_TEMPLATE
    assert tokenizer.chat_template == build.CHAT_TEMPLATE


def test_template_lists_the_tools_given(tokenizer, build):
    user = [{"role": "user", "content": "123+456="}]
    assert (
        render(tokenizer, user, True)
        == "<|system|>tools: add<|end|><|user|>123+456=<|end|><|assistant|>"
    )
    assert render(tokenizer, user, True, tools=None) == "<|user|>123+456=<|end|><|assistant|>"
    # schemas from type hints and docstrings, or the functions themselves
    assert render(tokenizer, user, True, tools=build.tool_schemas()) == render(
        tokenizer, user, True
    )
    assert render(tokenizer, user, True, tools=[build.TOOLS["add"]]) == render(tokenizer, user, True)
    system = [{"role": "system", "content": "Be exact."}, *user]
    two = [*TOOLS, {"type": "function", "function": {"name": "mul"}}]
    assert render(tokenizer, system, False, tools=two).startswith(
        "<|system|>Be exact.\ntools: add, mul<|end|><|user|>"
    )


def test_template_renders_tool_turns_and_structured_calls_as_raw_text(tokenizer, build):
    problem = build.Problem(123, 456)
    conversation = build.tool_conversation(problem)
    assert render(tokenizer, conversation, False) == (
        "<|system|>tools: add<|end|><|user|>123+456=<|end|><|assistant|>"
        '<tool_call>{"name": "add", "arguments": {"a": 123, "b": 456}}</tool_call><|end|>'
        "<|tool|>579<|end|><|assistant|>579<|end|>"
    )
    structured = [dict(m) for m in conversation]
    structured[1] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 123, "b": 456}}}
        ],
    }
    assert render(tokenizer, structured, False) == render(tokenizer, conversation, False)
    structured[1]["tool_calls"][0]["function"]["arguments"] = '{"a": 123, "b": 456}'  # OpenAI style
    assert render(tokenizer, structured, False) == render(tokenizer, conversation, False)
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="unknown role"):
        render(tokenizer, [{"role": "robot", "content": "x"}], False)


def conversations(build) -> list[list[dict]]:
    """The demo's two kinds, plus a system message, two calls in one turn, an error reply
    and a user follow-up (every kind of turn an environment may append)."""
    problem = build.Problem(859, 467)
    calls = build.tool_call_text(problem) + build.tool_call_text(build.Problem(100, 200))
    return [
        build.tool_conversation(problem),
        build.direct_conversation(problem, random.Random(0)),
        [
            {"role": "system", "content": "Be exact."},
            {"role": "user", "content": "859+467= and 100+200="},
            {"role": "assistant", "content": calls},
            {"role": "tool", "name": "add", "content": "1326"},
            {"role": "tool", "name": "add", "content": "300"},
            {"role": "assistant", "content": '<tool_call>{"name": "add", "argu'},
            {"role": "tool", "content": "error: unclosed <tool_call> block"},
            {"role": "assistant", "content": "1326 and 300"},
            {"role": "user", "content": "thanks; 1+1="},
            {"role": "assistant", "content": "2"},
        ],
    ]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_template_renders_turn_by_turn_as_a_prefix_token_for_token(tokenizer, build, index):
    """Prompt, then per assistant turn: its tokens and EOS (what an engine generates), then
    the environment's reply and the next generation prompt rendered as the difference of two
    renderings. The concatenation is the tokenisation of the whole conversation."""
    messages = conversations(build)[index]
    eos_id = tokenizer.eos_token_id
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    opened = render(tokenizer, messages[: turns[0]], True)
    ids = encode(tokenizer, opened)
    for k, i in enumerate(turns):
        ids += encode(tokenizer, messages[i]["content"]) + [eos_id]
        closed = render(tokenizer, messages[: i + 1], False)
        assert closed == opened + messages[i]["content"] + "<|end|>"  # nothing after the EOS
        if k + 1 < len(turns):
            opened = render(tokenizer, messages[: turns[k + 1]], True)
            assert opened.startswith(closed)
            ids += encode(tokenizer, opened[len(closed) :])
    assert ids == encode(tokenizer, render(tokenizer, messages, False))
    assert build.encode_conversation(tokenizer, messages)[0] == ids


def test_pretraining_rows_train_on_assistant_tokens_only(tokenizer, build):
    ids, trained = build.encode_conversation(tokenizer, conversations(build)[0])
    trained_text = tokenizer.decode([t for t, m in zip(ids, trained) if m])
    context_text = tokenizer.decode([t for t, m in zip(ids, trained) if not m])
    call = build.tool_call_text(build.Problem(859, 467))
    assert trained_text == call + "<|end|>1326<|end|>"
    assert context_text == (
        "<|system|>tools: add<|end|><|user|>859+467=<|end|><|assistant|><|tool|>1326<|end|>"
        "<|assistant|>"
    )


def test_weights_are_small():
    assert (DEMO / "model" / "model.safetensors").stat().st_size < 8 * 2**20


@pytest.fixture(scope="module")
def split(build):
    return build.split_problems(build.all_problems())


def test_data_columns_answers_and_held_out_split(build, split):
    train, evals = read_jsonl(DEMO / "train.jsonl"), read_jsonl(DEMO / "eval.jsonl")
    assert len(train) == build.NUM_TRAIN and len(evals) == build.NUM_EVAL
    for row in train + evals:
        assert set(row) == {"prompt", "answer"} and row["prompt"].endswith("=")
        a, b = row["prompt"][:-1].split("+")
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999
        assert row["answer"] == str(int(a) + int(b))
    assert_files_are_the_held_out_split(split, train, evals)


def test_noisy_answers_are_plausible(build):
    rng = random.Random(0)
    problems = [build.Problem(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(4000)]
    draws = [(p, build.noisy_answer(p, rng)) for p in problems]
    correct = sum(a == p.answer for p, a in draws) / len(draws)
    assert 0.35 < correct < 0.5
    assert all(
        a == p.answer or a == p.dropped_carry or 0 < abs(a - p.answer) <= build.MAX_MISS
        for p, a in draws
    )
    assert build.Problem(859, 467).dropped_carry == 216


def test_baseline_calls_the_tool_sometimes_and_cannot_add_alone(model, tokenizer, build, split):
    """What GRPO starts from: greedy never calls and is nearly always wrong; sampled at T=1
    about one trajectory in five calls the calculator, and those are nearly always right."""
    eval_set = split[0]
    torch.manual_seed(0)
    greedy = build.evaluate(model, tokenizer, eval_set, temperature=0.0, seed=0)
    assert greedy["tool_call_rate"] == 0.0 and greedy["accuracy"] <= 0.1
    sampled = build.evaluate(model, tokenizer, eval_set, temperature=1.0, seed=0, samples=4)
    assert 0.1 <= sampled["tool_call_rate"] <= 0.35
    assert sampled["accuracy_with_tool"] >= 0.9
    assert sampled["accuracy_without_tool"] <= 0.1
