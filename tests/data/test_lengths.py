"""lengths.py: a prompt too long by its text alone is refused (or dropped) untokenised, and
the bound it uses never refuses a prompt that fits: checked against the tokenizers
themselves on random text."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.configs import DEMO_MODEL, ROOT
from support.files import write_jsonl

from leangrpo.config.run import DataConfig
from leangrpo.data.files import DataError
from leangrpo.data.lengths import check_prompt_text, text_bound
from leangrpo.data.prompts import PromptLimit, load_prompts
from leangrpo.model.smollm2 import find_converted

TOOLS_MODEL = ROOT / "examples" / "tools_demo" / "model"
TOKENIZERS = {"demo": DEMO_MODEL, "tools demo": TOOLS_MODEL, "smollm2": find_converted()}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def real(request):
    directory = TOKENIZERS[request.param]
    if directory is None:
        pytest.skip("SmolLM2 is not converted here (make setup)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory), text_bound(directory)


# text that tokenisers find hard: long runs, multi-byte and control characters, specials
PIECES = st.one_of(
    st.characters(codec="utf-8"),
    st.sampled_from(["1", "+", "=", " ", "\n", "<|end|>", "<pad>", "\x04", "é", "한", "  " * 8]),
)
TEXT = st.lists(PIECES, max_size=200).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_no_text_tokenises_to_fewer_tokens_than_its_bound_says(real, text):
    tokenizer, bound = real
    assert bound is not None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) * bound.per_token >= bound.measure(text), (text, ids)


def tokenizer_json(tmp_path: Path, **parts) -> Path:
    """A tokenizer.json built with the tokenizers library, from its parts."""
    from tokenizers import Tokenizer

    tok = Tokenizer(parts.pop("model"))
    for name, part in parts.items():
        setattr(tok, name, part)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_only_byte_level_vocabularies_that_keep_their_text_have_a_bound(tmp_path):
    from tokenizers import models, normalizers, pre_tokenizers

    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3}
    byte_level = pre_tokenizers.ByteLevel()
    bpe = models.BPE(vocab, [("a", "b")])
    bound = text_bound(tokenizer_json(tmp_path, model=bpe, pre_tokenizer=byte_level))
    assert bound.per_token == 5 * 3  # "<unk>", times the fold of an NFC a rebuild may add
    assert len(bound.dropped) == 254 and bound.measure("abab\x04é") == 4  # dropped bytes
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|a_long_end_token|>"}')
    assert text_bound(tmp_path).per_token == 20 * 3  # a special token a rebuild adds
    for normalizer in (normalizers.Strip(), normalizers.StripAccents(), normalizers.Replace("ab", "")):
        built = tokenizer_json(tmp_path, model=bpe, pre_tokenizer=byte_level, normalizer=normalizer)
        assert text_bound(built) is None, normalizer
    removes = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), byte_level])
    assert text_bound(tokenizer_json(tmp_path, model=bpe, pre_tokenizer=removes)) is None
    for model in (models.BPE(vocab, [("a", "b")], unk_token="<unk>"), models.WordPiece(vocab, unk_token="<unk>")):
        assert text_bound(tokenizer_json(tmp_path, model=model)) is None  # not byte-level
    assert text_bound(tmp_path / "nowhere") is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert text_bound(tmp_path) is None


def test_a_compatibility_normalizer_widens_the_bound(tmp_path):
    """NFKC maps a 4-byte mathematical letter to its 1-byte letter: a byte-level tokenizer
    with NFKC and a token of 8 letters turns 4 x 8 bytes of such letters into one token,
    more than the 3 bytes per byte a composing normalizer (NFC) can fold."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from leangrpo.data.lengths import BYTE_CHARS

    vocab = {c: i for i, c in enumerate(sorted(set(BYTE_CHARS.values())))}
    merges = [("a" * k, "a" * k) for k in (1, 2, 4)]
    vocab.update({"a" * 2 * k: len(vocab) + i for i, k in enumerate((1, 2, 4))})
    for normalizer in (normalizers.NFKC(), normalizers.Sequence([normalizers.NFKD()])):
        built = tokenizer_json(
            tmp_path,
            model=models.BPE(vocab, merges),
            pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False),
            normalizer=normalizer,
        )
        text = "\U0001d41a" * 700  # '𝐚', 4 bytes each: 88 tokens of 'aaaaaaaa'
        bound = text_bound(built)
        assert len(Tokenizer.from_file(str(built / "tokenizer.json")).encode(text).ids) == 88
        assert 88 * bound.per_token >= bound.measure(text) == 2800


