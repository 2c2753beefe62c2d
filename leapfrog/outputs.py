"""What generate() returns: vLLM-shaped RequestOutput / CompletionOutput, plus speculation metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    """Speculation counters with vLLM's definitions.

    acceptance_rate = num_accepted_tokens / num_draft_tokens
    mean_acceptance_length = 1 + num_accepted_tokens / num_drafts   (the bonus token counts)
    """
    num_drafts: int = 0                  # verification steps that carried >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int, num_positions: int | None = None) -> None:
        """One verification: ``num_draft`` drafted tokens (tree nodes), ``num_accepted`` of them
        accepted, over ``num_positions`` draft positions (a tree's depth; a chain's = num_draft):
        per-position counters count tree levels, so position i of a tree is "depth i + 1"."""
        if num_draft == 0:
            return
        levels = num_draft if num_positions is None else num_positions
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for counts, n in ((self.num_draft_tokens_per_pos, levels),
                          (self.num_accepted_tokens_per_pos, num_accepted)):
            if len(counts) < levels:
                counts.extend([0] * (levels - len(counts)))
            for i in range(n):
                counts[i] += 1

    def merge(self, other: "SpecMetrics") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in ((self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos),
                             (self.num_draft_tokens_per_pos, other.num_draft_tokens_per_pos)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None   # its first prefill chunk ran (the end of queueing)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_target_forwards: int = 0          # target passes that produced tokens for this request
    spec: SpecMetrics = field(default_factory=SpecMetrics)
    # predicted outputs (OpenAI's usage.completion_tokens_details), set when a request with a
    # prediction finishes: prediction tokens that appeared in the output (in order), and the rest
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    # vLLM's request phases: queue (arrival -> first scheduled), prefill (-> first token),
    # decode (first token -> finish), inference (first scheduled -> finish); None when not reached
    @property
    def queue_time(self) -> float | None:
        return _span(self.arrival_time, self.first_scheduled_time)

    @property
    def prefill_time(self) -> float | None:
        return _span(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        return _span(self.first_token_time, self.finished_time)

    @property
    def inference_time(self) -> float | None:
        return _span(self.first_scheduled_time, self.finished_time)

    # flat views, as in vLLM's per-request spec metrics
    @property
    def num_draft_tokens(self) -> int:
        return self.spec.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        return self.spec.num_accepted_tokens

    @property
    def acceptance_rate(self) -> float | None:
        return self.spec.acceptance_rate

    @property
    def mean_acceptance_length(self) -> float | None:
        return self.spec.mean_acceptance_length


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass
class IterationStats:
    """What one engine step did (vLLM's iteration stats): prompt tokens it prefilled, tokens it
    appended to outputs, and for each request that got tokens after its first, the time since its
    previous ones (one inter-token latency per request per step: a verify step that accepts several
    tokens is one interval, as in vLLM)."""
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)


@dataclass
class Logprob:
    """vLLM's Logprob: a token's log-probability at one position (or logit, per the engine's
    logprobs_mode), its rank there (1 = most likely) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: one position: token id -> Logprob, for the chosen token and the top-k most likely
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[PositionLogprobs] | None = None
    """One entry per token in token_ids when SamplingParams.logprobs is set (the chosen token
    first, then the top-k; the chosen token appears once even when it is among them)."""
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: BaseException | None = None
    """Why the request ended with finish_reason "error" (None otherwise)."""
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first."""
