"""Load Hugging Face Llama-family checkpoints: a local directory or a hub id.

A directory holds config.json, model.safetensors (or shards named by
model.safetensors.index.json), tokenizer files and optionally generation_config.json.
Pickle checkpoints (pytorch_model*.bin) run arbitrary code when loaded, so they are
refused unless the caller passes ``allow_pickle=True``.
"""

from __future__ import annotations

import json
import re
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from leapfrog.errors import CheckpointError
from leapfrog.model.args import LlamaArgs, json_type, token_ids_field
from leapfrog.model.llama import LlamaModel
from leapfrog.model.rope import rope_table
from leapfrog.parallel.shard import Shard

if TYPE_CHECKING:
    from leapfrog.parallel.group import TPGroup

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_PICKLE = "__pickle__/"   # _weight_files key prefix of a pickle file (tensor names not yet known)
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_HUB_TOKENIZER_PATTERNS = [p for p in _HUB_PATTERNS if p != "*.safetensors"]   # (no weights for a tokenizer)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    args: LlamaArgs
    config: dict
    eos_token_ids: tuple[int, ...]   # config + generation_config, in that order
    config_dtype: torch.dtype | None


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")   # owner/name, or a legacy name ("gpt2")


def resolve_model_path(model: str | os.PathLike, what: str = "model") -> Path:
    """A local directory as is; otherwise a hub id downloaded (safetensors only) to the HF cache.
    ``what``: how errors name it ("model", "tokenizer"); a tokenizer downloads no weights."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise CheckpointError(f"{p} is a file; pass the checkpoint directory that holds config.json")
    if not _HUB_ID.fullmatch(str(model)) or str(model).endswith((".", "-")):
        raise CheckpointError(f"{what} {str(model)!r}: no such directory, and not a hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
        patterns = _HUB_TOKENIZER_PATTERNS if what == "tokenizer" else _HUB_PATTERNS
        return Path(snapshot_download(str(model), allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 (offline, unknown repo, gated repo: say which)
        why = " ".join(str(e).split())   # one line (the hub's messages span several)
        raise CheckpointError(f"{what} {str(model)!r}: not a local directory and the hub download "
                              f"failed: {type(e).__name__}: {why[:400]}") from None


def read_json(file: Path) -> Any:
    """The parsed JSON of ``file``; malformed or non-UTF-8 content is a CheckpointError naming it."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: invalid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file}: not UTF-8 text (is it a JSON file?): {e}") from None


def read_checkpoint(model: str | os.PathLike) -> Checkpoint:
    path = resolve_model_path(model)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json (is this a Hugging Face model directory?)")
    cfg = read_json(cfg_file)
    args = LlamaArgs.from_hf_config(cfg, source=str(cfg_file))
    eos = list(args.eos_token_ids)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen = read_json(gen_file)
        if not isinstance(gen, dict):
            raise CheckpointError(f"{gen_file}: must be a JSON object ({{...}}), got {json_type(gen)}")
        eos += [e for e in token_ids_field(gen, "eos_token_id", str(gen_file)) if e not in eos]
    bad_eos = [e for e in eos if not 0 <= e < args.vocab_size]
    if bad_eos:   # (an end-of-sequence id the model can never produce: generation would not stop)
        raise CheckpointError(f"{path}: eos_token_id {bad_eos[0]} (config.json / generation_config.json) is outside "
                              f"the vocabulary [0, {args.vocab_size})")
    dt = check_stored_dtype(cfg, cfg_file)
    return Checkpoint(path, args, cfg, tuple(eos), dt)


def check_stored_dtype(cfg: dict, cfg_file: Path | str) -> torch.dtype | None:
    """config.json's torch_dtype (None when absent); pre-quantized weights (quantization_config)
    and other dtypes are refused: read as float weights they would be silently wrong."""
    qc = cfg.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise CheckpointError(f"{cfg_file}: quantization_config (quant_method {method!r}): pre-quantized "
                              "checkpoints are not supported; load the unquantized checkpoint, and quantize at "
                              "load with quantization='int8' or 'int4' if you want")
    dt = cfg.get("torch_dtype") or cfg.get("dtype")
    if dt is not None and not (isinstance(dt, str) and dt in DTYPES):
        raise CheckpointError(f"{cfg_file}: torch_dtype {dt!r} is not a dtype leapfrog runs "
                              "(float32, bfloat16 or float16)")
    return DTYPES.get(dt) if isinstance(dt, str) else None


