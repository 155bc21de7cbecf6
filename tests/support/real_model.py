"""Helpers for tests on the real SmolLM2-135M-Instruct: chat samples of three groups, plain
transformers log-probs one sequence at a time (the reference), attention switching, and a
bitsandbytes-free copy of a quantized model (its dequantized weights in plain linears)."""

from __future__ import annotations

import copy
from contextlib import contextmanager

from torch import nn

from leangrpo.contracts import Completion, Prompt, RolloutSample
from leangrpo.ops.attention.adapter import enable_packed_attention

IM_END = "<|im_end|>"
QUESTIONS = [  # (question, [answers]): one group per question, answers of different lengths
    ("What is 12 + 7?", ["19", "12 + 7 = 19.", "The answer is 20"]),
    ("Name a colour of the sky on a clear day, in one word.", ["Blue", "blue."]),
    ("Reply with the word yes.", ["yes"]),
]


@contextmanager
def attention(model, name: str):
    """Run with plain transformers attention ("sdpa") or leangrpo's packed adapter."""
    if name == "sdpa":
        model.set_attn_implementation("sdpa")
    else:
        enable_packed_attention(model, name)
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")


def chat_ids(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )


def real_samples(tokenizer) -> list[RolloutSample]:
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    samples = []
    for gid, (question, answers) in enumerate(QUESTIONS):
        prompt = Prompt(gid, question, chat_ids(tokenizer, question))
        for answer in answers:
            ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
            comp = Completion(ids, answer, [0.0] * len(ids), "stop", 0)
            samples.append(RolloutSample(gid, prompt, comp, advantage=1.0))
    return samples


def dequantized(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with every bitsandbytes linear replaced by an `nn.Linear`
    holding its dequantized weight (bitsandbytes computes exactly that, then `F.linear`),
    so that `.double()` of it is the exact fp64 reference of the quantized model."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    clone = copy.deepcopy(model)
    for module in list(clone.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                weight = bf.dequantize_4bit(child.weight.data, child.weight.quant_state)
            elif isinstance(child, bnb.nn.Linear8bitLt):  # row scales: the state's after a forward
                scales = child.weight.SCB if child.weight.SCB is not None else child.state.SCB
                weight = child.weight.data.float() * scales.float()[:, None] / 127
            else:
                continue
            plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
            plain.weight = nn.Parameter(weight.float().contiguous(), requires_grad=False)
            if child.bias is not None:
                plain.bias = nn.Parameter(child.bias.detach().float().clone(), requires_grad=False)
            setattr(module, name, plain)
    return clone
