"""The tokenizer's record (model/tokenizer.py): written by the set-up from the real
tokenizer, read before the model loads without transformers; it renders, encodes and
decodes exactly as the real one, or it is not there (a changed file, a damaged record, a
tokenizer it cannot reproduce)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from support.configs import DEMO_MODEL, ROOT
from transformers import AutoTokenizer

from leangrpo.data.templates import load_template
from leangrpo.environments.rendering import Renderer, check_template, control_tokens
from leangrpo.model.smollm2 import missing_reason
from leangrpo.model.tokenizer import TOKENIZER_FILES, recall, records_dir, remember

TOOLS_MODEL = ROOT / "examples" / "tools_demo" / "model"
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "description": "A."}}, "required": ["a"]}}}]  # fmt: skip
CHATS = [
    [{"role": "user", "content": "859+467= cafe\u0301"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12 + 30?"},
     {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'},
     {"role": "tool", "name": "add", "content": "42"}],
]  # fmt: skip


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2's directory, found (or converted) in the real cache, before `cache` moves it."""
    if missing_reason() is not None:
        pytest.skip(missing_reason())
    from leangrpo.model.smollm2 import smollm2_dir

    return smollm2_dir()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANGRPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def copied(model_dir, tmp_path):
    """The model's tokenizer files in a directory of their own (their times can change)."""
    out = tmp_path / "model"
    out.mkdir()
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
    return out


def assert_alike(record, real, template=None):
    for chat in CHATS:
        for tools in (None, TOOLS):
            for generation_prompt in (False, True):
                kwargs = dict(tools=tools, add_generation_prompt=generation_prompt, tokenize=False, chat_template=template)
                text = real.apply_chat_template(chat, **kwargs)
                assert record.apply_chat_template(chat, **kwargs) == text
                ids = real(text, add_special_tokens=False)["input_ids"]
                assert record(text, add_special_tokens=False)["input_ids"] == ids
                assert record([text, "x"], add_special_tokens=False)["input_ids"] == [ids, real("x", add_special_tokens=False)["input_ids"]]  # fmt: skip
                assert record.decode(ids) == real.decode(ids, skip_special_tokens=False)
    assert control_tokens(record, template) == control_tokens(real, template)
    assert record.eos_token_id == real.eos_token_id


def test_the_tools_demo_tokenizer_is_recorded_and_recalled_exactly(cache, tmp_path):
    """Its tokenizer.json read by `tokenizers` alone encodes otherwise (transformers loads it
    as a Qwen2 tokenizer, with an NFC normaliser): the record holds the backend as
    transformers built it."""
    directory = copied(TOOLS_MODEL, tmp_path)
    real = AutoTokenizer.from_pretrained(directory)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    text = "cafe\u0301 395+136="
    assert raw.encode(text).ids != real(text, add_special_tokens=False)["input_ids"]
    assert recall(directory) is None
    assert remember(directory, real) and remember(directory, real)  # the second finds it
    record = recall(directory)
    assert_alike(record, real)
    assert_alike(record, real, load_template("chatml-hermes"))
    check_template(Renderer(record, TOOLS), ["tool"], record.eos_token_id)


def test_smollm2_with_its_template_and_chatml_hermes(smollm2, cache, tmp_path):
    directory = copied(smollm2, tmp_path)
    real = AutoTokenizer.from_pretrained(directory)
    assert remember(directory, real)
    record = recall(directory)
    assert_alike(record, real)
    assert_alike(record, real, load_template("chatml-hermes"))


def test_a_changed_tokenizer_file_or_a_damaged_record_is_a_miss(cache, tmp_path):
    directory = copied(TOOLS_MODEL, tmp_path)
    real = AutoTokenizer.from_pretrained(directory)
    assert remember(directory, real) and recall(directory) is not None
    config = directory / "tokenizer_config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    assert recall(directory) is None  # another key: the old record is not used
    assert remember(directory, real) and recall(directory) is not None
    for meta in records_dir().glob("*.tokenizer.json"):
        meta.write_text("{not json")
    assert recall(directory) is None


class Rewrites:
    """A tokenizer whose template output the record cannot reproduce."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __call__(self, *args, **kwargs):
        return self.real(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        return self.real.apply_chat_template(*args, **kwargs) + "!"


def test_a_tokenizer_the_record_cannot_reproduce_is_not_recorded(cache, tmp_path):
    directory = copied(TOOLS_MODEL, tmp_path)
    assert not remember(directory, Rewrites(AutoTokenizer.from_pretrained(directory)))
    assert recall(directory) is None and not list(records_dir().glob("*"))


class AddsAnotherBos(Rewrites):
    """Renders as the record does, but adds its own special token to plain text (raw
    prompts are encoded with add_special_tokens=True)."""

    apply_chat_template = None  # no template: only plain text can be probed

    def __call__(self, text, add_special_tokens=False, **kwargs):
        encoded = self.real(text, add_special_tokens=add_special_tokens, **kwargs)
        if add_special_tokens:
            ids = encoded["input_ids"]
            encoded = {"input_ids": [[0, *x] for x in ids] if ids and isinstance(ids[0], list) else [0, *ids]}
        return encoded


def test_plain_text_with_special_tokens_is_probed_too(cache, tmp_path):
    """The demo's raw prompts are encoded with the special tokens the tokenizer adds; a
    record that would count them otherwise is not written (the demo's own tokenizer, which
    has no chat template, is recorded and recalled exactly)."""
    demo = copied(DEMO_MODEL, tmp_path)
    real = AutoTokenizer.from_pretrained(demo)
    real.chat_template = None
    fake = AddsAnotherBos(real)
    fake.chat_template = None
    assert not remember(demo, fake) and recall(demo) is None
    assert remember(demo, real)
    record = recall(demo)
    for text in ("37+45=", "1+1= ", "ünïcödé"):
        for special in (False, True):
            assert record(text, add_special_tokens=special) == {"input_ids": real(text, add_special_tokens=special)["input_ids"]}


def test_recalling_imports_neither_transformers_nor_torch(tmp_path, cache):
    directory = copied(TOOLS_MODEL, tmp_path)
    assert remember(directory, AutoTokenizer.from_pretrained(directory))
    code = (
        "import sys\nfrom leangrpo.model.tokenizer import recall\n"
        f"t = recall(__import__('pathlib').Path({str(directory)!r}))\n"
        "print(t.apply_chat_template([{'role': 'user', 'content': '1+2='}], add_generation_prompt=True))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "LEANGRPO_CACHE": str(cache)})  # fmt: skip
    assert out.stdout.splitlines() == ["<|user|>1+2=<|end|><|assistant|>", "[]"]