def resolve_dtype(dtype: str | torch.dtype, ckpt: Checkpoint, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():   # (torch.int8 or torch.float64 as well as "float64": refused)
            raise CheckpointError(f"dtype {dtype} not supported; use auto, float32, bfloat16 or float16")
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


def _unreadable(f: Path, e: Exception, what: str = "a readable safetensors file") -> CheckpointError:
    return CheckpointError(f"{f}: not {what} ({type(e).__name__}: {e}); the file is truncated or "
                           "corrupt (an interrupted download or copy?): fetch it again")


def _safe_open(f: Path):
    """safe_open, with a bad header or a truncated file (checked against the header's offsets) named."""
    try:
        return safe_open(f, framework="pt")
    except (SafetensorError, OSError) as e:  # a bad header; data not covering the header's offsets
        raise _unreadable(f, e) from None


def _weight_files(path: Path, allow_pickle: bool) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: malformed index: needs a 'weight_map' object of "
                                  "tensor name -> shard file name")
        files = {name: path / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"{index} names shard {f.name}, which is missing from {path}")
            with _safe_open(f):   # a truncated shard is named here, before any tensor is read
                pass
        return files
    single = sorted(path.glob("*.safetensors"))
    if single:
        out: dict[str, Path] = {}
        for f in single:
            with _safe_open(f) as sf:
                names = list(sf.keys())  # noqa: SIM118 (the handle is not iterable)
            _refuse_repeats(out, names, f)
            out.update({k: f for k in names})
        return out
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        if not allow_pickle:
            raise CheckpointError(
                f"{path} has only pickle (.bin/.pt) weights, which can run arbitrary code when loaded; "
                "convert them to safetensors or pass allow_pickle=True if you trust the source")
        # Tensor names are only known once unpickled: _TensorSource fills them in.
        return {_PICKLE + f.name: f for f in sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))}
    raise CheckpointError(f"{path}: no weights found (model.safetensors or an index with shards)")


def _refuse_repeats(seen: dict[str, Path], names: list, f: Path) -> None:
    """Without an index every weight file of the folder is read: a tensor in two of them (a
    stray extra file, say) would silently take the later file's values."""
    again = [k for k in names if k in seen]
    if again:
        raise CheckpointError(f"tensor {again[0]!r} is in both {seen[again[0]].name} and {f.name} of {f.parent} "
                              f"({len(again)} repeated names): remove the extra file, or add a "
                              "model.safetensors.index.json naming the shard of each tensor")


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
    def __init__(self, path: Path, files: dict[str, Path]) -> None:
        self.path = path
        self.files = files
        self._open: dict[Path, object] = {}
        self._pickled: dict[str, Tensor] = {}
        if any(k.startswith(_PICKLE) for k in files):
            self.files = {}
            for f in files.values():
                try:
                    state = torch.load(f, map_location="cpu", weights_only=False)
                except Exception as e:  # noqa: BLE001 (EOFError, UnpicklingError, RuntimeError: bad zip, ...)
                    raise _unreadable(f, e, "a readable pickle checkpoint") from None
                if not isinstance(state, dict):
                    raise CheckpointError(f"{f}: holds a {type(state).__name__}, not a state dict of tensors")
                _refuse_repeats(self.files, list(state), f)
                self._pickled.update(state)
                self.files.update({k: f for k in state})

    def _from_file(self, name: str, read: Callable[[Any], Any]):
        """``read(safe_open handle)`` for the file holding ``name``, opened once; a read error names it."""
        f = self.files[name]
        if f not in self._open:
            self._open[f] = _safe_open(f)
        try:
            return read(self._open[f])
        except SafetensorError as e:  # not in this file (a wrong index), unreadable data
            raise CheckpointError(f"{f}: cannot read tensor {name!r} ({type(e).__name__}: {e})") from None

    def get(self, name: str) -> Tensor:
        return self._pickled[name] if self._pickled else self._from_file(name, lambda sf: sf.get_tensor(name))

    def get_part(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> Tensor:
        """``name[rows[0]:rows[1]]`` or ``name[:, cols[0]:cols[1]]``: from a safetensors file only
        that part is read (a tensor-parallel rank never holds the whole tensor)."""
        index = (slice(*rows),) if rows is not None else (slice(None), slice(*cols)) if cols is not None else ()
        if self._pickled:
            return self._pickled[name][index]
        return self._from_file(name, lambda sf: sf.get_slice(name)[index])

    def dtype(self, name: str) -> str:
        """The stored dtype, from the safetensors header ("BF16", "I32", ...; a pickled tensor's
        torch dtype as "torch.float32"): no data is read."""
        if not self._pickled:
            return str(self._from_file(name, lambda sf: sf.get_slice(name).get_dtype()))
        self.shape(name)   # (an entry that is not a tensor is refused there)
        return str(self._pickled[name].dtype)

    def check_weight_dtype(self, name: str) -> None:
        """A weight stored as an integer, boolean, complex or fp8 tensor would be cast to the model's
        dtype silently (a wrong model): a CheckpointError naming it (target, drafter and EAGLE head)."""
        stored = self.dtype(name)
        if stored not in _WEIGHT_DTYPES:
            raise CheckpointError(f"{self.files[name].name}: tensor {name!r} is stored as {stored}; weights must be "
                                  "float16, bfloat16, float32 or float64 (pre-quantized weights are not "
                                  "supported: the README's quantization section)")

    def shape(self, name: str) -> tuple[int, ...]:
        """From the safetensors header: no data is read."""
        if not self._pickled:
            return tuple(self._from_file(name, lambda sf: sf.get_slice(name).get_shape()))
        t = self._pickled[name]
        if not isinstance(t, Tensor):
            raise CheckpointError(f"{self.files[name]}: entry {name!r} is a {type(t).__name__}, not a tensor")
        return tuple(t.shape)


#: the stored dtypes a weight may have (safetensors' names, and torch's for pickled checkpoints)
_WEIGHT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "torch.float16", "torch.bfloat16", "torch.float32",
                            "torch.float64"})


