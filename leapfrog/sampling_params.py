"""SamplingParams with vLLM's names, defaults and semantics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from leapfrog.errors import ConfigError
from leapfrog.sampling.grammar import StructuredOutputsParams

#: temperatures below this are greedy (vLLM's _SAMPLING_EPS)
SAMPLING_EPS = 1e-5
#: completions per prompt at most (vLLM sets no bound; one call must not allocate without limit)
MAX_N = 128
#: top log-probabilities per token at most (vLLM's default max_logprobs)
MAX_LOGPROBS = 20
#: |logit_bias| at most (OpenAI's range)
MAX_LOGIT_BIAS = 100.0


def token_ids_ok(ids, end: int | None = None) -> bool:
    """Every item of ``ids`` a non-negative int, not a bool (below ``end`` when given). Checked with
    C loops (the set of the types, min, max): as a generator expression 500k ids of one request
    (stop_token_ids, allowed_token_ids) took 0.25 s a check on the engine's thread."""
    if not ids:
        return True
    if set(map(type, ids)) <= {int}:
        return min(ids) >= 0 and (end is None or max(ids) < end)
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 and (end is None or t < end)
               for t in ids)   # (int subclasses, or items that are not ints)


def _texts_ok(texts, strip: bool = False) -> bool:
    """Every item a string, not empty (nor blank with ``strip``), in one C loop (str's own methods
    refuse anything but a string)."""
    try:
        return all(map(str.strip, texts)) if strip else all(map(str.__len__, texts))
    except TypeError:
        return False


# field -> (low, high, low excluded, note): finite values only; the bounds keep every transform
# finite in float32 (a repetition penalty of 1e-300 would turn a logit into inf, the softmax into NaN).
_FLOAT_RANGES: dict[str, tuple[float, float, bool, str]] = {
    "temperature": (0, 1e4, False, " (0 = greedy)"),
    "top_p": (0, 1, True, ""),
    "min_p": (0, 1, False, ""),
    "repetition_penalty": (0.01, 100, False, " (1 = off)"),
    "presence_penalty": (-2, 2, False, ""),
    "frequency_penalty": (-2, 2, False, ""),
}


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
    """Per-request seed (any integer): the same seed gives the same output alone, in any batch,
    with any speculation method and K, adaptive K, or none (the noise behind output position n
    depends only on (seed, n); see spec/verify/greedy.py)."""
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
    """Log-probabilities of each generated token and of the ``logprobs`` most likely tokens at its
    position (0 = the generated token's only), from the target's distribution (accepted drafts
    get the verify forward's values, never the draft's); raw or processed per the engine's
    ``logprobs_mode``. None = none."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first (the first has none)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit (in [-100, 100], OpenAI's range), greedy included."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be generated."""
    bad_words: list[str] | None = None
    """Words that must not be generated: the last token of a word is banned wherever the output
    so far ends with the word's other tokens (each word with and without a leading space)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k prompt tokens (k >= 1; -1 = as many as the context allows)."""
    structured_outputs: StructuredOutputsParams | dict | None = None
    """A grammar the output must follow (JSON schema, regex, choice, Lark/GBNF grammar, any JSON
    object; a dict is read as StructuredOutputsParams' fields). With speculation the mask applies
    to drafts and target alike (sampling/grammar.py); the output always parses."""
    prediction: str | list[int] | None = None
    """Predicted output (OpenAI's ``prediction``): text (or token ids) the output is expected to
    mostly repeat, e.g. the file being edited. Drafts come from it, whatever the engine's
    speculative_config (spec_decode/proposers/prediction.py); the output stays the target's."""
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        """Validation at the door: every value that reaches the sampler is finite and in range
        (the same checks serve the offline API and the server, which maps them to 400s). What
        needs the model (token ids against the vocabulary, stop strings against the tokenizer)
        is checked by the engine when the request is added."""
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        for name, (lo, hi, lo_open, note) in _FLOAT_RANGES.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad(name, "must be a number")
            if not math.isfinite(v):
                raise bad(name, "must be finite")
            if not (lo < v if lo_open else lo <= v) or v > hi:
                raise bad(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]{note}")
            setattr(self, name, float(v))   # (an int would make integer tensors downstream)
        for name in ("n", "top_k", "min_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad(name, "must be an integer")
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be in [1, {MAX_N}]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (off) or a positive integer (values beyond the vocabulary mean off)")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool)
                                            or not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be a positive integer or None")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "must be in [0, max_tokens]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer (any size: it is hashed to a 64-bit key)")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is None:
            stops = []
        if not isinstance(stops, (list, tuple)) or not _texts_ok(stops):
            raise bad("stop", "must be a non-empty string or a list of them")
        self._stop_list = list(stops)
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not token_ids_ok(ids)):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        pred = self.prediction
        if pred is not None and not isinstance(pred, str) and (not isinstance(pred, (list, tuple))
                                                               or not token_ids_ok(pred)):
            raise bad("prediction", "must be a string or a list of token ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise bad("logit_bias", "must be a dict of token id -> bias")
            for t, v in bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise bad("logit_bias", f"key {t!r} is not a token id (a non-negative integer)")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                        or abs(v) > MAX_LOGIT_BIAS:
                    raise bad("logit_bias", f"value {v!r} for token {t} must be a number in "
                                            f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, (list, tuple)) or not allowed
                                    or not token_ids_ok(allowed)):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids (non-negative integers)")
        words = self.bad_words
        if words is not None and (not isinstance(words, (list, tuple)) or not _texts_ok(words, strip=True)):
            raise bad("bad_words", "must be a list of non-empty strings")
        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                self.structured_outputs = so = StructuredOutputsParams(**so)
            except TypeError as e:
                raise bad("structured_outputs", f"unknown field ({e})") from None
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams or a dict of its fields")
        if so is not None and self.min_tokens > 0:   # (the grammar, not min_tokens, would decide the end)
            raise bad("min_tokens", "with structured outputs is not supported: the grammar decides where the "
                                    "output may end; drop min_tokens")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1)):
            raise bad("truncate_prompt_tokens", "must be None, -1 (as much as fits) or a positive integer")

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
    def has_token_rules(self) -> bool:
        """Token-level rules change the logits: logit_bias, allowed_token_ids, bad_words, a grammar."""
        return (bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)
                or self.structured_outputs is not None)

    @property
    def plain_temperature(self) -> bool:
        """Sampled from softmax(logits / temperature) alone: no penalties, token rules, top-k,
        top-p or min-p (min_tokens is per position, see Request)."""
        return (not self.greedy and not self.has_penalties and not self.has_token_rules and self.top_k <= 0
                and self.top_p >= 1.0 and self.min_p <= 0.0)

    @property
    def plain_argmax(self) -> bool:
        """Greedy on the raw logits: nothing changes them (penalties, token rules; min_tokens is
        per position, see Request)."""
        return self.greedy and not self.has_penalties and not self.has_token_rules
