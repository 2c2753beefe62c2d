"""``speculative_config``: the vLLM dict, validated into a frozen dataclass."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from leapfrog.errors import ConfigError

METHODS = ("draft_model", "ngram")
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """"draft_model" (a smaller model of the same tokenizer) or "ngram" (prompt lookup)."""
    num_speculative_tokens: int
    """K: drafts per step (the adaptive controller's upper bound when adaptive is on)."""
    model: str | None = None
    """Draft checkpoint (directory or hub id) for method="draft_model"."""
    prompt_lookup_min: int = 2
    """Shortest suffix n-gram matched (ngram)."""
    prompt_lookup_max: int = 5
    """Longest suffix n-gram matched (ngram); longer matches are tried first."""
    draft_dtype: str | None = None
    """Draft model dtype (default: the target's)."""
    disable_by_batch_size: int | None = None
    """Speculation is off for steps whose batch has more running requests than this."""
    adaptive: bool = False
    """Choose K per step (0..num_speculative_tokens) to maximise goodput (spec/adaptive.py)."""
    adaptive_explore_interval: int = 16
    """Adaptive: every this many steps try a K next to the best one to refresh its cost."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted((k for k in d if k not in known), key=str)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {unknown}; known keys: {sorted(known)}")
        if "method" not in d:
            raise ConfigError(f"speculative_config needs 'method', one of {list(METHODS)}")
        if "num_speculative_tokens" not in d:
            raise ConfigError("speculative_config needs 'num_speculative_tokens'")
        return cls(**d)

    def __post_init__(self) -> None:
        from leapfrog.model.loader import DTYPES
        from leapfrog.spec_decode.proposers.base import PROPOSERS

        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        # Types and ranges first (a list as method would otherwise be an unhashable TypeError below).
        _check(self, "method", str, choices=sorted(set(METHODS) | set(PROPOSERS)))
        _check(self, "num_speculative_tokens", int, lo=1, hi=MAX_SPECULATIVE_TOKENS)
        _check(self, "model", str, optional=True)
        _check(self, "prompt_lookup_min", int, lo=1)
        _check(self, "prompt_lookup_max", int, lo=1)
        _check(self, "draft_dtype", str, optional=True, choices=["auto", *DTYPES])
        _check(self, "disable_by_batch_size", int, lo=1, optional=True)
        _check(self, "adaptive", bool)
        _check(self, "adaptive_explore_interval", int, lo=2)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} > "
                              f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError("speculative_config: method 'draft_model' needs 'model' (the draft checkpoint)")
        if self.method == "ngram" and self.model:
            raise ConfigError("speculative_config: method 'ngram' takes no 'model'")


_KINDS = {int: "an integer", str: "a string", bool: "true or false"}


def _check(cfg: SpeculativeConfig, name: str, kind: type, *, lo: int | None = None, hi: int | None = None,
           choices: list[str] | None = None, optional: bool = False) -> None:
    """``cfg.<name>`` is a ``kind`` (an int is never a bool) in [lo, hi] / ``choices``, else a
    ConfigError naming the field, the value and what it must be."""
    v = getattr(cfg, name)
    if optional and v is None:
        return
    typed = isinstance(v, kind) and (kind is bool or not isinstance(v, bool))
    if not typed or (lo is not None and v < lo) or (hi is not None and v > hi) or (choices and v not in choices):
        want = _KINDS[kind] + (f" >= {lo}" if lo is not None and hi is None else "")
        want += f" in [{lo}, {hi}]" if hi is not None else ""
        if choices is not None:
            want = f"one of {choices}" if typed else f"{want} (one of {choices})"
        raise ConfigError(f"speculative_config.{name}={v!r}: must be {want}"
                          + (" (or null)" if optional else ""))
