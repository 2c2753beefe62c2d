"""Prometheus metrics with vLLM-compatible names (prefix ``leapfrog:``), in the app's own registry.

Per request (at finish): token counts, latency phases (queue, prefill, decode, inference), TTFT,
time per output token, speculation counters. Per engine step: tokens processed and inter-token
latency (measured in the engine, so non-streaming requests count too). Per API request: n and
max_tokens."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from leapfrog.outputs import IterationStats, RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def _one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, m = [], 1
    while True:
        for b in (1, 2, 5):
            if b * m > limit:
                return tuple(out)
            out.append(b * m)
        m *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int = 4096) -> None:
        self.registry = CollectorRegistry()
        lbl = ["model_name"]
        r = self.registry
        self.num_drafts = Counter("leapfrog:spec_decode_num_drafts", "Verification steps that carried drafts", lbl, registry=r)
        self.num_draft_tokens = Counter("leapfrog:spec_decode_num_draft_tokens", "Draft tokens proposed", lbl, registry=r)
        self.num_accepted_tokens = Counter("leapfrog:spec_decode_num_accepted_tokens", "Draft tokens accepted", lbl, registry=r)
        self.accepted_per_pos = Counter("leapfrog:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by draft position (tree depth for tree methods)", lbl + ["position"], registry=r)
        self.prompt_tokens = Counter("leapfrog:prompt_tokens", "Prompt tokens processed", lbl, registry=r)
        self.generation_tokens = Counter("leapfrog:generation_tokens", "Tokens generated", lbl, registry=r)
        self.requests = Counter("leapfrog:request_success", "Finished requests", lbl + ["finished_reason"], registry=r)
        self.e2e = Histogram("leapfrog:e2e_request_latency_seconds", "Request latency", lbl, buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("leapfrog:time_to_first_token_seconds", "Time to first token", lbl,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("leapfrog:inter_token_latency_seconds", "Time between output tokens", lbl,
                             buckets=_ITL_BUCKETS, registry=r)
        self.tpot = Histogram("leapfrog:request_time_per_output_token_seconds",
                              "Decode time over output tokens after the first, per request", lbl,
                              buckets=_ITL_BUCKETS, registry=r)
        self.phases = {
            phase: Histogram(f"leapfrog:request_{phase}_time_seconds", text, lbl, buckets=_LATENCY_BUCKETS, registry=r)
            for phase, text in (("queue", "Time from arrival to the first scheduled step"),
                                ("prefill", "Time from the first scheduled step to the first token"),
                                ("decode", "Time from the first token to the finish"),
                                ("inference", "Time from the first scheduled step to the finish"))}
        tokens = _one_two_five(max_model_len)
        self.request_prompt_tokens = Histogram("leapfrog:request_prompt_tokens", "Prompt tokens per request", lbl,
                                               buckets=tokens, registry=r)
        self.request_generation_tokens = Histogram("leapfrog:request_generation_tokens",
                                                   "Generated tokens per request", lbl, buckets=tokens, registry=r)
        self.iteration_tokens = Histogram("leapfrog:iteration_tokens_total",
                                          "Tokens per engine step (prompt tokens prefilled + tokens generated)", lbl,
                                          buckets=_ITERATION_BUCKETS, registry=r)
        self.params_n = Histogram("leapfrog:request_params_n", "The n of each API request", lbl,
                                  buckets=_N_BUCKETS, registry=r)
        self.params_max_tokens = Histogram("leapfrog:request_params_max_tokens", "The max_tokens of each API request",
                                           lbl, buckets=tokens, registry=r)
        self.running = Gauge("leapfrog:num_requests_running", "Requests in the running batch", lbl, registry=r)
        self.waiting = Gauge("leapfrog:num_requests_waiting", "Requests waiting for a KV row", lbl, registry=r)
        self.kv_usage = Gauge("leapfrog:kv_cache_usage_perc", "Fraction of the KV token budget in use", lbl, registry=r)
        self.suffix_cache = Gauge("leapfrog:suffix_cache", "Suffix decoding's global tree: finished requests held, "
                                  "their tokens, tree nodes, estimated bytes, evictions so far", lbl + ["quantity"],
                                  registry=r)
        self.model_name = model_name

    def request_finished(self, out: RequestOutput) -> None:
        m, name = out.metrics, self.model_name
        if m is None:
            return
        s = m.spec
        self.num_drafts.labels(name).inc(s.num_drafts)
        self.num_draft_tokens.labels(name).inc(s.num_draft_tokens)
        self.num_accepted_tokens.labels(name).inc(s.num_accepted_tokens)
        for pos, n in enumerate(s.num_accepted_tokens_per_pos):
            self.accepted_per_pos.labels(name, str(pos)).inc(n)
        self.prompt_tokens.labels(name).inc(m.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(m.num_generated_tokens)
        self.requests.labels(name, out.outputs[0].finish_reason or "abort").inc()
        if m.latency is not None:
            self.e2e.labels(name).observe(m.latency)
        if m.time_to_first_token is not None:
            self.ttft.labels(name).observe(m.time_to_first_token)
        for phase, hist in self.phases.items():
            v = getattr(m, f"{phase}_time")
            if v is not None:
                hist.labels(name).observe(v)
        if m.decode_time is not None and m.num_generated_tokens > 1:
            self.tpot.labels(name).observe(m.decode_time / (m.num_generated_tokens - 1))
        self.request_prompt_tokens.labels(name).observe(m.num_prompt_tokens)
        self.request_generation_tokens.labels(name).observe(m.num_generated_tokens)

    def iteration(self, stats: IterationStats) -> None:
        """One engine step's stats (called from the engine thread after each step)."""
        name = self.model_name
        n = stats.num_prompt_tokens + stats.num_generation_tokens
        if n:
            self.iteration_tokens.labels(name).observe(n)
        for v in stats.inter_token_latencies:
            self.itl.labels(name).observe(v)

    def request_params(self, n: int, max_tokens: int | None) -> None:
        self.params_n.labels(self.model_name).observe(n)
        if max_tokens is not None:
            self.params_max_tokens.labels(self.model_name).observe(max_tokens)

    def set_engine_state(self, running: int, waiting: int, kv_usage: float,
                         suffix_cache: dict[str, int] | None = None) -> None:
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)
        self.kv_usage.labels(self.model_name).set(kv_usage)
        for quantity, v in (suffix_cache or {}).items():
            self.suffix_cache.labels(self.model_name, quantity).set(v)