HUGE = "1+" * 50_000 + "1="  # 100,002 bytes; a demo token covers at most 5 (15 with NFC)


def huge_rows() -> list[dict]:
    return [{"prompt": "1+1=", "answer": "2"}, {"prompt": HUGE, "answer": "1"}]


def test_a_prompt_too_long_by_its_text_is_refused_before_the_tokenizer_loads(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", huge_rows())
    limit = PromptLimit(58, "the model's context of 64 positions minus rollout.max_new_tokens = 6")
    with pytest.raises(DataError) as err:
        check_prompt_text(DataConfig(path=path), limit, DEMO_MODEL)
    assert str(err.value) == (
        f"data.path = '{path}' row 1 (line 2) has 100002 bytes of text, more than the 58 "
        "tokens allowed by the model's context of 64 positions minus rollout.max_new_tokens "
        "= 6 can hold (a token of this tokenizer covers at most 15 bytes, so 870 at most); "
        "shorten it, or set data.overlong_prompts to drop, truncate_left or truncate_right"
    )
    drop = DataConfig(path=path, overlong_prompts="drop")
    assert check_prompt_text(drop, limit, DEMO_MODEL) == text_bound(DEMO_MODEL)


def test_the_tokenizer_file_is_read_only_when_a_prompt_could_be_too_long(tmp_path, monkeypatch):
    import leangrpo.data.lengths as lengths

    def unexpected(directory):
        raise AssertionError("tokenizer.json was read")

    monkeypatch.setattr(lengths, "text_bound", unexpected)
    path = write_jsonl(tmp_path / "d.jsonl", huge_rows()[:1])
    assert check_prompt_text(DataConfig(path=path), PromptLimit(4, "x"), DEMO_MODEL) is None


class CountingTokenizer:
    """The demo tokenizer, recording the longest text it was asked to tokenise."""

    def __init__(self):
        from transformers import AutoTokenizer

        self.inner = AutoTokenizer.from_pretrained(DEMO_MODEL)
        self.longest = 0

    def __call__(self, texts, **kwargs):
        self.longest = max([self.longest, *map(len, texts)])
        return self.inner(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_loading_drops_a_prompt_too_long_by_its_text_untokenised(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", huge_rows())
    limit = PromptLimit(58, "the context", text_bound(DEMO_MODEL))
    tokenizer = CountingTokenizer()
    with caplog.at_level(logging.WARNING, logger="leangrpo.data"):
        prompts = load_prompts(DataConfig(path=path, overlong_prompts="drop"), tokenizer, 0, limit)
    assert [p.uid for p in prompts.train] == [0] and prompts.metrics["data/dropped_prompts"] == 1
    assert tokenizer.longest == 4  # the huge one never reached the tokenizer
    assert "dropped 1 prompts of" in caplog.text and "by their text alone" in caplog.text
    with pytest.raises(DataError, match=r"row 1 has 100002 bytes of text, more than the 58"):
        load_prompts(DataConfig(path=path), tokenizer, 0, limit)
    truncated = load_prompts(DataConfig(path=path, overlong_prompts="truncate_right"), tokenizer, 0, limit)
    assert [len(p.ids) for p in truncated.train] == [4, 58]  # tokenised whole, then cut


def test_chat_messages_count_their_contents(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": HUGE}]}]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(DataError, match=r"row 0 \(line 1\) has 100002 bytes of text"):
        check_prompt_text(DataConfig(path=str(path), chat_template=True), PromptLimit(58, "x"), DEMO_MODEL)
