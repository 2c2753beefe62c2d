"""SamplingParams with vLLM's names, defaults and semantics."""

from __future__ import annotations

from dataclasses import dataclass, field

from leapfrog.errors import ConfigError

#: temperatures below this are greedy (vLLM's _SAMPLING_EPS)
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    """Number of completions per prompt."""
    temperature: float = 1.0
    """0 means greedy (argmax of the penalised logits)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 or -1 = off)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's (0 = off)."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same output, whatever else runs in the batch."""
    max_tokens: int | None = 16
    """New tokens at most; None = up to the model's context length."""
    min_tokens: int = 0
    """EOS and stop_token_ids are suppressed until this many tokens were generated."""
    stop: str | list[str] | None = None
    """Stop strings; the output ends before them (unless include_stop_str_in_output)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the output; they are kept in token_ids, dropped from text if special."""
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    """>1 discourages tokens seen in the prompt or output (divide positive logits, multiply negative)."""
    presence_penalty: float = 0.0
    """Subtracted from the logits of tokens that appear in the output."""
    frequency_penalty: float = 0.0
    """Subtracted once per occurrence in the output."""
    skip_special_tokens: bool = True
    logprobs: int | None = None
    """Accepted for API compatibility; log-probabilities are not returned yet."""
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad(name, "must be a number")
        for name in ("n", "top_k", "min_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(name, "must be an integer")
        if self.n < 1:
            raise bad("n", "must be at least 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (off) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool)
                                            or not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be a positive integer or None")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "must be in [0, max_tokens]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise bad("stop", "must be a non-empty string or a list of them")
        self._stop_list = stops
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise bad("stop_token_ids", "must be a list of non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def needs_history(self) -> bool:
        """Processing of row logits depends on the tokens before it (penalties, min_tokens)."""
        return self.has_penalties or self.min_tokens > 0
