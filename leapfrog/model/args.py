"""Model arguments read from a Hugging Face ``config.json`` (Llama family).

Handles both spellings of RoPE settings found on the hub: transformers 4.x
(``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``).

Every field is read through :func:`config_field` (type, then range), so a bad value is a
``CheckpointError`` that names the file, the field and the value, never a raw
``int()``/``float()`` traceback deep in the model.
"""

from __future__ import annotations

import math
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
#: the keys each scaled rope type must give (transformers 5's rope validation requires them; llama3's
#: original_max_position_embeddings may come from config.json's top level or max_position_embeddings)
_ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor")}

REQUIRED: Any = object()
"""``config_field`` default meaning: the field must be present (and not null)."""

_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               dict: "a JSON object", list: "a JSON list"}


def json_type(v: Any) -> str:
    """How JSON would call ``v``'s type, for error messages ("a string", "null", ...)."""
    return {type(None): "null", bool: "a bool", int: "an integer", float: "a float", str: "a string",
            list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def config_field(obj: dict[str, Any], key: str, kind: type, source: str, *, default: Any = REQUIRED,
                 minimum: float | None = None, name: str | None = None) -> Any:
    """``obj[key]`` checked to be a ``kind``, else a CheckpointError naming ``source`` and the field.

    kind: int (a JSON integer: not a bool, not a float such as 64.5 or 64.0), float (any finite
    JSON number, returned as float), bool, str, dict or list. ``minimum``: ints must be >= it,
    floats > it (every float of a Llama config is a positive scale or epsilon). Absent or null:
    ``default``; with no default the field is required. ``name``: the field as shown in errors
    (default ``key``; e.g. ``rope_scaling.factor``).
    """
    name = name or key
    v = obj.get(key)
    if v is None:
        if default is REQUIRED:
            what = "missing required field" if key not in obj else "null value for required field"
            raise CheckpointError(f"{source}: {what} {name!r} (expected {_KIND_NAMES[kind]})")
        return default
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) if kind is float
          else isinstance(v, int) and not isinstance(v, bool) if kind is int
          else isinstance(v, kind))
    if ok and minimum is not None:
        ok = v >= minimum if kind is int else v > minimum
    if not ok:
        rng = "" if minimum is None else (f" >= {minimum}" if kind is int else f" > {minimum}")
        raise CheckpointError(f"{source}: field {name!r} must be {_KIND_NAMES[kind]}{rng}, "
                              f"got {v!r} ({json_type(v)})")
    return float(v) if kind is float else v


