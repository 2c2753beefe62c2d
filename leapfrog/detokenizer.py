"""Incremental detokenization with stop strings.

Decoding only the new tokens is wrong for byte-level and sentencepiece tokenizers (a
leading space, a multi-byte character split over tokens), so, as vLLM does, each step
decodes a short window ``ids[prefix_offset:]`` and emits the text beyond the window's
earlier decode ``ids[prefix_offset:read_offset]``; a trailing U+FFFD (an unfinished UTF-8
sequence) waits for the next token. The window starts with a few prompt tokens so that the
first generated token gets its leading space.

Without stop strings nothing needs the text before someone reads it: ``add_many`` only queues
the tokens, and reading ``text`` decodes everything queued with one window decode (a request
whose outputs are read only when it finishes, as ``LLM.generate``'s, is decoded once, not once
per step; measured 40 us of a 1.3 ms one-token step of the built-in target).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

_PROMPT_TAIL = 5
_END = ""   # a trie node's key for "a stop string ends here" (never a character)


class StopStrings:
    """A request's stop strings in a trie of their reversed characters: the ones that end at a
    position of the text are found by walking back from it, one dict step a character, not by
    one ``str.find`` per stop string a token (100k stop strings took 38 ms a token that way, on
    the engine's thread, for every request of the batch). Building it takes about a second for
    100k: the server builds it off the engine's thread (``AsyncEngine.generate``)."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = list(stops)
        self.longest = max(map(len, self.stops), default=0)
        self._trie: dict = {}
        for k, s in enumerate(self.stops):
            node = self._trie
            for ch in reversed(s):
                node = node.setdefault(ch, {})
            node.setdefault(_END, k)   # (of equal stop strings, the first)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def first(self, text: str, start: int, ends_after: int) -> tuple[int, str] | None:
        """(i, s): of the occurrences in ``text`` that start at ``start`` or later and end after
        ``ends_after``, the leftmost; at equal starts the stop string listed first (what a
        ``text.find(s, start)`` per stop string in list order picks)."""
        best: tuple[int, int] | None = None
        for end in range(max(start, ends_after) + 1, len(text) + 1):
            node, i = self._trie, end
            while i > start:
                node = node.get(text[i - 1])
                if node is None:
                    break
                i -= 1
                k = node.get(_END)
                if k is not None and (best is None or (i, k) < best):
                    best = (i, k)
        return None if best is None else (best[0], self.stops[best[1]])


@dataclass
class Detokenizer:
    tokenizer: object
    prompt_ids: list[int]
    skip_special_tokens: bool = True
    stop: StopStrings | Sequence[str] = ()   # (a list is indexed here: StopStrings)
    include_stop: bool = False
    _text: str = ""
    _pending: list[int] = field(default_factory=list)   # queued by add_many, decoded when text is read
    _ids: list[int] = field(default_factory=list)
    _prefix: int = 0
    _read: int = 0
    _searched: int = 0   # len(_text) at the last stop check that found none (no match ends before)

    def __post_init__(self) -> None:
        self._ids = list(self.prompt_ids[-_PROMPT_TAIL:])
        self._read = len(self._ids)
        if not isinstance(self.stop, StopStrings):
            self.stop = StopStrings(self.stop)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # type: ignore[attr-defined]

    @property
    def text(self) -> str:
        """The text of every token added so far (the queued ones decoded now)."""
        if self._pending:
            self._flush()
        return self._text

    def add_many(self, token_ids: list[int]) -> None:
        """Append several tokens, decoded when ``text`` is next read (no stop strings are checked:
        for requests without any)."""
        self._pending += token_ids

    def _flush(self) -> None:
        """Decode the queued tokens with one window decode. The text is what adding them one by
        one gives: each window starts at the last emitted text's end, so a longer window emits the
        same text at once; only when it ends in an unfinished character are they added one by one
        (the ones before it have text now)."""
        token_ids, self._pending = self._pending, []
        n = len(self._ids)
        self._ids += token_ids
        if self._emit() or len(token_ids) == 1:
            return
        del self._ids[n:]
        for t in token_ids:
            self._ids.append(t)
            self._emit()

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; returns the stop string that matched (text is then truncated)."""
        if self._pending:
            self._flush()
        self._ids.append(token_id)
        before = len(self._text)
        if not self._emit() or not (check_stop and self.stop):
            return None
        # a match may start up to longest - 1 characters back; one ending at or before _searched
        # would have been found then (its start is at or after that check's start)
        best = self.stop.first(self._text, max(0, before - self.stop.longest + 1), self._searched)
        if best is None:
            self._searched = len(self._text)
            return None
        i, s = best
        self._text = self._text[: i + len(s) if self.include_stop else i]
        return s

    def _emit(self) -> bool:
        """Decode the window past the last emitted text; -> whether text was emitted (not when the
        window ends in an unfinished UTF-8 sequence, or adds nothing yet)."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False
        self._text += new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        return True
