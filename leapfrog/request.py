"""A request as the engine tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from leapfrog.detokenizer import Detokenizer, StopStrings
from leapfrog.outputs import CompletionOutput, PositionLogprobs, RequestMetrics
from leapfrog.sampling.grammar import GrammarState
from leapfrog.sampling.sampler import BadWords, NoiseRows, PositionKey, Rng, RowSpec
from leapfrog.sampling_params import SamplingParams


def stop_ids_of(params: SamplingParams, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """EOS (unless ignore_eos) and stop_token_ids, each once, in that order."""
    eos = () if params.ignore_eos else eos_ids
    return tuple(dict.fromkeys(eos + tuple(params.stop_token_ids or ())))


@dataclass(frozen=True)
class Prepared:
    """A request's params checked against the engine and their lists built (``LLMEngine.prepare``):
    once for every engine request that shares them (an API request's prompts x n choices), and
    off the engine's thread where the caller can. Done per choice, a 4 MiB body's lists (400k
    stop ids) cost ~90 ms each on the engine's thread, 23 s for n = 256."""
    params: SamplingParams                  # a validated copy of the caller's
    owner: Any = field(default=None, compare=False, repr=False)   # the engine that checked them
    bad_words: BadWords = BadWords()        # params.bad_words tokenized and indexed
    stops: StopStrings | None = None        # params.stop_strings indexed (None: no tokenizer)
    prediction_ids: tuple[int, ...] | None = None   # params.prediction tokenized, vocabulary-checked
    stop_ids: tuple[int, ...] = ()          # stop_ids_of(params, the engine's EOS)
    stop_set: frozenset[int] = frozenset()
    rules: dict = field(default_factory=dict, compare=False, repr=False)
    # (RowSpec.shared: the RuleTensors of the params alone, built at the first row of any of them)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detok: Detokenizer | None
    eos_ids: tuple[int, ...]
    max_tokens: int                        # resolved against max_model_len
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int | None = None                 # KV cache row while running
    num_computed: int = 0                  # tokens whose KV is in the cache (mirrors the KV manager)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_speculative_tokens: int | None = None  # per-request cap (None = engine's)
    prediction_ids: list[int] | None = None    # predicted output (SamplingParams.prediction), tokenized
    bad_words: BadWords = BadWords()   # SamplingParams.bad_words, tokenized and indexed
    rule_tensors: dict = field(default_factory=dict)   # RowSpec.memo: its RuleTensors, built at its first row
    shared_rules: dict = field(default_factory=dict, repr=False)   # RowSpec.shared (Prepared.rules)
    stop_ids: tuple[int, ...] | None = None   # stop_ids_of(params, eos_ids) (None: computed here)
    stop_set: frozenset[int] | None = field(default=None, repr=False)   # the same, for `in`
    grammar: GrammarState | None = None    # SamplingParams.structured_outputs, at output_ids
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))
    index: int = 0                         # completion index when n > 1
    seed_key: int | None = None            # seeded requests: key of the per-position noise
    noise_rows: NoiseRows = field(default_factory=NoiseRows)   # seeded: its positions' noise, drawn once
    error: BaseException | None = None     # set when finish_reason == "error"
    # SamplingParams.logprobs / prompt_logprobs: one entry per output / prompt token
    output_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    cumulative_logprob: float = 0.0
    _sent_text: int = 0
    _sent_tokens: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        """No token generated yet: the prompt (or the rest of it) still has to be computed."""
        return not self.output_ids

    def __post_init__(self) -> None:
        # (once: rebuilt at every access, 500k stop_token_ids cost 30 ms a step of the batch; the
        # engine passes them from its Prepared, built once for all of a request's choices)
        if self.stop_ids is None:
            self.stop_ids = stop_ids_of(self.params, self.eos_ids)
        if self.stop_set is None:
            self.stop_set = frozenset(self.stop_ids)

    def rng(self, j: int = 0) -> Rng:
        """Randomness of the row j tokens after output_ids: none (greedy), the noise keyed by
        (seed, output position) for seeded requests, else the request's generator stream."""
        if self.params.greedy:
            return None
        if self.seed_key is not None:
            n = len(self.output_ids)
            self.noise_rows.drop_below(n)
            return PositionKey(self.seed_key, n + j, self.noise_rows)
        return self.generator

    @property
    def sampled(self) -> bool:
        """Drawn rather than greedy (temperature > 0): the speculation controller keeps the costs of
        batches mostly of these apart (spec_decode/adaptive.py: a sampled step costs more)."""
        return not self.params.greedy

    @property
    def unseeded_sampled(self) -> bool:
        """Sampled from the request's own generator stream (no seed): its drafts are verified by
        rejection sampling, so a tree proposer drafts it a chain drawn from q (proposers/eagle.py)."""
        return not self.params.greedy and self.seed_key is None

    @property
    def temperature_only(self) -> bool:
        """Every row of this request, drafts included, is drawn from softmax(logits / temperature):
        sampled with nothing else changing the logits, no grammar, past min_tokens."""
        p = self.params
        return (p.plain_temperature and self.grammar is None
                and (len(self.output_ids) >= p.min_tokens or not self.stop_ids))

    @property
    def raw_argmax(self) -> bool:
        """Every row of this request, drafts included, is the argmax of the raw logits: greedy with
        no penalties, token rules or grammar, and past min_tokens (or nothing to suppress)."""
        p = self.params
        return p.plain_argmax and self.grammar is None and (len(self.output_ids) >= p.min_tokens or not self.stop_ids)

    def row_spec(self, extra: list[int] = ()) -> RowSpec:  # type: ignore[assignment]
        """Sampling context of the row after output_ids + extra (drafts)."""
        out = self.output_ids + list(extra) if extra else self.output_ids
        return RowSpec(self.params, self.prompt_ids, out, self.stop_ids, self.bad_words, self.grammar,
                       self.rule_tensors, self.shared_rules, len(self.output_ids))

    def completion(self, delta: bool = False) -> CompletionOutput:
        text = self.detok.text if self.detok is not None else ""
        ids, lps = self.output_ids, self.output_logprobs
        if delta:
            text, ids = text[self._sent_text:], ids[self._sent_tokens:]
            lps = None if lps is None else lps[self._sent_tokens:]
            self._sent_text += len(text)
            self._sent_tokens += len(ids)
        return CompletionOutput(self.index, text, list(ids), self.finish_reason, self.stop_reason,
                                None if lps is None else list(lps),
                                None if lps is None else self.cumulative_logprob)