def _fill_plan(args: LlamaArgs, src: _TensorSource, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[str]]:
    """our parameter name -> the HF tensors fused (dim 0) into it, each checked to be present and of a
    shape that fits config.json. Reads safetensors headers only, so a bad checkpoint fails before any
    weight is loaded. ``shapes``: our parameter name -> shape (of a model built on ``meta``)."""
    plan: dict[str, list[str]] = {}
    for ours, hf_names in _hf_names(args).items():
        if ours not in shapes:
            continue  # e.g. a bias this architecture does not have
        missing = [n for n in hf_names if n not in src.files]
        if missing:
            raise CheckpointError(f"{src.path}: tensor {missing[0]!r} is missing from the checkpoint")
        expected, got = shapes[ours], [src.shape(n) for n in hf_names]
        # e.g. wqkv [q + 2 kv, D] <- q_proj [q, D], k_proj [kv, D], v_proj [kv, D]
        misfit = [i for i, s in enumerate(got) if len(s) != len(expected) or s[1:] != expected[1:]]
        if misfit or sum(s[0] for s in got) != expected[0]:
            i = misfit[0] if misfit else 0
            raise CheckpointError(
                f"{src.files[hf_names[i]].name}: tensor {hf_names[i]!r} has shape {got[i]}, which does not fit "
                f"config.json (expected {expected} for {ours} after fusing {len(got)} tensor(s))")
        for n in hf_names:
            src.check_weight_dtype(n)
        plan[ours] = hf_names
    return plan


def _plan(ckpt: Checkpoint, allow_pickle: bool, names: tuple[str, ...] | None = None
          ) -> tuple[_TensorSource, dict[str, list[str]]]:
    """The checkpoint's tensors and the fill plan (``_fill_plan``) for the whole model's parameters,
    or only ``names`` of them, checked against a model built on ``meta``."""
    with torch.device("meta"):
        whole = LlamaModel(ckpt.args, max_positions=1)
    src = _TensorSource(ckpt.path, _weight_files(ckpt.path, allow_pickle))
    shapes = {n: tuple(p.shape) for n, p in whole.named_parameters() if names is None or n in names}
    plan = _fill_plan(ckpt.args, src, shapes)
    if names is None:
        _refuse_unused(ckpt, src, plan)
    return src, plan


def _refuse_unused(ckpt: Checkpoint, src: _TensorSource, plan: dict[str, list[str]]) -> None:
    """A tensor the model does not read means config.json describes another model (layers past
    num_hidden_layers, say): loading would silently compute something else. Ignored as
    transformers ignores them: RoPE's cached inv_freq, and lm_head.weight when config.json ties the
    head to the embedding."""
    used = {n for names in plan.values() for n in names}
    unused = sorted(n for n in src.files if n not in used and not n.endswith("rotary_emb.inv_freq")
                    and not (n == "lm_head.weight" and ckpt.args.tie_word_embeddings))
    if unused:
        raise CheckpointError(f"{ckpt.path}: {len(unused)} tensor(s) of the checkpoint are not used by the model "
                              f"config.json describes, e.g. {unused[0]!r} (in {src.files[unused[0]].name}); "
                              f"check num_hidden_layers ({ckpt.args.num_hidden_layers}), the architecture and "
                              "its bias options")


