"""Incremental detokenization with stop strings.

Decoding only the new tokens is wrong for byte-level and sentencepiece tokenizers (a
leading space, a multi-byte character split over tokens), so, as vLLM does, each step
decodes a short window ``ids[prefix_offset:]`` and emits the text beyond the window's
earlier decode ``ids[prefix_offset:read_offset]``; a trailing U+FFFD (an unfinished UTF-8
sequence) waits for the next token. The window starts with a few prompt tokens so that the
first generated token gets its leading space.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_PROMPT_TAIL = 5


@dataclass
class Detokenizer:
    tokenizer: object
    prompt_ids: list[int]
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False
    text: str = ""
    _ids: list[int] = field(default_factory=list)
    _prefix: int = 0
    _read: int = 0

    def __post_init__(self) -> None:
        self._ids = list(self.prompt_ids[-_PROMPT_TAIL:])
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # type: ignore[attr-defined]

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; returns the stop string that matched (text is then truncated)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        before = len(self.text)
        self.text += new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        if not (check_stop and self.stop):
            return None
        longest = max(len(s) for s in self.stop)
        start = max(0, before - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s) if self.include_stop else i]
        return s
