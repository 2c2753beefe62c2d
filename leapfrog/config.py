"""Engine configuration (frozen dataclasses, validated; env vars would be read here only)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from leapfrog.errors import ConfigError


LOAD_FORMATS = ("auto", "dummy")
#: the most decode steps (or speculation rounds) per engine step (num_scheduler_steps)
MAX_SCHEDULER_STEPS = 32
#: the engine seed's range, [SEED_MIN, SEED_END) (torch's manual_seed)
SEED_MIN, SEED_END = -(2**63), 2**64


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None       # default: min(model's max_position_embeddings, 4096)
    max_num_seqs: int = 16                 # KV rows: concurrent sequences
    max_num_batched_tokens: int = 2048     # prompt tokens computed per step (chunked prefill)
    allow_pickle: bool = False
    load_format: str = "auto"
    """How the target's weights are read (vLLM's name): "auto" (safetensors; pickled .bin files
    with allow_pickle) or "dummy": no weight files, every weight random (normal, std =
    config.json's initializer_range, norms 1) from config.json alone, for measuring a model shape
    (benchmarks/gpu_bench.py). A draft model is always loaded from its files."""
    skip_tokenizer_init: bool = False
    speculative_config: dict[str, Any] | None = None
    batch_invariant: bool = False
    """Every token's logits bitwise independent of the batch around it (other requests, drafts,
    prompt chunks): greedy output with speculation then equals output without, and a request
    gives the same tokens alone or among any others, in bf16 too. Costs throughput
    (benchmarks/batch_invariant_bench.py measures how much)."""
    enforce_eager: bool = True
    """Run every forward eagerly. False: decode and verify forwards of the target and a draft
    model run as compiled graphs (model/compiled.py), compiled at start-up for batch sizes
    1, 2, 4, ... max_num_seqs and 1 or K + 1 tokens per sequence (10-30 s per graph on 2 CPU
    cores)."""
    num_scheduler_steps: int = 1
    """Decode steps per engine step (vLLM's multi-step scheduling): > 1 runs that many decode
    steps of the target as one compiled graph (model/compiled.py CompiledDecodeSteps) whenever
    every decoding request is greedy on the raw logits or samples with temperature only, without
    logprobs, and nothing drafts, so the engine's per-step work (scheduling, inputs, sampling,
    bookkeeping, detokenizing) is paid once per that many tokens; each token is drawn as a
    one-token step would draw it. Tokens then arrive that many at a time; a request that stops
    mid-way drops the rest. Other steps (penalties, top-k/p, logprobs, prompts, the context's
    end) run one token at a time. Needs enforce_eager=False.

    With speculative_config (method "draft_model", or "eagle"/"eagle3" chains: "eagle_topk": 1,
    or "num_draft_tokens": "auto"), each engine step runs up to that many speculation rounds (draft
    K, verify, accept), a compiled graph each fed the last one's outputs (CompiledSpecRound,
    CompiledEagleRound), whenever every request is greedy on the raw logits or samples with
    temperature only (batches of up to 8 sequences and 256 MiB of race noise then: runner.py
    SAMPLED_ROUNDS_*), without logprobs, and drafts K (num_speculative_tokens: with "adaptive" K
    or "auto" tree sizes, when the controller picks K, or the chain of the depth; it weighs the
    rounds by their measured time per round: spec_decode/adaptive.py). At most
    MAX_SCHEDULER_STEPS. Where the controller may turn speculation off (an adaptive size, "auto",
    disable_by_batch_size), steps without drafts run as multi-step decode (handing an EAGLE head
    the target's states of every step). Rounds
    verify by matching: the target's token at a row is its argmax or its race winner under the
    sampler's noise of that output position, which the drafts were drawn with too; a greedy or
    seeded request's tokens are what a one-round step gives. Other steps run one round."""
    logprobs_mode: str = "raw_logprobs"
    """What SamplingParams.logprobs reports (vLLM's names): "raw_logprobs" (log_softmax of the
    target's logits), "raw_logits", "processed_logprobs" (of the distribution the sampler draws
    from: token rules, penalties, temperature, top-k/p, min_p) or "processed_logits"."""
    quantization: str | None = None
    """Weight-only quantization of the target's decoder layers at load: "int8" (per output
    channel) or "int4" (per group of 32 inputs); model/quant.py. Speculation stays lossless
    relative to the quantized target."""
    tensor_parallel_size: int = 1
    """Shard the target over this many processes (parallel/): Megatron-style, heads, MLP channels
    and vocabulary split, two all-reduces per layer. On one machine rank 0 spawns the workers;
    under torchrun every process runs leapfrog and rank 0 serves. Eager only; drafters (draft
    model, EAGLE head, n-gram, suffix, predictions) run on rank 0, unsharded (an EAGLE head gets
    whole copies of the target's embedding and LM head there: parallel/replica.py)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():   # ("" loaded the current directory)
            raise ConfigError(f"model={self.model!r}: must be a checkpoint directory or a hub id (a non-empty string)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "num_scheduler_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r}: must be a positive integer")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"max_model_len={self.max_model_len!r}: must be an integer >= 2")
        if self.device not in ("auto", "cpu") and not str(self.device).startswith("cuda"):
            raise ConfigError(f"device={self.device!r}: use 'auto', 'cpu' or 'cuda[:N]'")
        for name in ("batch_invariant", "enforce_eager", "allow_pickle", "skip_tokenizer_init"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r}: must be True or False")
        if self.tokenizer is not None and not isinstance(self.tokenizer, (str, os.PathLike)):
            raise ConfigError(f"tokenizer={self.tokenizer!r}: must be a directory or hub id (a string), or None")
        if self.batch_invariant and not self.enforce_eager:
            raise ConfigError("batch_invariant=True runs eagerly (its kernels are picked per row tile); "
                              "leave enforce_eager=True")
        if self.num_scheduler_steps > MAX_SCHEDULER_STEPS:
            raise ConfigError(f"num_scheduler_steps={self.num_scheduler_steps}: at most {MAX_SCHEDULER_STEPS} "
                              "(multi-step decode unrolls the steps into one compiled graph, whose compile time "
                              "grows with them: 8 steps take about 80 s per batch bucket on 2 CPU cores)")
        if self.num_scheduler_steps > 1:
            if self.enforce_eager:
                raise ConfigError(f"num_scheduler_steps={self.num_scheduler_steps} needs the compiled fast path "
                                  "(enforce_eager=False): the steps run as one graph")
            spec = self.speculative_config
            if isinstance(spec, dict) and spec.get("min_draft_confidence") is not None:
                raise ConfigError(f"num_scheduler_steps={self.num_scheduler_steps} with min_draft_confidence: "
                                  "speculation rounds draft fixed chains in one graph, which cannot end them "
                                  "early; drop one of them")
            if spec is not None and not supports_rounds(spec):
                raise ConfigError(f"num_scheduler_steps={self.num_scheduler_steps} with speculative_config runs "
                                  "rounds of chains, one compiled graph each: it needs method 'draft_model', "
                                  "or 'eagle'/'eagle3' with \"eagle_topk\": 1 or \"num_draft_tokens\": \"auto\" "
                                  "(no fixed or static tree); drop one of them")
        if self.tensor_parallel_size > 1:
            for bad, why in ((self.batch_invariant, "batch_invariant=True"),
                             (not self.enforce_eager, "enforce_eager=False (the compiled fast path)"),
                             (self.quantization is not None, f"quantization={self.quantization!r}")):
                if bad:
                    raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size} with {why} is not "
                                      "supported yet; drop one of them")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format={self.load_format!r}: must be one of {list(LOAD_FORMATS)}")
        if self.load_format == "dummy" and self.tensor_parallel_size > 1:
            raise ConfigError("load_format='dummy' with tensor_parallel_size > 1 is not supported yet "
                              "(workers read their shards from files)")
        from leapfrog.model.quant import QUANT_METHODS
        if self.quantization is not None and self.quantization not in QUANT_METHODS:
            raise ConfigError(f"quantization={self.quantization!r}: must be one of {list(QUANT_METHODS)} (or None)")
        from leapfrog.sampling.logprobs import LOGPROBS_MODES
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode={self.logprobs_mode!r}: must be one of {list(LOGPROBS_MODES)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not SEED_MIN <= self.seed < SEED_END:
            raise ConfigError(f"seed={self.seed!r}: must be an integer in [-2**63, 2**64)")
        if not isinstance(self.dtype, (str, torch.dtype)):
            raise ConfigError(f"dtype={self.dtype!r}: must be a string (auto, float32, bfloat16, float16)")

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)


def resolve_device(device: str) -> torch.device:
    """"auto" -> CUDA when present, else CPU; a CUDA device on a machine without one is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but CUDA is not available on this machine")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device={device!r}: use 'auto', 'cpu' or 'cuda[:N]'") from None


def supports_rounds(spec: Any) -> bool:
    """Whether a speculative_config can run multi-step speculation rounds (chains of a draft model
    or an EAGLE head: model/compiled.py CompiledSpecRound, CompiledEagleRound): a draft model's K
    (fixed, or "adaptive": rounds when the controller picks K), an EAGLE chain of the depth, or
    EAGLE "auto" tree sizes (rounds when the controller picks the chain of the depth)."""
    if not isinstance(spec, dict):
        return False
    if spec.get("method") == "draft_model":
        return True
    if spec.get("method") not in ("eagle", "eagle3") or spec.get("speculative_token_tree") is not None:
        return False
    n = spec.get("num_draft_tokens")
    return n == "auto" or bool(spec.get("adaptive")) or (
        spec.get("eagle_topk") == 1 and n in (None, spec.get("num_speculative_tokens")))
