"""Model arguments read from a Hugging Face ``config.json`` (Llama family).

Handles both spellings of RoPE settings found on the hub: transformers 4.x
(``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from leapfrog.errors import CheckpointError

#: architectures (config.json "architectures"[0] or "model_type") this runtime implements.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_MODEL_TYPES = set(SUPPORTED_ARCHITECTURES.values())
SUPPORTED_ROPE_TYPES = {"default", "linear", "dynamic", "llama3"}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class LlamaArgs:
    """Shapes and options of a Llama-family decoder. ``head_dim`` is derived when absent."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention_bias: bool = False  # q/k/v biases (Qwen2 has them)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config field {name}={getattr(self, name)} must be positive")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> "LlamaArgs":
        """Build from a config.json dict; unknown keys are ignored, missing required ones named."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if archs and archs[0] not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{source}: unsupported architecture {archs[0]!r}; leapfrog supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if model_type is None and archs:
            model_type = SUPPORTED_ARCHITECTURES[archs[0]]
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"{source}: unsupported model_type {model_type!r}; leapfrog supports "
                f"{sorted(SUPPORTED_MODEL_TYPES)}"
            )
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise CheckpointError(f"{source}: unsupported hidden_act {hidden_act!r} (only 'silu')")
        try:
            hidden = int(cfg["hidden_size"])
            n_heads = int(cfg["num_attention_heads"])
            args = dict(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=n_heads,
            )
        except KeyError as e:
            raise CheckpointError(f"{source}: missing required field {e.args[0]!r}") from None
        head_dim = cfg.get("head_dim") or hidden // n_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            model_type=model_type,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(cfg, source),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **args,
        )


def _parse_rope(cfg: dict[str, Any], source: str) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {sorted(SUPPORTED_ROPE_TYPES)}"
        )
    orig = params.get("original_max_position_embeddings")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig else None,
    )