def token_ids_field(obj: dict[str, Any], key: str, source: str) -> tuple[int, ...]:
    """A token-id field that may be null, one id or a list of ids (HF ``eos_token_id``)."""
    v = obj.get(key)
    if isinstance(v, list):
        return tuple(config_field({key: x}, key, int, source, minimum=0, name=f"{key}[{i}]")
                     for i, x in enumerate(v))
    t = config_field(obj, key, int, source, default=None, minimum=0)
    return () if t is None else (t,)


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
        # A backstop for direct construction; from_hf_config has already checked (naming the file).
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            config_field({name: getattr(self, name)}, name, int, "LlamaArgs", minimum=1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def context_len(self) -> int:
        """The trained context: max_position_embeddings, times a linear rope's factor (positions are
        divided by it, so the context grows by it, as vLLM reads it)."""
        r = self.rope
        return int(self.max_position_embeddings * r.factor) if r.rope_type == "linear" and r.factor > 1 \
            else self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> LlamaArgs:
        """Build from a config.json dict; unknown keys are ignored, bad or missing ones named."""
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source}: must be a JSON object ({{...}}), got {json_type(cfg)}")

        def get(key: str, kind: type, default: Any = REQUIRED, minimum: float | None = None) -> Any:
            return config_field(cfg, key, kind, source, default=default, minimum=minimum)

        archs = get("architectures", list, default=[])
        if archs:
            config_field({"architectures[0]": archs[0]}, "architectures[0]", str, source)
        model_type = get("model_type", str, default=None)
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
        hidden_act = get("hidden_act", str, default="silu")
        if hidden_act != "silu":
            raise CheckpointError(f"{source}: unsupported hidden_act {hidden_act!r} (only 'silu')")
        if get("mlp_bias", bool, default=False):   # the model has no MLP biases: refuse, never drop them
            raise CheckpointError(f"{source}: unsupported mlp_bias=true (MLP projections with biases)")

        hidden = get("hidden_size", int, minimum=1)
        n_heads = get("num_attention_heads", int, minimum=1)
        n_kv = get("num_key_value_heads", int, default=n_heads, minimum=1)
        head_dim = get("head_dim", int, default=None, minimum=1)
        if head_dim is None:
            if hidden % n_heads:
                raise CheckpointError(
                    f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={n_heads} "
                    "and no head_dim is given")
            head_dim = hidden // n_heads
        if head_dim % 2:
            raise CheckpointError(f"{source}: head_dim={head_dim} must be even (RoPE rotates pairs)")
        if n_heads % n_kv:
            raise CheckpointError(
                f"{source}: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
        sliding = get("sliding_window", int, default=0, minimum=0) or None   # 0 / null: full attention
        if model_type == "qwen2" and not get("use_sliding_window", bool, default=False):
            sliding = None
        if model_type == "llama":   # transformers' Llama attends to the whole context whatever it says
            sliding = None
        return cls(
            model_type=model_type,
            vocab_size=get("vocab_size", int, minimum=1),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size", int, minimum=1),
            num_hidden_layers=get("num_hidden_layers", int, minimum=1),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            max_position_embeddings=get("max_position_embeddings", int, default=2048, minimum=1),
            rms_norm_eps=get("rms_norm_eps", float, default=1e-6, minimum=0),
            rope=_parse_rope(cfg, source),
            attention_bias=get("attention_bias", bool, default=model_type == "qwen2"),
            tie_word_embeddings=get("tie_word_embeddings", bool, default=False),
            sliding_window=sliding,
            bos_token_id=get("bos_token_id", int, default=None, minimum=0),
            eos_token_ids=token_ids_field(cfg, "eos_token_id", source),
        )


def _parse_rope(cfg: dict[str, Any], source: str) -> RopeConfig:
    # rope_parameters (transformers 5) wins over rope_scaling (4.x); each value's error names its origin.
    scaling = config_field(cfg, "rope_scaling", dict, source, default={})
    parameters = config_field(cfg, "rope_parameters", dict, source, default={})
    params = {**scaling, **parameters}
    origin = {**{k: f"rope_scaling.{k}" for k in scaling}, **{k: f"rope_parameters.{k}" for k in parameters}}

    def get(key: str, kind: type, default: Any, minimum: float | None = None) -> Any:
        return config_field(params, key, kind, source, default=default, minimum=minimum, name=origin.get(key))

    theta = get("rope_theta", float, config_field(cfg, "rope_theta", float, source, default=10000.0, minimum=0),
                minimum=0)
    rope_type = get("rope_type", str, get("type", str, "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {sorted(SUPPORTED_ROPE_TYPES)}"
        )
    # the keys transformers requires of each scaled type (filling them in with guesses would run
    # another model than the checkpoint's)
    missing = [k for k in _ROPE_REQUIRED.get(rope_type, ()) if params.get(k) is None]
    if missing:
        raise CheckpointError(f"{source}: {rope_type} rope needs {', '.join(missing)} in rope_parameters (or "
                              "rope_scaling)")
    low, high = get("low_freq_factor", float, 1.0, minimum=0), get("high_freq_factor", float, 4.0, minimum=0)
    if rope_type == "llama3" and low == high:
        raise CheckpointError(f"{source}: llama3 rope needs low_freq_factor != high_freq_factor (both {low})")
    factor = get("factor", float, 1.0, minimum=0)
    if rope_type != "default" and factor < 1:   # (transformers' rope validation asks for >= 1 as well)
        raise CheckpointError(f"{source}: {rope_type} rope needs factor >= 1 (the context it stretches to is "
                              f"max_position_embeddings x factor), got {factor:g}")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        # (transformers 5's standardize_rope_params: the rope's own, else config.json's top level;
        # rope.py falls back to max_position_embeddings)
        original_max_position_embeddings=get("original_max_position_embeddings", int, config_field(
            cfg, "original_max_position_embeddings", int, source, default=None, minimum=1), minimum=1),
    )