def check_weights(ckpt: Checkpoint, allow_pickle: bool = False) -> None:
    """Every tensor the model needs is present, readable and of the right shape (headers only: cheap).
    ``leapfrog train-draft`` runs it on the target before any training."""
    _plan(ckpt, allow_pickle)


def _shard_part(src: _TensorSource, ours: str, hf_names: list[str], shard: Shard) -> Tensor:
    """This rank's part of parameter ``ours`` (parallel/shard.py), read slice by slice."""
    a, hd = shard.args, shard.args.head_dim
    leaf = ours.rsplit(".", 2)[-2:]
    if ours in ("embed.weight", "lm_head.weight"):   # vocabulary rows, zero padding past the vocabulary
        r = shard.vocab
        part = src.get_part(hf_names[0], rows=(r.start, min(r.stop, a.vocab_size)))
        return torch.cat([part, part.new_zeros(len(r) - part.shape[0], part.shape[1])])
    if leaf[0] == "wqkv":   # column-parallel: this rank's query heads, then its KV heads' k and v
        q, k, v = hf_names
        kv = shard.rows(shard.kv_heads, hd)
        return torch.cat([src.get_part(q, rows=shard.rows(shard.heads, hd)), src.get_part(k, rows=kv),
                          src.get_part(v, rows=kv)])
    if leaf[0] == "w13":   # column-parallel: gate rows, then up rows, of this rank's channels
        i = shard.rows(shard.intermediate, 1)
        return torch.cat([src.get_part(n, rows=i) for n in hf_names])
    if ours.endswith("wo.weight"):   # row-parallel: the input columns of this rank's heads
        return src.get_part(hf_names[0], cols=shard.rows(shard.heads, hd))
    if ours.endswith("wo.bias"):     # added once: by rank 0 (the others add zeros to the sum)
        b = src.get(hf_names[0])
        return b if shard.rank == 0 else torch.zeros_like(b)
    if ours.endswith("w2.weight"):   # row-parallel: this rank's intermediate channels
        return src.get_part(hf_names[0], cols=shard.rows(shard.intermediate, 1))
    return src.get(hf_names[0])      # norms: replicated


def load_model(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, max_positions: int,
               allow_pickle: bool = False, pack: bool = False, quantization: str | None = None,
               tp: TPGroup | None = None, load_format: str = "auto", seed: int = 0) -> LlamaModel:
    """Build the model on ``meta``, then fill every parameter from the checkpoint, checking shapes;
    ``quantization`` ("int8" / "int4", model/quant.py) quantizes the decoder layers' linears.
    ``tp``: build and fill only this rank's shard (each tensor's part is read from the file alone).
    ``load_format="dummy"``: no files read; random weights from ``seed`` (see ``fill_random``)."""
    dummy = load_format == "dummy"
    if dummy and tp is not None:
        raise ValueError("load_format='dummy' builds a whole model (no tensor parallelism)")
    if not dummy:
        src, plan = _plan(ckpt, allow_pickle)   # checked against the whole model's shapes
    with torch.device("meta"):
        model = LlamaModel(ckpt.args, max_positions=1, tp=tp)
    model = model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        if dummy:
            fill_random(params, float(ckpt.config.get("initializer_range", 0.02)), seed)
        else:
            for ours, hf_names in plan.items():
                part = _read_whole(src, hf_names) if tp is None else _shard_part(src, ours, hf_names, tp.shard)
                params[ours].copy_(part.to(dtype))
    cos, sin = rope_table(ckpt.args.rope, ckpt.args.head_dim, ckpt.args.max_position_embeddings, max_positions)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model = model.eval().requires_grad_(False)
    if quantization is not None:
        model.quantize(quantization)
    if pack:
        model.pack_for_inference()
    return model


def fill_random(params: dict[str, Tensor], std: float, seed: int) -> None:
    """Random weights in place (``load_format="dummy"``, a model shape without a checkpoint): the
    norms' weights 1, every other parameter normal(0, std) (what Hugging Face's initialisation
    gives a Llama), drawn on the parameters' device from a generator seeded with ``seed``."""
    for name, p in sorted(params.items()):
        if "norm" in name:
            p.fill_(1.0)
        else:
            gen = torch.Generator(device=p.device).manual_seed(seed)
            seed += 1
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device).mul_(std))


