"""Structured outputs: a grammar (JSON schema, regex, choice, Lark/GBNF grammar) as a token mask,
built on llguidance (https://github.com/guidance-ai/llguidance: Earley parsing over the
tokenizer's token trie, with rollback).

Speculation: a row's mask is the grammar's allowed set after the request's committed output
plus the row's drafted tokens, so the draft's q and the target's p are masked alike at every
drafted position, and greedy or sampled verification then accepts only tokens the grammar
allows. The matcher advances only through committed tokens; a row's drafts are consumed to
read its mask and rolled back at once (``GrammarState.allowed``). A row after a draft token
the grammar refuses is unreachable (the target gives that token probability 0): it gets no
mask.

Failures: llguidance's limits (items per Earley row, lexer fuel) can stop a matcher in an error
state partway through an output (a JSON schema with thousands of properties does, after its
``{``). On the committed output that fails the request with a ``GrammarError`` (a RequestError:
the server's 400), never a silent "stop". A draft token that only *tries* such a path leaves the
matcher's error sticky, so the matcher is rebuilt from the committed tokens and the row is
treated as unreachable: the output stays the one without speculation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from leapfrog.errors import ConfigError, RequestError


class GrammarError(RequestError):
    """A structured-output constraint that failed while decoding (llguidance's complexity
    limits, say): the request's fault, reported as such. ``detail``: llguidance's own words."""

    def __init__(self, message: str, param: str | None = None, detail: str = "") -> None:
        super().__init__(message, param=param)
        self.detail = detail or message

KINDS = ("json", "regex", "choice", "grammar", "json_object")
#: the most strings a ``choice`` constraint may list, and their total length: the matcher is
#: built on the engine's thread, where 40,000 choices held every other request for seconds (and
#: llguidance refuses a choice list past about 2000 entries only once decoding has begun)
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1 << 16


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one constraint.

    json: a JSON schema (dict or its JSON text); regex: a regular expression the whole output
    matches; choice: the output is one of these strings; grammar: a Lark grammar (llguidance's
    dialect) or a GBNF one (``::=`` rules, llama.cpp's format); json_object: any JSON object.
    """
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ConfigError(f"structured outputs take exactly one of {list(KINDS)}; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ConfigError("structured outputs: json must be a JSON schema (an object, or its JSON text)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ConfigError("structured outputs: regex must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ConfigError("structured outputs: choice must be a non-empty list of non-empty strings")
        if self.choice is not None and (len(self.choice) > MAX_CHOICES
                                        or sum(map(len, self.choice)) > MAX_CHOICE_CHARS):
            raise ConfigError(f"structured outputs: choice lists {len(self.choice)} strings of "
                              f"{sum(map(len, self.choice))} characters in all; at most {MAX_CHOICES} strings "
                              f"and {MAX_CHOICE_CHARS} characters (use a regex or a grammar for larger sets)")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ConfigError("structured outputs: grammar must be a non-empty string")
        if not isinstance(self.json_object, bool):
            raise ConfigError("structured outputs: json_object must be true or false")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (its JSON wrapper format)."""
        import llguidance
        M = llguidance.LLMatcher
        # JSON without free whitespace between tokens (vLLM's disable_any_whitespace): free
        # whitespace lets a small model spend its whole budget on blanks, and the text never parses
        compact = {"whitespace_flexible": False}
        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return M.grammar_from_json_schema(schema, defaults=compact)
        if self.json_object:
            return M.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=compact)
        if self.regex is not None:
            return M.grammar_from_regex(self.regex)
        if self.choice is not None:   # Lark string literals take JSON's escapes
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        g = self.grammar or ""
        if "::=" in g:
            from llguidance.gbnf_to_lark import gbnf_to_lark
            g = gbnf_to_lark(g)
        return M.grammar_from_lark(g)


class GrammarCompiler:
    """Per engine: the tokenizer as llguidance sees it (built once), and matchers per request.
    Any thread may build matchers (llguidance releases the GIL while it compiles)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance.hf
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self.vocab_size = vocab_size   # the model's (may exceed the tokenizer's: padding ids, never allowed)

    def matcher(self, params: StructuredOutputsParams, field: str = "structured_outputs") -> "GrammarState":
        """A fresh matcher with its first mask computed (the lexer and the first Earley rows are
        built lazily: a large schema's cost lands here, on the caller's thread, not on the
        engine's first step); a constraint that does not compile is the request's fault."""
        try:
            grammar = params.llguidance_grammar()
        except Exception as e:  # noqa: BLE001 - llguidance raises ValueError and others on bad input
            raise RequestError(f"invalid {params.kind} constraint: {e}", param=field) from None
        state = GrammarState(self.ll_tokenizer, grammar, self.vocab_size, f"{params.kind} constraint", field)
        try:
            state.allowed()
        except GrammarError as e:
            raise RequestError(f"invalid {params.kind} constraint: {e.detail}", param=field) from None
        return state


class GrammarState:
    """One request's matcher, advanced through its committed output tokens."""

    def __init__(self, ll_tokenizer: Any, grammar: str, vocab_size: int, what: str = "constraint",
                 field: str = "structured_outputs") -> None:
        import llguidance.torch as lt
        self._tok, self._grammar, self._what, self._field = ll_tokenizer, grammar, what, field
        self.m = self._new_matcher()
        self.committed: list[int] = []   # the output tokens the matcher consumed
        self._bitmask = lt.allocate_token_bitmask(1, ll_tokenizer.vocab_size)   # [1, ceil(Vt / 32)] int32
        self._Vt, self._V = ll_tokenizer.vocab_size, vocab_size
        self._bits = torch.arange(32, dtype=torch.int32)

    def _new_matcher(self) -> Any:
        import llguidance
        try:
            m = llguidance.LLMatcher(self._tok, self._grammar, log_level=0)
        except Exception as e:  # noqa: BLE001 - llguidance raises ValueError and others on bad input
            raise GrammarError(f"invalid {self._what}: {e}", param=self._field) from None
        return m

    @property
    def num_consumed(self) -> int:
        return len(self.committed)

    def _check(self, at: int | None = None) -> None:
        """GrammarError if the matcher failed (at output token ``at``, 1-based: the next one)."""
        if self.m.is_error():
            detail = self.m.get_error().split("\n", 1)[0]
            if detail in ("NoExtension", "NoExtensionBias"):   # llguidance's stop reasons
                detail = f"no output can satisfy it ({detail})"
            at = self.num_consumed + 1 if at is None else at
            raise GrammarError(f"the {self._what} failed at output token {at}: {detail}",
                               param=self._field, detail=detail)

    def allowed(self, extra: Sequence[int] = ()) -> Tensor | None:
        """[V] bool: the tokens the grammar allows after the committed output plus ``extra``
        (drafted tokens, rolled back before returning); None when the grammar refuses one of
        ``extra`` (the row is unreachable) or has ended (nothing to mask: the request stops).
        GrammarError when the matcher fails on the committed output."""
        import llguidance.torch as lt
        self._check()
        n = self.m.try_consume_tokens(list(extra)) if extra else 0
        if self.m.is_error():   # the drafts led it past a limit: sticky, so start again
            self._rebuild()
            return None
        try:
            if n < len(extra) or self.m.is_stopped():
                return None
            lt.fill_next_token_bitmask(self.m, self._bitmask, 0)
        finally:
            if n:
                self.m.rollback(n)
        if not extra:
            self._check()   # a limit met while computing the committed output's mask
        elif self.m.is_error():
            self._rebuild()
            return None
        words = self._bitmask[0]                                               # [ceil(Vt / 32)]
        bits = ((words[:, None] >> self._bits) & 1).bool().flatten()[:self._Vt]  # [Vt]
        if self._V > self._Vt:
            bits = torch.cat([bits, bits.new_zeros(self._V - self._Vt)])
        return bits[:self._V]

    def _rebuild(self) -> None:
        """A fresh matcher through the committed tokens (llguidance's errors do not roll back)."""
        self.m = self._new_matcher()
        if self.committed and self.m.try_consume_tokens(list(self.committed)) != len(self.committed):
            self._check()
            raise RuntimeError(f"the rebuilt grammar refused its committed tokens: {self.m.get_error()}")

    def advance(self, token_id: int) -> None:
        """Commit one generated token (the sampler only draws allowed ones)."""
        if not self.m.consume_token(token_id):
            self._check()
            raise RuntimeError(f"the grammar refused committed token {token_id}: {self.m.get_error()}")
        self.committed.append(token_id)

    @property
    def finished(self) -> bool:
        """The grammar admits no further token (only the end of the output)."""
        self._check(at=self.num_consumed)
        return self.m.is_stopped()
