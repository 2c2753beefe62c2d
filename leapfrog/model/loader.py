"""Load Hugging Face Llama-family checkpoints: a local directory or a hub id.

A directory holds config.json, model.safetensors (or shards named by
model.safetensors.index.json), tokenizer files and optionally generation_config.json.
Pickle checkpoints (pytorch_model*.bin) run arbitrary code when loaded, so they are
refused unless the caller passes ``allow_pickle=True``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from leapfrog.errors import CheckpointError
from leapfrog.model.args import LlamaArgs
from leapfrog.model.llama import LlamaModel
from leapfrog.model.rope import rope_table

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    args: LlamaArgs
    config: dict
    eos_token_ids: tuple[int, ...]   # config + generation_config, in that order
    config_dtype: torch.dtype | None


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A local directory as is; otherwise a hub id downloaded (safetensors only) to the HF cache."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise CheckpointError(f"{p} is a file; pass the checkpoint directory that holds config.json")
    if str(model).count("/") != 1 or str(model).startswith((".", "/", "~")):
        raise CheckpointError(f"model {str(model)!r}: no such directory, and not a hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(str(model), allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated repo: say which
        raise CheckpointError(f"model {str(model)!r}: not a local directory and the hub download "
                              f"failed: {type(e).__name__}: {e}") from None


def read_checkpoint(model: str | os.PathLike) -> Checkpoint:
    path = resolve_model_path(model)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json (is this a Hugging Face model directory?)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON: {e}") from None
    args = LlamaArgs.from_hf_config(cfg, source=str(cfg_file))
    eos = list(args.eos_token_ids)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        for e in (gen_eos if isinstance(gen_eos, list) else [gen_eos]):
            if e is not None and e not in eos:
                eos.append(int(e))
    dt = cfg.get("torch_dtype") or cfg.get("dtype")
    return Checkpoint(path, args, cfg, tuple(eos), DTYPES.get(dt) if isinstance(dt, str) else None)


def resolve_dtype(dtype: str | torch.dtype, ckpt: Checkpoint, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dt = ckpt.config_dtype or torch.float32
        if device.type == "cpu" and dt in (torch.float16, torch.bfloat16):
            # Half precision is only fast on CPUs with native bf16 (oneDNN can pack it: AVX-512 or
            # AVX-NE-CONVERT). Elsewhere bf16 is emulated: measured slower to verify than fp32 (its
            # cost grows linearly with the tokens verified), so run such checkpoints in fp32.
            from leapfrog.model.packed import can_pack
            return torch.bfloat16 if can_pack(torch.bfloat16, device) else torch.float32
        return dt
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} not supported; use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def _weight_files(path: Path, allow_pickle: bool) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        files = {name: path / f for name, f in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index} names shard {f.name}, which is missing from {path}")
        return files
    single = sorted(path.glob("*.safetensors"))
    if single:
        out: dict[str, Path] = {}
        for f in single:
            with safe_open(f, framework="pt") as sf:
                out.update({k: f for k in sf.keys()})
        return out
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        if not allow_pickle:
            raise CheckpointError(
                f"{path} has only pickle (.bin/.pt) weights, which can run arbitrary code when loaded; "
                "convert them to safetensors or pass allow_pickle=True if you trust the source")
        return {"__pickle__": f for f in sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))}
    raise CheckpointError(f"{path}: no weights found (model.safetensors or an index with shards)")


def _hf_names(a: LlamaArgs) -> dict[str, list[str]]:
    """our parameter name -> HF tensor names concatenated (dim 0) into it."""
    names: dict[str, list[str]] = {"embed.weight": ["model.embed_tokens.weight"], "norm": ["model.norm.weight"]}
    if not a.tie_word_embeddings:
        names["lm_head.weight"] = ["lm_head.weight"]
    for i in range(a.num_hidden_layers):
        p, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = [p + f"self_attn.{x}_proj" for x in "qkv"]
        names[ours + "wqkv.weight"] = [n + ".weight" for n in attn]
        names[ours + "wqkv.bias"] = [n + ".bias" for n in attn]
        names[ours + "wo.weight"] = [p + "self_attn.o_proj.weight"]
        names[ours + "wo.bias"] = [p + "self_attn.o_proj.bias"]
        names[ours + "w13.weight"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        names[ours + "w2.weight"] = [p + "mlp.down_proj.weight"]
        names[ours + "attn_norm"] = [p + "input_layernorm.weight"]
        names[ours + "mlp_norm"] = [p + "post_attention_layernorm.weight"]
    return names


class _TensorSource:
    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self._open: dict[Path, object] = {}
        self._pickled: dict[str, Tensor] = {}
        if "__pickle__" in files:
            for f in {v for k, v in files.items()}:
                self._pickled.update(torch.load(f, map_location="cpu", weights_only=False))
            self.files = {k: files["__pickle__"] for k in self._pickled}

    def get(self, name: str) -> tuple[Tensor, Path]:
        f = self.files[name]
        if self._pickled:
            return self._pickled[name], f
        if f not in self._open:
            self._open[f] = safe_open(f, framework="pt")
        return self._open[f].get_tensor(name), f  # type: ignore[attr-defined]


def load_model(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, max_positions: int,
               allow_pickle: bool = False, pack: bool = False) -> LlamaModel:
    """Build the model on ``meta``, then fill every parameter from the checkpoint, checking shapes."""
    with torch.device("meta"):
        model = LlamaModel(ckpt.args, max_positions=1)
    model = model.to_empty(device=device).to(dtype)
    src = _TensorSource(_weight_files(ckpt.path, allow_pickle))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for ours, hf_names in _hf_names(ckpt.args).items():
            if ours not in params:
                continue  # e.g. a bias this architecture does not have
            missing = [n for n in hf_names if n not in src.files]
            if missing:
                raise CheckpointError(f"{ckpt.path}: tensor {missing[0]!r} is missing from the checkpoint")
            parts = []
            for n in hf_names:
                t, f = src.get(n)
                parts.append((n, f, t))
            expected = params[ours].shape
            got = torch.cat([t for _, _, t in parts]) if len(parts) > 1 else parts[0][2]
            if got.shape != expected:
                n, f, t = parts[0]
                raise CheckpointError(
                    f"{f.name}: tensor {n!r} has shape {tuple(t.shape)}, which does not fit "
                    f"config.json (expected {tuple(expected)} for {ours} after fusing {len(parts)} tensor(s))")
            params[ours].copy_(got.to(dtype))
    cos, sin = rope_table(ckpt.args.rope, ckpt.args.head_dim, ckpt.args.max_position_embeddings, max_positions)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model = model.eval().requires_grad_(False)
    if pack:
        model.pack_for_inference()
    return model


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer through transformers (fast tokenizer, chat template)."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: could not load a tokenizer: {type(e).__name__}: {e}") from None