def load_whole(ckpt: Checkpoint, names: tuple[str, ...], dtype: torch.dtype, device: torch.device,
               allow_pickle: bool = False) -> dict[str, Tensor]:
    """Some of the model's parameters, whole, by our names (e.g. "embed.weight", "lm_head.weight";
    a name the architecture lacks, such as a tied model's LM head, is left out): what rank 0 of a
    tensor-parallel group reads beside its shard for a drafter that needs the whole vocabulary."""
    src, plan = _plan(ckpt, allow_pickle, names)
    return {ours: _read_whole(src, hf).to(device=device, dtype=dtype) for ours, hf in plan.items()}


def _read_whole(src: _TensorSource, hf_names: list[str]) -> Tensor:
    """One parameter: its HF tensors fused along dim 0 (no copy for a single tensor)."""
    parts = [src.get(n) for n in hf_names]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


#: files a tokenizer is built from; one of them must be present (tokenizer_config.json alone is not enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "*.tiktoken")
#: JSON files transformers reads for a tokenizer; checked first so a corrupt one is named.
_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json")


def tokenizer_files(path: Path) -> list[str]:
    """The names of the files in directory ``path`` that a tokenizer can be built from (TOKENIZER_FILES)."""
    return sorted({f.name for pattern in TOKENIZER_FILES for f in path.glob(pattern)})


def check_tokenizer_vocab(tokenizer: Any, vocab_size: int, where: str) -> None:
    """A tokenizer whose own vocabulary (added tokens aside) is larger than the model's, or whose
    BOS or EOS lies past it, belongs to another model: a CheckpointError at load, not prompts
    refused (or decoded wrong) one by one. Added tokens past the model's vocabulary are left to
    the per-request check (some checkpoints list unused ones)."""
    base = getattr(tokenizer, "vocab_size", None)
    if isinstance(base, int) and base > vocab_size:
        raise CheckpointError(f"tokenizer {where} has {base} tokens but the model's vocabulary has {vocab_size} "
                              "(vocab_size in config.json): it belongs to another model; pass this model's own "
                              "tokenizer (tokenizer=, CLI --tokenizer)")
    for attr in ("bos_token_id", "eos_token_id"):   # (the ones the engine adds or stops at)
        t = getattr(tokenizer, attr, None)
        if isinstance(t, int) and not 0 <= t < vocab_size:
            raise CheckpointError(f"tokenizer {where}: its {attr} {t} is outside the model's vocabulary "
                                  f"(vocab_size {vocab_size} in config.json): it belongs to another model")


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a local directory or hub id through transformers (fast tokenizer, chat template).

    A directory with no tokenizer files (a weights-only checkpoint) is a CheckpointError that says
    so and gives both ways on; a present but broken file is named."""
    from transformers import AutoTokenizer
    p = Path(path).expanduser()
    if p.is_file():
        raise CheckpointError(f"tokenizer {p} is a file; pass the directory that holds it "
                              "(tokenizer.json, tokenizer_config.json, ...)")
    found: list[str] = []
    if not p.is_dir():   # a hub id: fetched the way models are (one quick failure offline, no retries)
        p = resolve_model_path(path, "tokenizer")
    if p.is_dir():
        found = tokenizer_files(p)
        if not found:
            others = sorted(f.name for f in p.glob("*token*"))
            raise CheckpointError(
                f"{p}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}"
                + (f"; found only {', '.join(others)}" if others else "") + "). "
                "Pass tokenizer=<directory or hub id> (CLI: --tokenizer) to use a tokenizer stored elsewhere, "
                "or skip_tokenizer_init=True (leapfrog serve/check: --skip-tokenizer-init) and give prompts "
                "as token ids ({'prompt_token_ids': [...]})")
        for name in _TOKENIZER_JSON:
            if (p / name).is_file():
                read_json(p / name)
    try:
        return AutoTokenizer.from_pretrained(str(p) if p.is_dir() else str(path))
    except Exception as e:  # noqa: BLE001 (tokenizers raises plain Exception; sentencepiece, OSError, ...)
        where = f"{p}: could not load the tokenizer from {', '.join(found)}" if found else (
            f"tokenizer {str(path)!r}: not a local directory, and loading it as a hub id failed")
        raise CheckpointError(f"{where}: {type(e).__name__}: {e}") from None
