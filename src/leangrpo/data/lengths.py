"""Prompt lengths bounded by their text, before anything is tokenised.

A prompt over the token limit (`prompts.PromptLimit`) is found by tokenising it, which
needs transformers and the tokenizer loaded and, for a 5 MB prompt, seconds of CPU. But
when no token covers more than k bytes of text, a text whose bytes all have tokens has at
least (its bytes) / k tokens: a prompt of more than `limit.tokens * k` such bytes is over
the limit for certain. preflight.py refuses it (data.overlong_prompts: error) among the
cheap checks; loading drops it untokenised (drop).

`text_bound(directory)` reads the vocabulary from the tokenizer.json in `directory` (json,
no transformers). It bounds byte-level BPE vocabularies only (GPT-2's byte spelling: Qwen,
Llama 3, SmolLM2, ...), where any tokenizer built on them is byte-level. transformers 5
rebuilds a tokenizer from its vocabulary with its class's own normalizer, pre-tokenizer
and unknown-token rules (Qwen2Tokenizer adds NFC and drops unknown bytes where
tokenizer.json said otherwise), so the bound assumes the worst of those:
- k = the longest vocabulary entry or special token, in bytes, times 3: a normalizer that
  keeps text (NFC) folds at most 3 code points into one (Hangul), 9 bytes into 3; times 4
  where tokenizer.json's normalizer holds NFKC or NFKD, whose compatibility mappings turn
  a 4-byte letter into a 1-byte one (U+1D41A '𝐚' into 'a');
- the bytes the vocabulary has no token for are not counted (a tokenizer may drop them:
  SmolLM2's lacks a few control characters and bytes UTF-8 never uses);
- a tokenizer.json whose normalizer or pre-tokenizer may delete text (Strip,
  StripAccents, the BERT and NMT cleaners, precompiled charsmaps, a replacement that
  shortens, whitespace splitting) gets no bound, as do other vocabularies (sentencepiece
  pieces, WordPiece): their prompts are measured in tokens only.
`tests/data/test_lengths.py` checks the bound against the tokenizers transformers builds,
on random text. truncate_left / truncate_right tokenise every prompt in full: a text cut
short need not tokenise to the same kept tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leangrpo.data.files import DataError, local_prompt_cells

FOLD = 3  # the most code points a normalizer that keeps text composes into one (NFC)
COMPATIBILITY_FOLD = 4  # NFKC, NFKD: a 4-byte mathematical letter becomes its 1-byte letter
KEEPS = {"NFC", "NFKC", "NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


@dataclass(frozen=True)
class TextBound:
    """No token covers more than `per_token` bytes of prompt text, counting only bytes
    outside `dropped` (those the vocabulary has no token for)."""

    per_token: int
    dropped: bytes = b""

    def measure(self, text: str) -> int:
        return len(text.encode("utf-8", "surrogatepass").translate(None, self.dropped))


def text_bound(directory: Path | None) -> TextBound | None:
    """The bound of the tokenizer in `directory`, or None (see the module docstring)."""
    file = None if directory is None else Path(directory) / "tokenizer.json"
    if file is None or not file.is_file():
        return None
    try:
        spec = json.loads(file.read_text(encoding="utf-8"))
        model = spec["model"]
        if model.get("type") != "BPE" or not _is_byte_level(spec.get("pre_tokenizer")):
            return None
        if not (_keeps(spec.get("normalizer")) and _keeps_text(spec.get("pre_tokenizer"))):
            return None
        vocab = model["vocab"]
        specials = [t["content"] for t in spec.get("added_tokens") or []]
        specials += _configured_tokens(Path(directory) / "tokenizer_config.json")
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None
    longest = max([*map(len, vocab), *(len(t.encode()) for t in specials), 0])
    dropped = bytes(b for b, char in BYTE_CHARS.items() if char not in vocab)
    fold = COMPATIBILITY_FOLD if _maps_compatibility(spec.get("normalizer")) else FOLD
    return TextBound(longest * fold, dropped) if longest else None


def _configured_tokens(file: Path) -> list[str]:
    """The special tokens tokenizer_config.json names (a rebuilt tokenizer adds them)."""
    if not file.is_file():
        return []
    config = json.loads(file.read_text(encoding="utf-8"))
    found = [config.get(key) for key in SPECIAL_KEYS]
    found += list(config.get("additional_special_tokens") or [])
    found += [t.get("content") for t in (config.get("added_tokens_decoder") or {}).values()]
    return [t if isinstance(t, str) else t.get("content", "") for t in found if t]


def _byte_chars() -> dict[int, str]:
    """Byte -> the character byte-level BPE spells it with (GPT-2's bytes_to_unicode)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


BYTE_CHARS = _byte_chars()


def _is_byte_level(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_is_byte_level(part) for part in pre_tokenizer["pretokenizers"])
    return pre_tokenizer.get("type") == "ByteLevel"


def _keeps(normalizer: dict | None) -> bool:
    """`normalizer` never deletes text (folding is FOLD's part)."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_keeps(part) for part in normalizer["normalizers"])
    if kind == "Replace":  # a literal replacement that never shortens is harmless
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content", "")
        literal = pattern.get("String")
        return bool(literal) and len(content.encode()) >= len(literal.encode())
    return kind in KEEPS


def _maps_compatibility(normalizer: dict | None) -> bool:
    """`normalizer` (a `_keeps` one) applies Unicode compatibility mappings (NFKC, NFKD)."""
    if normalizer is None:
        return False
    if normalizer.get("type") == "Sequence":
        return any(_maps_compatibility(part) for part in normalizer["normalizers"])
    return normalizer.get("type") in ("NFKC", "NFKD")


def _keeps_text(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(part) for part in pre_tokenizer["pretokenizers"])
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in PRE_TOKENIZERS


def check_prompt_text(data_cfg: Any, limit: Any, tokenizer_dir: Path | None) -> TextBound | None:
    """The tokenizer's `TextBound`, read only when a prompt of the local files holds more
    bytes than `limit.tokens` (no shorter one can be proven too long); None otherwise. With
    data.overlong_prompts: error, a prompt over `limit.tokens` tokens' worth is refused."""
    sources = [(key, path) for key in ("path", "eval_path") if (path := getattr(data_cfg, key))]
    long = [
        (f"data.{key} = '{path}' row {row}" + (f" (line {line})" if line else ""), text)
        for key, path in sources
        for row, line, value in local_prompt_cells(path, data_cfg)
        if len((text := prompt_text(value)).encode("utf-8", "surrogatepass")) > limit.tokens
    ]
    bound = text_bound(tokenizer_dir) if long else None
    if bound is None:
        return None
    if data_cfg.overlong_prompts == "error":
        for where, text in long:
            if bound.measure(text) > limit.tokens * bound.per_token:
                raise DataError(too_long(where, bound.measure(text), limit, bound))
    return bound


def prompt_text(value: Any) -> str:
    """A prompt cell's text: the text, or its chat messages' contents together (a chat
    template only adds to them)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(str(m.get("content", "")) for m in value if isinstance(m, dict))
    return ""


def too_long(where: str, size: int, limit: Any, bound: TextBound) -> str:
    """The sentence for a prompt of `size` units over `limit` (a PromptLimit)."""
    most = limit.tokens * bound.per_token
    return (
        f"{where} has {size} bytes of text, more than the {limit.tokens} tokens allowed by "
        f"{limit.reason} can hold (a token of this tokenizer covers at most "
        f"{bound.per_token} bytes, so {most} at most); shorten it, or set "
        "data.overlong_prompts to drop, truncate_left or truncate_right"
    )
