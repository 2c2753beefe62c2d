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
