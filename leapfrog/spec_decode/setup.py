"""Build the proposer and the K controller from a speculative_config dict."""

from __future__ import annotations

from typing import Any

from leapfrog.spec_decode.adaptive import SpecController
from leapfrog.spec_decode.config import SpeculativeConfig
from leapfrog.spec_decode.proposers import draft_model, eagle, ngram, suffix  # noqa: F401  (register)
from leapfrog.spec_decode.proposers.base import PROPOSERS, TargetInfo


def build_speculation(spec: dict[str, Any] | SpeculativeConfig, engine: Any) -> tuple[Any, SpecController]:
    cfg = spec if isinstance(spec, SpeculativeConfig) else SpeculativeConfig.from_dict(spec)
    info = TargetInfo(
        vocab_size=engine.vocab_size, tokenizer=engine.tokenizer, eos_ids=engine.eos_ids,
        dtype=engine.dtype, device=engine.device, num_rows=engine.config.max_num_seqs,
        max_model_len=engine.max_model_len, max_num_batched_tokens=engine.config.max_num_batched_tokens,
        model=engine.model, batch_invariant=engine.config.batch_invariant,
        enforce_eager=engine.config.enforce_eager,
        allow_pickle=engine.config.allow_pickle, checkpoint=engine.checkpoint,
        load_format=engine.config.load_format, seed=engine.config.seed)
    return PROPOSERS[cfg.method](cfg, info), SpecController(cfg, engine.max_model_len)
