"""Build the proposer and the K controller from a speculative_config dict."""

from __future__ import annotations

from typing import Any

from leapfrog.errors import ConfigError
from leapfrog.spec_decode.adaptive import SpecController
from leapfrog.model.loader import read_checkpoint
from leapfrog.spec_decode.config import SELF_DRAFT, SpeculativeConfig
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
    limit = speculative_len(cfg, engine.max_model_len, _draft_context(cfg, engine))   # (before loading the draft)
    return PROPOSERS[cfg.method](cfg, info), SpecController(cfg, limit)


def _draft_context(cfg: SpeculativeConfig, engine: Any) -> int | None:
    """A draft model's trained context (max_position_embeddings x a linear rope factor); None for
    the other methods (EAGLE heads run at the target's positions)."""
    if cfg.method != "draft_model":
        return None
    ckpt = engine.checkpoint if cfg.model == SELF_DRAFT else read_checkpoint(cfg.model)
    return None if ckpt is None else ckpt.args.context_len


def speculative_len(cfg: SpeculativeConfig, max_model_len: int, own: int | None) -> int:
    """Where drafting ends (SpeculativeConfig.max_model_len): given, at most the target's
    max_model_len and the drafter's trained context (``own``, draft models); by default the
    smaller of the two."""
    limit = min(max_model_len, own) if own is not None else max_model_len
    if cfg.max_model_len is None:
        return limit
    if cfg.max_model_len > max_model_len:
        raise ConfigError(f"speculative_config.max_model_len={cfg.max_model_len} is larger than the target's "
                          f"max_model_len, {max_model_len}")
    if own is not None and cfg.max_model_len > own:
        raise ConfigError(f"speculative_config.max_model_len={cfg.max_model_len} is larger than the draft model's "
                          f"context, {own} (max_position_embeddings in its config.json, times a linear rope factor): "
                          "it was never trained there")
    return cfg.max_model_len
