"""Sessions' stop-string cut (sessions._cut): the first stop's turn, found with few decodes."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from support.configs import ROOT
from transformers import AutoTokenizer

from leangrpo.agents.sessions import _cut
from leangrpo.contracts import Completion

N = 1024


class Counting:
    """The tokenizer, its decode calls counted."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def decode(self, ids, **kw):
        self.calls += 1
        return self.tokenizer.decode(ids, **kw)


def naive(ids, stops, decode):
    """The cut by every prefix in turn (the reference)."""
    for i in range(len(ids)):
        text = decode(ids[: i + 1], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return ids[: i + 1], "stop", text[: min(hits)]
    return ids, "length", None


@pytest.mark.parametrize("where", [None, 0, 300, N - 1])
def test_the_stop_cut_is_the_first_stops_prefix_in_log_n_decodes(where):
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "examples" / "tools_demo" / "model")
    rng = random.Random(0)
    ids = [rng.randrange(100, min(len(tokenizer), 30000)) for _ in range(N)]
    if where is None:
        stops = ("\x00never",)
    else:  # a stop that first ends inside token `where`
        text = tokenizer.decode(ids[: where + 1], skip_special_tokens=True)
        stops = ("\x00never", text[-3:])
    counting = Counting(tokenizer)
    got_ids, logprobs, finish, shown = _cut(Completion(ids, "", [0.5] * N, "length", 0), stops,
                                            SimpleNamespace(tokenizer=counting))  # fmt: skip
    assert (got_ids, finish, shown) == naive(ids, stops, tokenizer.decode)
    assert logprobs == [0.5] * len(got_ids)
    assert counting.calls <= 2 * N.bit_length()  # bisection, not one decode per prefix
