"""``speculative_config``: the vLLM dict, validated into a frozen dataclass."""

from __future__ import annotations

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
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {unknown}; known keys: {sorted(known)}")
        if "method" not in d:
            raise ConfigError(f"speculative_config needs 'method', one of {list(METHODS)}")
        if "num_speculative_tokens" not in d:
            raise ConfigError("speculative_config needs 'num_speculative_tokens'")
        return cls(**d)

    def __post_init__(self) -> None:
        def check_int(name: str, lo: int, hi: int | None = None, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise ConfigError(f"speculative_config.{name}={v!r}: must be an integer {rng}")

        from leapfrog.spec.proposers.base import PROPOSERS
        if self.method not in METHODS and self.method not in PROPOSERS:
            raise ConfigError(f"speculative_config.method={self.method!r}: must be one of "
                              f"{sorted(set(METHODS) | set(PROPOSERS))}")
        check_int("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        check_int("prompt_lookup_min", 1)
        check_int("prompt_lookup_max", 1)
        check_int("disable_by_batch_size", 1, optional=True)
        check_int("adaptive_explore_interval", 2)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} > "
                              f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError("speculative_config: method 'draft_model' needs 'model' (the draft checkpoint)")
        if self.method == "ngram" and self.model:
            raise ConfigError("speculative_config: method 'ngram' takes no 'model'")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative_config.adaptive={self.adaptive!r}: must be true or false")
