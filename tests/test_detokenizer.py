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


def _first_stop_by_find(text: str, before: int, stops: list[str]) -> tuple[int, str] | None:
    """The stop check as one ``str.find`` per stop string over the text that ends past ``before``
    (vLLM's window), the leftmost match winning (the rule StopStrings must keep)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, before - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


@settings(max_examples=300, deadline=None)
@given(picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=40),
       spans=st.lists(st.tuples(st.integers(0, len(TEXT)), st.integers(1, 12)), min_size=1, max_size=6),
       checks=st.lists(st.booleans(), min_size=1, max_size=40), include=st.booleans())
def test_stop_strings_match_what_a_find_per_stop_string_matches(tokenizer, picks, spans, checks, include):
    """The stop strings grouped by length find the stop string a ``find`` per stop string finds
    (the leftmost occurrence that ends in the new text; at equal starts the one listed first), the
    same token, the same cut, with checks skipped for some tokens (min_tokens: a stop string
    completed then never ends the output later) and stop strings inside one another."""
    ids = _stream(tokenizer, picks, len(tokenizer))
    stops = [TEXT[a:a + n] for a, n in spans if TEXT[a:a + n]] or ["x"]
    prompt = tokenizer.encode("x = 1\n")
    plain = Detokenizer(tokenizer, prompt)
    got = Detokenizer(tokenizer, prompt, stop=stops, include_stop=include)
    for j, t in enumerate(ids):
        check = checks[j % len(checks)]
        before = len(plain.text)
        plain.add(t)
        want = _first_stop_by_find(plain.text, before, stops) if check and len(plain.text) > before else None
        assert got.add(t, check_stop=check) == (want[1] if want else None)
        if want:
            i, s = want
            assert got.text == plain.text[:i + len(s) if include else i]
            return
        assert got.text == plain.text


def test_a_stop_string_completed_under_min_tokens_never_ends_the_output_later(tokenizer):
    """Checks resume past min_tokens with the new text only (vLLM's rule): a stop string the
    output completed before then is not found afterwards (the old window, the longest stop
    string's length back, found it and cut the output inside its first min_tokens tokens)."""
    ids = tokenizer.encode("ab cd ef gh", add_special_tokens=False)
    d = Detokenizer(tokenizer, tokenizer.encode("x = 1\n"), stop=["ab", "a much longer stop string"])
    matched = [d.add(t, check_stop=j >= len(ids) - 1) for j, t in enumerate(ids)]
    assert matched == [None] * len(ids) and d.text.endswith("ab cd ef gh")


def test_many_and_long_stop_strings(tokenizer):
    """100k stop strings and one of 100k characters: the one that ends the text stops it."""
    stops = [f"zq{i}xv" for i in range(100_000)] + ["b" + "a" * 100_000, "return"]
    d = Detokenizer(tokenizer, tokenizer.encode("x = 1\n"), stop=stops)
    ids = tokenizer.encode("def f(x):\n    y = x + 1\n    return y\n", add_special_tokens=False)
    for t in ids:
        if (matched := d.add(t)) is not None:
            break
    assert matched == "return" and d.text == "def f(x):\n    y = x + 1\n    "
