"""Incremental detokenization (leapfrog/detokenizer.py): the text of tokens added several at once
(Detokenizer.add_many, the engine's path without stop strings) is the text of adding them one
by one, whatever the chunks, multi-byte characters split over tokens included (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from leapfrog.detokenizer import Detokenizer

TEXT = "def f(x):\n    return x  # héllo wörld, 你好 — ünïcode 🙂 done\n"


def _stream(tokenizer, picks: list[int], size: int) -> list[int]:
    """Token ids: pieces of real text (so multi-byte characters split over tokens) mixed with any id
    of the vocabulary (special tokens included)."""
    text_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return [text_ids[p % len(text_ids)] if p % 3 else p % size for p in picks]


@settings(max_examples=200, deadline=None)
@given(picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=40),
       cuts=st.lists(st.integers(1, 6), min_size=1, max_size=40), skip=st.booleans())
def test_adding_tokens_at_once_gives_the_text_of_one_by_one(tokenizer, picks, cuts, skip):
    ids = _stream(tokenizer, picks, len(tokenizer))
    prompt = tokenizer.encode("x = 1\n")
    one = Detokenizer(tokenizer, prompt, skip_special_tokens=skip)
    for t in ids:
        one.add(t)
    many = Detokenizer(tokenizer, prompt, skip_special_tokens=skip)
    i, c = 0, 0
    while i < len(ids):
        n = cuts[c % len(cuts)]
        many.add_many(ids[i:i + n])
        i, c = i + n, c + 1
    assert many.text == one.text
    assert "\ufffd" not in one.text or "\ufffd" in tokenizer.decode(ids, skip_special_tokens=skip)


class _Counting:
    """The tokenizer, counting its decode calls."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def decode(self, ids, **kw):
        self.calls += 1
        return self.tokenizer.decode(ids, **kw)


def test_queued_tokens_are_decoded_only_when_the_text_is_read(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = tokenizer.encode("x = 1\n")
    counting = _Counting(tokenizer)
    lazy = Detokenizer(counting, prompt)
    for i in range(0, len(ids), 3):
        lazy.add_many(ids[i:i + 3])
    assert counting.calls == 0          # nothing decoded per step
    one = Detokenizer(tokenizer, prompt)
    for t in ids:
        one.add(t)
    assert lazy.text == one.text
    calls = counting.calls
    assert lazy.text == one.text and counting.calls == calls   # decoded once, not again
    # a single add (the stop-string path) after queued tokens keeps the order
    mixed = Detokenizer(tokenizer, prompt)
    mixed.add_many(ids[:5])
    for t in ids[5:]:
        mixed.add(t)
    assert mixed.text == one.text
