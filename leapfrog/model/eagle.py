"""EAGLE draft heads (EAGLE-1 and EAGLE-3) as models, and their checkpoints in the layouts the field uses.

An EAGLE head is a small Llama decoder (one layer, typically) that drafts from the target's hidden
states ("features") as well as from tokens. Two kinds share this module's code:

kind "eagle" (EAGLE-1; the EAGLE authors' release layout, SafeAILab/EAGLE ``eagle/model/cnets1.py``;
also what vLLM ``llama_eagle.py`` and SGLang ``llama_eagle.py`` load)::

    x = fc(cat[embed(token), f])       f: the target's final-norm hidden state (ForwardOutput.hidden)
    h = layers(x)                      layer 0 has no input_layernorm (its input is fc's output)
    logits = target LM head(h)         no norm in between (cnets1: ``head(last_hidden)``)

    tensors: fc.weight [H, 2H], fc.bias [H] (config "bias", default true), layers.{i}.self_attn.
    {q,k,v,o}_proj.weight, layers.{i}.mlp.{gate,up,down}_proj.weight, layers.{i}.post_attention_layernorm
    .weight, layers.{i}.input_layernorm.weight (i > 0 only), embed_tokens.weight [V, H] (optional: without
    it the target's embedding is shared). config.json: a LlamaConfig, architectures ["LlamaForCausalLM"].

kind "eagle3" (EAGLE-3; the layout of the authors' ``eagle/model/cnets.py`` that vLLM ``llama_eagle3.py``
and SGLang ``llama_eagle3.py`` load)::

    h0 = fc(cat[a_low, a_mid, a_high])  three target layers' residual streams (target_layer_ids), 3Ht -> H;
                                        at later draft steps the head's own output (width H) is fed back
                                        and fc is skipped (cnets.py: fc only when the width is not H)
    r = h0                              (norm_before_residual, a vLLM/speculators variant: r = hidden_norm(h0))
    x = r + attn(cat[input_layernorm(embed(token)), hidden_norm(h0)])   q/k/v read 2H
    h = x + mlp(post_attention_layernorm(x))                            fed back at the next step
    logits = lm_head(norm(h))           over the draft vocabulary; target id = draft id + d2t[draft id]

    tensors: midlayer.self_attn.{q,k,v}_proj.weight [., 2H], midlayer.self_attn.o_proj.weight,
    midlayer.mlp.{gate,up,down}_proj.weight, midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}
    .weight, fc.weight [H, 3Ht] (no bias unless config "bias"), norm.weight, lm_head.weight [Vd, H],
    d2t [Vd] int64 offsets, t2d [V] bool, embed_tokens.weight (optional). config.json: architectures
    ["LlamaForCausalLMEagle3"], vocab_size (the target's), draft_vocab_size, target_hidden_size (default
    hidden_size), eagle_aux_hidden_state_layer_ids / eagle_config (below), norm_before_residual.

Which target layers (``target_layer_ids``), in leapfrog's terms: ``LlamaModel.forward(...,
aux_layers=(i, ...))`` returns the residual-stream OUTPUT of layer i. The field writes them two ways:

    vLLM (top-level ``eagle_aux_hidden_state_layer_ids``; the EAGLE authors' and vLLM's default
    (2, L//2, L-3)): captured BEFORE layer id runs = HF ``hidden_states[id]`` = output of layer id-1.
    SpecForge/SGLang (``eagle_config.eagle_aux_hidden_state_layer_ids``): the output of layer id
    (SGLang adds 1 to capture it before the next layer).

    Worked example, a 32-layer target with the default: vLLM ids (2, 16, 29) = SpecForge ids (1, 15, 28)
    = leapfrog aux_layers (1, 15, 28). vLLM id 0 would be the token embedding (no leapfrog layer).

A saved head carries both fields, consistently. EAGLE-1 needs no aux layers: its feature is the
target's final-norm hidden state (cnets1's input is ``base_model.model(...)[0]``, after the norm).

Forward contract (padded batches, KV cache and tree masks exactly as for model/llama.py; the head's
layers are its KV cache's layers 0..n-1, sized by ``head.args``)::

    forward(token_ids [B, S], features [B, S, F], positions [B, S], kv, attn) -> ForwardOutput
        .hidden [B, S, H] (head dtype): compute_logits reads it, and it is the next step's feature
        .aux    []        (the head exposes no inner layers)
    compute_logits(hidden [N, H]) -> [N, V] float32, -inf outside the draft vocabulary (target ids)

Alignment (the caller's; EAGLE's convention, vLLM's shift of the tokens left by one with the sampled
token appended): row t pairs token x_{t+1} with feature f_t at position t; its output h_t stands for f_{t+1}:

    target:  tokens x0 x1 x2   -> features f0 f1 f2 (and it samples x3)
    head:    tokens x1 x2 x3      features f0 f1 f2   positions 0 1 2   -> h0 h1 h2; logits(h2) drafts x4
    next:    token  x4            feature  h2         position  3       -> h3; logits(h3) drafts x5
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leapfrog.attention.backend import attend
from leapfrog.attention.metadata import AttnMeta
from leapfrog.errors import CheckpointError, ConfigError
from leapfrog.kv.cache import KVCache
from leapfrog.model.args import LlamaArgs, config_field, json_type
from leapfrog.model.llama import DecoderLayer, ForwardOutput, LlamaModel, LogitsHead
from leapfrog.model.loader import _TensorSource, _weight_files, check_stored_dtype, read_json, resolve_model_path
from leapfrog.model.native_ops import rms_norm, use_native_ops
from leapfrog.model.rope import apply_rope, rope_table

EagleKind = Literal["eagle", "eagle3"]
#: config.json architectures[0] per kind (vLLM and SGLang class names too). "LlamaForCausalLM" is the
#: EAGLE-1 release name; a checkpoint with ``midlayer.*`` tensors is EAGLE-3 whatever it is called.
EAGLE_ARCHITECTURES = ("LlamaForCausalLM", "EagleLlamaForCausalLM", "LlamaForCausalLMEagle")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-weights some old transformers versions saved


def aux_layers_from_vllm(ids: Sequence[int]) -> tuple[int, ...]:
    """vLLM's ``eagle_aux_hidden_state_layer_ids`` (captured before layer id) -> leapfrog aux layers."""
    return tuple(int(i) - 1 for i in ids)


def aux_layers_to_vllm(layers: Sequence[int]) -> tuple[int, ...]:
    """leapfrog aux layers (output of layer i) -> vLLM's ``eagle_aux_hidden_state_layer_ids``."""
    return tuple(int(i) + 1 for i in layers)


def default_eagle3_layers(num_target_layers: int) -> tuple[int, ...]:
    """The EAGLE authors' / vLLM's / SpecForge's low, middle and high layers, as leapfrog aux layers:
    vLLM (2, L//2, L-3) -> (1, L//2 - 1, L - 4), which needs L >= 7 for three distinct layers;
    shallower targets (3 <= L < 7) take the first, middle and last layers (0, L//2, L-1)."""
    L = num_target_layers
    if L >= 7:
        return aux_layers_from_vllm((2, L // 2, L - 3))
    if L >= 3:
        return (0, L // 2, L - 1)
    raise ConfigError(f"EAGLE-3 fuses three target layers; this target has {L} (give target_layer_ids "
                      "explicitly only if you know what you are doing, or use EAGLE-1)")


@dataclass(frozen=True)
class EagleConfig:
    """What an EAGLE head adds to its decoder's LlamaArgs (whose vocab_size is the target's)."""

    kind: EagleKind
    target_hidden_size: int             # Ht, the width of one target feature
    draft_vocab_size: int               # Vd (EAGLE-1: the target's vocabulary)
    target_layer_ids: tuple[int, ...] = ()  # leapfrog aux layers, ascending; () = final-norm hidden (EAGLE-1)
    fc_bias: bool = False
    norm_before_residual: bool = False  # EAGLE-3 variant: the residual is hidden_norm(h), not h
    # leapfrog's greedy calibration (train/eagle.py): lm_head was scaled by this after training;
    # sampled drafting divides it back out, since q as trained (close to p) drafts best there
    greedy_logit_scale: float = 1.0

    @property
    def feature_size(self) -> int:
        """F: the width of the features the target gives the head (EAGLE-3: len(ids) * Ht)."""
        return self.target_hidden_size * max(1, len(self.target_layer_ids))


class EagleLayer(DecoderLayer):
    """A Llama decoder layer in one of three forms: "plain"; "no_input_norm" (EAGLE-1 layer 0, whose
    input is fc's output); "eagle3" (the midlayer: q/k/v read cat[input_layernorm(embed),
    hidden_norm(h)], 2H wide). Parameter names as in DecoderLayer, plus ``hidden_norm``."""

    def __init__(self, a: LlamaArgs, form: Literal["plain", "no_input_norm", "eagle3"],
                 norm_before_residual: bool = False) -> None:
        super().__init__(a)
        self.form = form
        self.norm_before_residual = norm_before_residual
        if form == "no_input_norm":
            self.attn_norm = None
        elif form == "eagle3":
            self.wqkv = nn.Linear(2 * a.hidden_size, a.q_size + 2 * a.kv_size, bias=self.wqkv.bias is not None)
            self.hidden_norm = nn.Parameter(torch.ones(a.hidden_size))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, kv: KVCache | None,  # type: ignore[override]
                attn: AttnMeta | None, keep: Tensor | None = None, embeds: Tensor | None = None) -> Tensor:
        """As DecoderLayer.forward (``keep``: the tokens whose output is read, the others' keys and
        values cached only); ``embeds``: the token embeddings (EAGLE-3)."""
        a = self.a
        B, S, _ = x.shape
        if self.form == "eagle3":
            assert embeds is not None
            h = rms_norm(x, self.hidden_norm, a.rms_norm_eps, self.native_ops)
            if self.norm_before_residual:
                x = h
            h = torch.cat((rms_norm(embeds, self.attn_norm, a.rms_norm_eps, self.native_ops), h), dim=-1)  # [B, S, 2H]
        else:
            h = x if self.attn_norm is None else rms_norm(x, self.attn_norm, a.rms_norm_eps, self.native_ops)
        q, k, v = self.wqkv(h).split((a.q_size, a.kv_size, a.kv_size), dim=-1)
        q = apply_rope(q.view(B, S, a.num_attention_heads, a.head_dim), cos, sin, self.native_ops)
        k = apply_rope(k.view(B, S, a.num_key_value_heads, a.head_dim), cos, sin, self.native_ops)
        o = attend(q, k, v.view(B, S, a.num_key_value_heads, a.head_dim), layer, kv, attn)  # [B, S, Hq, Dh]
        return self._after_attention(x, o, keep)   # (a head has no tensor-parallel group: no reduce)


@dataclass
class _TargetRef:
    """The bound target, held outside nn.Module's registry (its weights are not the head's)."""

    model: LlamaModel

    def __deepcopy__(self, memo: dict) -> _TargetRef:
        return self  # a copied head (an EMA copy, say) shares the target rather than copying it


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 draft head; see the module docstring for the math and the contract.

    Build one with :func:`load_eagle_head` or :func:`init_eagle_head`. The head shares the target's
    embedding when it has none of its own and, for EAGLE-1, the target's LM head: both through
    :meth:`bind_target`, which the loader calls."""

    keeps_rows = True   # forward takes keep_rows (model/runner.py: the eager catch-up on a prompt)

    def __init__(self, args: LlamaArgs, cfg: EagleConfig, own_embedding: bool,
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.args, self.cfg = args, cfg
        H = args.hidden_size
        if cfg.kind == "eagle3" and cfg.feature_size == H:
            raise ConfigError(f"EAGLE-3 head: target features ({cfg.feature_size} wide) cannot be told apart from "
                              f"the head's own hidden state (hidden_size={H}), so fc could not be applied")
        self.embed = nn.Embedding(args.vocab_size, H) if own_embedding else None
        self.fc = nn.Linear(2 * H if cfg.kind == "eagle" else cfg.feature_size, H, bias=cfg.fc_bias)
        if cfg.kind == "eagle":
            self.layers = nn.ModuleList([EagleLayer(args, "plain" if i else "no_input_norm")
                                         for i in range(args.num_hidden_layers)])
            self.norm, self.lm_head = None, None
        else:
            self.layers = nn.ModuleList([EagleLayer(args, "eagle3", cfg.norm_before_residual)])
            self.norm = nn.Parameter(torch.ones(H))
            self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
            Vd, V = cfg.draft_vocab_size, args.vocab_size
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))      # [Vd] target id - draft id
            self.register_buffer("t2d", torch.arange(V) < Vd)                   # [V] in the draft vocabulary
            self.register_buffer("draft_ids", torch.arange(Vd), persistent=False)  # [Vd] target id per draft id
        self.identity_vocab = cfg.draft_vocab_size == args.vocab_size  # draft id == target id
        self.set_rope(max_positions or args.max_position_embeddings)
        self.head: LogitsHead | None = None  # EAGLE-3 inference LM head (pack_for_inference)
        self.packed = False
        self.native_ops = False   # the final norm as a C++ op (pack_for_inference: use_native_ops)
        self._target: _TargetRef | None = None

    # ------------------------------------------------------------------ properties and binding
    @property
    def kind(self) -> EagleKind:
        return self.cfg.kind

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """The target's aux_layers this head reads (() for EAGLE-1: the final-norm hidden state)."""
        return self.cfg.target_layer_ids

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].mlp_norm.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].mlp_norm.device

    def set_rope(self, max_positions: int) -> None:
        """(Re)build the cos/sin tables for positions 0..max_positions-1 (float32, like LlamaModel)."""
        a = self.args
        cos, sin = rope_table(a.rope, a.head_dim, a.max_position_embeddings, max_positions)
        if not cos.is_meta:  # (built on meta inside the loader, which calls this again once on a device)
            cos, sin = cos.to(self.device), sin.to(self.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def bind_target(self, target: LlamaModel) -> None:
        """Share ``target``'s embedding (when the head has none) and, for EAGLE-1, its LM head."""
        t, a, c = target.args, self.args, self.cfg
        problems = [msg for bad, msg in (
            (t.vocab_size != a.vocab_size, f"vocab_size {a.vocab_size} vs the target's {t.vocab_size}"),
            (t.hidden_size != c.target_hidden_size, f"{c.target_hidden_size}-wide features vs the target's "
                                                     f"hidden_size {t.hidden_size}"),
            (self.embed is None and t.hidden_size != a.hidden_size, "no embedding of its own to use at its width"),
            (any(i >= t.num_hidden_layers for i in c.target_layer_ids),
             f"target_layer_ids {c.target_layer_ids} beyond the target's {t.num_hidden_layers} layers")) if bad]
        if problems:
            raise ConfigError("EAGLE head does not fit the target: " + "; ".join(problems))
        self._target = _TargetRef(target)

    def _bound(self) -> LlamaModel:
        if self._target is None:
            raise ConfigError("the EAGLE head is not bound to a target: call head.bind_target(target) "
                              "(load_eagle_head does)")
        return self._target.model

    # ------------------------------------------------------------------ vocabulary
    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """EAGLE-3: the draft vocabulary as target ids (``target_ids[d]`` = target id of draft id d,
        distinct). Sets d2t = target_ids - arange and t2d, the checkpoint's two tensors."""
        if self.kind != "eagle3":
            raise ConfigError("only EAGLE-3 heads have a draft vocabulary of their own")
        V, Vd = self.args.vocab_size, self.cfg.draft_vocab_size
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten().to(self.d2t.device)
        if ids.numel() != Vd:
            raise ConfigError(f"draft vocabulary: {ids.numel()} target ids given, draft_vocab_size is {Vd}")
        if int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != Vd:
            raise ConfigError(f"draft vocabulary: target ids must be distinct and in [0, {V})")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(Vd, device=ids.device))
            self.t2d.zero_()
            self.t2d[ids] = True
            self.draft_ids = ids
        self.identity_vocab = Vd == V and bool((self.d2t == 0).all())

    @property
    def own_vocab(self) -> Tensor | None:
        """The target ids [Vd] of an EAGLE-3 head's reduced vocabulary, where compiled drafting picks
        (model/compiled.py CompiledChain.vocab); None when the head drafts over the target's."""
        return None if self.kind != "eagle3" or self.identity_vocab else self.draft_ids

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids (any shape) -> target ids: ``draft_id + d2t[draft_id]``."""
        return draft_ids if self.identity_vocab else self.draft_ids[draft_ids]

    # ------------------------------------------------------------------ forward and logits
    def target_features(self, out: ForwardOutput) -> Tensor:
        """The target's forward output -> this head's ``features`` [B, S, F]: EAGLE-1 the final-norm
        hidden state; EAGLE-3 the aux states concatenated, the target having been run with
        ``aux_layers=head.target_layer_ids`` (LlamaModel returns them in ascending layer order)."""
        if self.kind == "eagle":
            return out.hidden
        if len(out.aux) != len(self.cfg.target_layer_ids):
            raise ValueError(f"EAGLE-3 needs {len(self.cfg.target_layer_ids)} aux states, got {len(out.aux)}: "
                             f"run the target with aux_layers={self.cfg.target_layer_ids}")
        return torch.cat(out.aux, dim=-1)

    def combine_target_features(self, features: Tensor) -> Tensor:
        """EAGLE-3's fc: target features [..., 3Ht] -> [..., H] (forward applies it itself to any
        feature of width F != H). EAGLE-1 fuses the feature with the token embedding inside forward,
        so its features pass through unchanged."""
        features = features.to(self.dtype)
        return features if self.kind == "eagle" else self.fc(features)

    def forward(self, token_ids: Tensor, features: Tensor, positions: Tensor, kv: KVCache | None = None,
                attn: AttnMeta | None = None, keep_rows: Tensor | None = None) -> ForwardOutput:
        """token_ids, positions [B, S]; features [B, S, F] (target features, or for EAGLE-3 also the
        head's own previous hidden [B, S, H]); kv/attn as for LlamaModel (None: causal over S).
        ``keep_rows``: as LlamaModel's (the head catching up on a prompt caches every position's
        keys and values, and reads the output state of its last position at most) -> hidden
        [1, len(keep_rows), H]."""
        H = self.args.hidden_size
        width = features.shape[-1]
        allowed = (self.cfg.target_hidden_size,) if self.kind == "eagle" else (self.cfg.feature_size, H)
        if width not in allowed:
            raise ValueError(f"{self.kind} head: features are {width} wide, expected one of {allowed}")
        e = self._embed(token_ids)                                   # [B, S, H]
        f = features.to(e.dtype)
        cos = self.rope_cos[positions].to(e.dtype).unsqueeze(2)     # [B, S, 1, Dh]
        sin = self.rope_sin[positions].to(e.dtype).unsqueeze(2)
        if self.kind == "eagle":
            x = self.fc(torch.cat((e, f), dim=-1))                   # [B, S, 2H] -> [B, S, H]
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, i, kv, attn, keep=keep_rows if i == len(self.layers) - 1 else None)
        else:
            x = f if width == H else self.fc(f)                      # fc only on raw target features
            x = self.layers[0](x, cos, sin, 0, kv, attn, keep=keep_rows, embeds=e)
        return ForwardOutput(hidden=x)

    def _embed(self, token_ids: Tensor) -> Tensor:
        if self.embed is not None:
            return self.embed(token_ids)
        return F.embedding(token_ids, self._bound().embed.weight).to(self.dtype)

    def compute_draft_logits(self, hidden: Tensor, graph: bool = False) -> Tensor:
        """hidden [N, H] -> logits [N, Vd] float32 over the draft vocabulary (EAGLE-1: Vd = V).
        ``graph``: inside a compiled graph (no host sync: EAGLE-1's target head unchecked)."""
        if self.kind == "eagle":
            t = self._bound()
            return t.graph_logits(hidden) if graph else t.compute_logits(hidden)
        assert self.norm is not None
        h = rms_norm(hidden.float(), self.norm.float(), self.args.rms_norm_eps, self.native_ops)
        if self.head is not None:
            return self.head(h)
        assert self.lm_head is not None  # training / reference path: differentiable
        return F.linear(h, self.lm_head.weight.float())

    def compute_logits(self, hidden: Tensor, graph: bool = False) -> Tensor:
        """hidden [N, H] -> logits [N, V] float32 over the target vocabulary, -inf outside the draft
        vocabulary, so the engine's one sampler works in target-vocabulary space."""
        return self.spread_logits(self.compute_draft_logits(hidden, graph))

    def spread_logits(self, logits: Tensor) -> Tensor:
        """Draft-vocabulary logits [N, Vd] -> [N, V] over the target's vocabulary, -inf elsewhere."""
        if self.identity_vocab:
            return logits
        out = logits.new_full((logits.shape[0], self.args.vocab_size), float("-inf"))
        out[:, self.draft_ids] = logits
        return out

    def graph_logits(self, hidden: Tensor) -> Tensor:
        """compute_logits inside a compiled graph (model/compiled.py)."""
        return self.compute_logits(hidden, graph=True)

    def check_logits(self, logits: Tensor) -> None:
        """Nothing to check: a head's logits only steer proposals (and are -inf outside an EAGLE-3
        draft vocabulary); the target's own logits decide every token."""

    # ------------------------------------------------------------------ inference, size
    def pack_for_inference(self, fp32_head: bool = True, pack_layers: bool = True) -> bool:
        """As LlamaModel.pack_for_inference: oneDNN-packed linear layers where the CPU supports the
        dtype, and (EAGLE-3) the inference LM head, float32 logits unless ``fp32_head=False``.
        EAGLE-1's logits come from the target's head as the target was packed. The head can no
        longer be trained or saved afterwards. ``pack_layers=False``: plain linears and head (a
        compiled graph prepacks them itself), except bf16 weights on AVX-512 BF16, which take the
        linear kernel (model/native_linear.py). -> whether the linear layers were packed."""
        from leapfrog.model.packed import can_pack, graph_linear, inference_linear, native_linears, pack_linears
        packed = pack_layers and can_pack(self.dtype, self.device)
        fc_float = isinstance(self.fc, nn.Linear)   # (not quantized)
        if packed and not self.packed:
            pack_linears(self.layers)
            if fc_float:
                self.fc = inference_linear(self.fc.weight, self.fc.bias)
        elif not self.packed:  # compiled graphs: the bf16 kernel (if any) as an op
            native_linears(self.layers)
            if fc_float:
                self.fc = graph_linear(self.fc.weight, self.fc.bias)
        if self.lm_head is not None:
            self.head = LogitsHead(self.lm_head.weight, fp32_head, pack=pack_layers)
            self.lm_head = None
        self.packed = True
        use_native_ops(self, self.device)
        return packed

    def quantize(self, method: str) -> int:
        """Weight-only ``method`` ("int8" / "int4", model/quant.py) for the head's linears: fc, the
        decoder layer and (EAGLE-3) its own LM head; an EAGLE-1 head's logits stay the target's.
        Before ``pack_for_inference``; inference only. q only ranks candidates (the target's logits
        decide every token), so a quantized head changes what is accepted, never the output.
        -> linears quantized."""
        from leapfrog.model.quant import QUANT_LINEARS, quantize_linears
        if self.packed:
            raise RuntimeError("EagleHead.quantize after pack_for_inference: quantize first")
        n = quantize_linears(self.layers, method)
        if isinstance(self.fc, nn.Linear):
            self.fc, n = QUANT_LINEARS[method](self.fc.weight, self.fc.bias), n + 1
        if self.lm_head is not None:
            self.head, self.lm_head, n = LogitsHead(self.lm_head.weight, fp32=False, quantization=method), None, n + 1
        return n

    def num_parameters(self) -> int:
        """The head's own parameters (shared target weights excluded; count before packing)."""
        return sum(p.numel() for p in self.parameters())


# ---------------------------------------------------------------------------- checkpoint layout

def _checkpoint_names(head: EagleHead) -> dict[str, list[str]]:
    """our parameter name -> the release-layout tensors concatenated (dim 0) into it."""
    names: dict[str, list[str]] = {"fc.weight": ["fc.weight"], "fc.bias": ["fc.bias"],
                                   "embed.weight": ["embed_tokens.weight"], "norm": ["norm.weight"],
                                   "lm_head.weight": ["lm_head.weight"]}
    for i in range(len(head.layers)):
        p, ours = ("midlayer." if head.kind == "eagle3" else f"layers.{i}."), f"layers.{i}."
        qkv = [p + f"self_attn.{x}_proj" for x in "qkv"]
        names.update({
            ours + "wqkv.weight": [n + ".weight" for n in qkv], ours + "wqkv.bias": [n + ".bias" for n in qkv],
            ours + "wo.weight": [p + "self_attn.o_proj.weight"], ours + "wo.bias": [p + "self_attn.o_proj.bias"],
            ours + "w13.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            ours + "w2.weight": [p + "mlp.down_proj.weight"],
            ours + "attn_norm": [p + "input_layernorm.weight"], ours + "hidden_norm": [p + "hidden_norm.weight"],
            ours + "mlp_norm": [p + "post_attention_layernorm.weight"],
        })
    params = dict(head.named_parameters())
    return {k: v for k, v in names.items() if k in params}


def _part_shapes(shape: tuple[int, ...], n: int, a: LlamaArgs) -> list[tuple[int, ...]]:
    """The shapes of the n checkpoint tensors fused (dim 0) into a parameter of ``shape``."""
    if n == 1:
        return [shape]
    rows = (a.q_size, a.kv_size, a.kv_size) if n == 3 else (shape[0] // 2, shape[0] // 2)
    return [(r, *shape[1:]) for r in rows]


def _fill(head: EagleHead, src: _TensorSource, dtype: torch.dtype) -> set[str]:
    """Copy every parameter from ``src``, checking presence and shapes first. -> the names used."""
    params = dict(head.named_parameters())
    plan = _checkpoint_names(head)
    for ours, ck_names in plan.items():
        missing = [n for n in ck_names if n not in src.files]
        if missing:
            raise CheckpointError(f"{src.path}: tensor {missing[0]!r} is missing from the checkpoint "
                                  f"(an {head.kind} head with this config.json needs it)")
        for n, want in zip(ck_names, _part_shapes(tuple(params[ours].shape), len(ck_names), head.args), strict=True):
            src.check_weight_dtype(n)
            if src.shape(n) != want:
                hint = " ([H, 2H] for EAGLE-1, [H, #layer ids * target_hidden_size] for EAGLE-3)" * (n == "fc.weight")
                raise CheckpointError(f"{src.files[n]}: tensor {n!r} has shape {src.shape(n)}, but config.json "
                                      f"and the target give {want}{hint}")
    with torch.no_grad():
        for ours, ck_names in plan.items():
            parts = [src.get(n) for n in ck_names]
            params[ours].copy_((torch.cat(parts) if len(parts) > 1 else parts[0]).to(dtype))
    return {n for names in plan.values() for n in names}


def _read_draft_vocab(src: _TensorSource, cfg: EagleConfig, V: int, cfg_file: str) -> Tensor:
    """EAGLE-3: target id per draft id [Vd], from d2t (and t2d, checked against it when present)."""
    Vd = cfg.draft_vocab_size
    if "d2t" not in src.files:
        if Vd != V:
            raise CheckpointError(f"{src.path}: tensor 'd2t' is missing, and {cfg_file} has draft_vocab_size={Vd} "
                                  f"< vocab_size={V}, so draft ids cannot be mapped to target ids")
        return torch.arange(V)
    where = src.files["d2t"]
    if src.shape("d2t") != (Vd,):
        raise CheckpointError(f"{where}: tensor 'd2t' has shape {src.shape('d2t')}, but {cfg_file} says "
                              f"draft_vocab_size={Vd} (d2t holds one offset per draft token)")
    d2t = src.get("d2t")
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise CheckpointError(f"{where}: tensor 'd2t' is {d2t.dtype}, expected integer offsets")
    ids = torch.arange(Vd) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != Vd:
        raise CheckpointError(f"{where}: tensor 'd2t' maps draft ids outside [0, {V}) or two draft ids to one "
                              "target id (target id = draft id + d2t[draft id])")
    if "t2d" in src.files:
        t2d = src.get("t2d")
        if not isinstance(t2d, Tensor):
            raise CheckpointError(f"{src.files['t2d']}: entry 't2d' is a {type(t2d).__name__}, not a tensor")
        if tuple(t2d.shape) != (V,) or int(t2d.bool().sum()) != Vd or not bool(t2d.bool()[ids].all()):
            raise CheckpointError(f"{src.files['t2d']}: tensor 't2d' (shape {tuple(t2d.shape)}) does not mark "
                                  f"exactly the {Vd} target ids that 'd2t' maps to (expected [{V}] bool)")
    return ids


# ---------------------------------------------------------------------------- config.json

def _read_layer_ids(cfg: dict[str, Any], eagle_config: dict[str, Any], source: str, L: int) -> tuple[int, ...]:
    """leapfrog aux layers from either field (see the module docstring), checked against the target."""
    def ints(obj: dict[str, Any], key: str, name: str) -> list[int] | None:
        v = config_field(obj, key, list, source, default=None, name=name)
        if v is not None and len(v) < 2:   # (an empty list used to mean "the default layers")
            raise CheckpointError(f"{source}: {name}={v}: EAGLE-3 fuses the features of two or more target "
                                  "layers (three in the EAGLE-3 paper: low, middle, high)")
        return None if v is None else [config_field({name: x}, name, int, source) for x in v]

    top = ints(cfg, "eagle_aux_hidden_state_layer_ids", "eagle_aux_hidden_state_layer_ids")
    nested = ints(eagle_config, "eagle_aux_hidden_state_layer_ids", "eagle_config.eagle_aux_hidden_state_layer_ids")
    if top and nested and sorted(aux_layers_from_vllm(top)) != sorted(nested):
        raise CheckpointError(
            f"{source}: eagle_aux_hidden_state_layer_ids={top} (vLLM: hidden state before layer id) and "
            f"eagle_config.eagle_aux_hidden_state_layer_ids={nested} (SGLang: output of layer id) name "
            "different target layers; keep the one the head was trained with")
    if top:
        for i in top:
            if not 1 <= i <= L:
                raise CheckpointError(
                    f"{source}: eagle_aux_hidden_state_layer_ids={top}: id {i} is out of range for a {L}-layer "
                    f"target (vLLM's ids name the hidden state before layer id: 1..{L}; 0, the token "
                    "embedding, is not supported)")
        ids = aux_layers_from_vllm(top)
    elif nested:
        for i in nested:
            if not 0 <= i < L:
                raise CheckpointError(f"{source}: eagle_config.eagle_aux_hidden_state_layer_ids={nested}: layer {i} "
                                      f"is out of range for a {L}-layer target (0..{L - 1})")
        ids = tuple(nested)
    else:
        ids = default_eagle3_layers(L)
        if min(ids) < 0 or len(set(ids)) < len(ids):
            raise CheckpointError(f"{source}: no eagle_aux_hidden_state_layer_ids, and EAGLE-3's default layers "
                                  f"(2, L//2, L-3) are not three distinct layers of a {L}-layer target")
    if len(set(ids)) < len(ids):
        raise CheckpointError(f"{source}: the aux hidden state layer ids {ids} name a layer twice")
    return tuple(sorted(ids))


def read_eagle_config(cfg: Any, source: str, target: LlamaArgs,
                      tensor_names: set[str]) -> tuple[LlamaArgs, EagleConfig]:
    """config.json of an EAGLE head (and its tensor names, for the kind) -> (decoder args, EagleConfig),
    checked against the target; every error names ``source`` and the field."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{source}: must be a JSON object ({{...}}), got {json_type(cfg)}")
    archs = config_field(cfg, "architectures", list, source, default=[])
    arch = config_field({"architectures[0]": archs[0]}, "architectures[0]", str, source) if archs else None
    check_stored_dtype(cfg, source)
    kind: EagleKind
    if arch is not None and arch not in EAGLE3_ARCHITECTURES and arch not in EAGLE_ARCHITECTURES:
        raise CheckpointError(f"{source}: architecture {arch!r} is not an EAGLE head leapfrog reads (EAGLE-1: "
                              f"{', '.join(EAGLE_ARCHITECTURES)}; EAGLE-3: {', '.join(EAGLE3_ARCHITECTURES)})")
    if arch in EAGLE3_ARCHITECTURES or any(n.startswith("midlayer.") for n in tensor_names):
        kind = "eagle3"
    else:
        if "fc.weight" not in tensor_names:
            raise CheckpointError(f"{source}: not an EAGLE head: no 'fc.weight' tensor beside it (a full "
                                  f"{arch or 'Llama'} model? use it as a draft model instead)")
        kind = "eagle"
    if config_field(cfg, "add_para_norm", bool, source, default=False):
        raise CheckpointError(f"{source}: add_para_norm=true (the HASS variant's extra norms) is not supported")
    args = LlamaArgs.from_hf_config({**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}, source)
    if config_field(cfg, "qkv_bias", bool, source, default=False):  # cnets1/vLLM: q/k/v biases, none on o_proj:
        args = replace(args, model_type="qwen2", attention_bias=False)  # DecoderLayer's Qwen2 bias pattern
    H, V = args.hidden_size, args.vocab_size
    if V != target.vocab_size:
        raise CheckpointError(f"{source}: vocab_size={V}, but the target's vocabulary has {target.vocab_size} "
                              "tokens: the head was made for another target")
    if kind == "eagle":
        eagle3_only = [k for k in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids")
                       if k in cfg and not (k == "draft_vocab_size" and cfg[k] == V)]
        eagle3_only += ["eagle_config.eagle_aux_hidden_state_layer_ids"] * bool(
            isinstance(cfg.get("eagle_config"), dict) and "eagle_aux_hidden_state_layer_ids" in cfg["eagle_config"])
        if eagle3_only:
            raise CheckpointError(f"{source}: {', '.join(eagle3_only)}: EAGLE-3 fields in an EAGLE-1 head (it "
                                  "drafts over the whole vocabulary from the target's last hidden state); is the "
                                  "head an EAGLE-3 one (architectures LlamaForCausalLMEagle3, 'midlayer.*')?")
        if H != target.hidden_size:
            raise CheckpointError(f"{source}: hidden_size={H}, but the target's hidden_size is {target.hidden_size}; "
                                  "an EAGLE-1 head reads the target's hidden states, so they must be equal")
        fc_bias = config_field(cfg, "bias", bool, source, default="fc.bias" in tensor_names)
        return args, EagleConfig("eagle", H, V, (), fc_bias)
    if args.num_hidden_layers != 1:
        raise CheckpointError(f"{source}: num_hidden_layers={args.num_hidden_layers}: leapfrog reads one-layer "
                              "EAGLE-3 heads ('midlayer.*'; vLLM and SGLang lay out more layers differently)")
    eagle_config = config_field(cfg, "eagle_config", dict, source, default={})
    if not config_field(eagle_config, "use_aux_hidden_state", bool, source, default=True,
                        name="eagle_config.use_aux_hidden_state"):
        raise CheckpointError(f"{source}: eagle_config.use_aux_hidden_state=false is not supported")
    Ht = config_field(cfg, "target_hidden_size", int, source, default=H, minimum=1)
    if Ht != target.hidden_size:
        raise CheckpointError(f"{source}: target_hidden_size={Ht} (hidden_size when absent), but the target's "
                              f"hidden_size is {target.hidden_size}")
    Vd = config_field(cfg, "draft_vocab_size", int, source, default=V, minimum=1)
    if Vd > V:
        raise CheckpointError(f"{source}: draft_vocab_size={Vd} exceeds vocab_size={V}")
    ids = _read_layer_ids(cfg, eagle_config, source, target.num_hidden_layers)
    return args, EagleConfig("eagle3", Ht, Vd, ids, config_field(cfg, "bias", bool, source, default=False),
                             config_field(cfg, "norm_before_residual", bool, source, default=False),
                             config_field(cfg, "greedy_logit_scale", float, source, default=1.0, minimum=0))


def eagle_config_json(head: EagleHead) -> dict[str, Any]:
    """The config.json of ``head`` in its release layout (read back by read_eagle_config, vLLM, SGLang)."""
    a, c = head.args, head.cfg
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if c.kind == "eagle" else "LlamaForCausalLMEagle3"],
        "model_type": "llama", "hidden_act": "silu", "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size, "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim, "max_position_embeddings": a.max_position_embeddings, "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope.theta, "vocab_size": a.vocab_size, "tie_word_embeddings": False,
        "attention_bias": a.attention_bias, "torch_dtype": _DTYPE_NAMES.get(head.dtype, "float32"),
    }
    if c.fc_bias != (c.kind == "eagle"):  # "bias" only off the authors' default: vLLM's Llama layers read a
        d["bias"] = c.fc_bias             # true "bias" as attention biases, which EAGLE heads do not have
    if a.model_type == "qwen2":
        d["qkv_bias"] = True
    r = a.rope
    if r.rope_type != "default":
        d["rope_scaling"] = {"rope_type": r.rope_type, "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                             "high_freq_factor": r.high_freq_factor,
                             "original_max_position_embeddings": r.original_max_position_embeddings}
    if a.sliding_window is not None:
        d["sliding_window"] = a.sliding_window
    if a.bos_token_id is not None:
        d["bos_token_id"] = a.bos_token_id
    if a.eos_token_ids:
        d["eos_token_id"] = list(a.eos_token_ids) if len(a.eos_token_ids) > 1 else a.eos_token_ids[0]
    if c.kind == "eagle3":
        d.update(draft_vocab_size=c.draft_vocab_size, target_hidden_size=c.target_hidden_size,
                 norm_before_residual=c.norm_before_residual,
                 eagle_aux_hidden_state_layer_ids=list(aux_layers_to_vllm(c.target_layer_ids)),  # vLLM
                 eagle_config={"eagle_aux_hidden_state_layer_ids": list(c.target_layer_ids),   # SGLang
                               "use_aux_hidden_state": True})
        if c.greedy_logit_scale != 1.0:
            d["greedy_logit_scale"] = c.greedy_logit_scale
    return d


# ---------------------------------------------------------------------------- load, save, init

def _resolve(path: str | os.PathLike, allow_pickle: bool) -> Path:
    """As loader.resolve_model_path, but a hub download also fetches pickle weights when allowed
    (EAGLE-1 releases ship pytorch_model.bin only)."""
    p = Path(path).expanduser()
    if p.exists() or not allow_pickle or str(path).count("/") != 1 or str(path).startswith((".", "/", "~")):
        return resolve_model_path(path)
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors", "*.bin"]))
    except Exception as e:  # noqa: BLE001 (offline, unknown repo, gated repo: say which)
        raise CheckpointError(f"EAGLE head {str(path)!r}: not a local directory and the hub download failed: "
                              f"{type(e).__name__}: {e}") from None


def _open_head(path: str | os.PathLike, target_args: LlamaArgs, allow_pickle: bool
               ) -> tuple[Path, _TensorSource, LlamaArgs, EagleConfig]:
    """A head's directory, its tensors (headers only) and its config, checked against the target's."""
    root = _resolve(path, allow_pickle)
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{root}: no config.json (an EAGLE head directory holds config.json and weights)")
    src = _TensorSource(root, _weight_files(root, allow_pickle))
    args, cfg = read_eagle_config(read_json(cfg_file), str(cfg_file), target_args, set(src.files))
    return root, src, args, cfg


def head_fingerprint(path: str | os.PathLike, allow_pickle: bool = False) -> str:
    """A hash of a head's config.json and the weight files the loader reads from it (shards by
    name): the same head wherever it was copied to (a resumed fine-tune must start from it)."""
    root = _resolve(path, allow_pickle)
    h = hashlib.sha256()
    for f in [root / "config.json", *sorted(set(_weight_files(root, allow_pickle).values()))]:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def read_head_config(path: str | os.PathLike, target_args: LlamaArgs, allow_pickle: bool = False) -> EagleConfig:
    """A saved head's EagleConfig (its kind, draft vocabulary size, ...) without reading its weights."""
    return _open_head(path, target_args, allow_pickle)[3]


def load_eagle_head(path: str | os.PathLike, target: LlamaModel, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None, allow_pickle: bool = False,
                    max_positions: int | None = None) -> EagleHead:
    """An EAGLE-1 or EAGLE-3 head from a directory or hub id (config.json + model.safetensors, shards
    with an index, or pytorch_model.bin with ``allow_pickle``), checked against ``target`` and bound
    to it. dtype/device default to the target's; ``max_positions`` (RoPE table length) to the longer
    of the head's max_position_embeddings and the target's table."""
    root, src, args, cfg = _open_head(path, target.args, allow_pickle)
    cfg_file = root / "config.json"
    dtype = dtype or target.dtype
    device = torch.device(device) if device is not None else target.device
    own_embedding = "embed_tokens.weight" in src.files
    if not own_embedding and args.hidden_size != target.args.hidden_size:
        raise CheckpointError(f"{root}: tensor 'embed_tokens.weight' is missing, and the head's hidden_size "
                              f"{args.hidden_size} differs from the target's {target.args.hidden_size}, so the "
                              "target's embedding cannot be shared")
    with torch.device("meta"):
        head = EagleHead(args, cfg, own_embedding, max_positions=1)
    head = head.to_empty(device=device).to(dtype)
    used = _fill(head, src, dtype)
    if cfg.kind == "eagle3":
        head.set_draft_vocab(_read_draft_vocab(src, cfg, args.vocab_size, str(cfg_file)))
        used |= {"d2t", "t2d"}
    unexpected = sorted(n for n in src.files if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise CheckpointError(f"{root}: {len(unexpected)} tensor(s) that the {cfg.kind} layout does not have, "
                              f"e.g. {unexpected[:3]} (another head layout, or more layers than config.json says?)")
    head.set_rope(max_positions or max(args.max_position_embeddings, target.rope_cos.shape[0]))
    head = head.eval().requires_grad_(False)
    head.bind_target(target)
    return head


def save_eagle_head(head: EagleHead, out_dir: str | os.PathLike, with_embedding: bool = False) -> Path:
    """Write config.json + model.safetensors in the release layout of ``head.kind``. The embedding is
    written when the head has its own, or with ``with_embedding`` (the bound target's: the EAGLE
    authors' EAGLE-1 loader wants ``embed_tokens.weight``; vLLM and SGLang share the target's)."""
    from safetensors.torch import save_file
    if head.packed:
        raise ConfigError("save_eagle_head: the head was packed for inference; save it before pack_for_inference")
    params = dict(head.named_parameters())
    tensors: dict[str, Tensor] = {}
    for ours, ck_names in _checkpoint_names(head).items():
        w = params[ours].detach()
        parts = w.split([s[0] for s in _part_shapes(tuple(w.shape), len(ck_names), head.args)])
        tensors.update({n: p.clone().cpu() for n, p in zip(ck_names, parts, strict=True)})
    if with_embedding and head.embed is None:
        tensors["embed_tokens.weight"] = head._bound().embed.weight.detach().to(head.dtype).clone().cpu()
    if head.kind == "eagle3":
        tensors["d2t"], tensors["t2d"] = head.d2t.clone().cpu(), head.t2d.clone().cpu()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(eagle_config_json(head), indent=2) + "\n", encoding="utf-8")
    return out


def init_eagle_head(kind: EagleKind, target_args: LlamaArgs, draft_vocab_size: int | None = None,
                    target_layer_ids: Sequence[int] | None = None, seed: int = 0, *,
                    draft_token_ids: Sequence[int] | None = None, num_layers: int = 1,
                    fc_bias: bool | None = None, own_embedding: bool = False, init_std: float = 0.02,
                    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> EagleHead:
    """A randomly initialised head for a target of ``target_args`` (decoder shapes copied from the
    target; linear weights ~ N(0, init_std), norms 1), unbound: call ``bind_target``.

    target_layer_ids: EAGLE-3 aux layers in leapfrog's convention (default: the field's low/middle/
    high, default_eagle3_layers). draft_token_ids: the target ids of the draft vocabulary (default:
    the first draft_vocab_size ids). fc_bias: default as the authors (EAGLE-1 true, EAGLE-3 false;
    vLLM's EAGLE-1 model has no fc bias and ignores one). num_layers: EAGLE-1 only."""
    t = target_args
    if kind not in ("eagle", "eagle3"):
        raise ConfigError(f"EAGLE head kind {kind!r}: must be 'eagle' or 'eagle3'")
    if kind == "eagle3" and num_layers != 1:
        raise ConfigError("EAGLE-3 heads have one layer (num_layers=1)")
    V = t.vocab_size
    Vd = draft_vocab_size or (len(draft_token_ids) if draft_token_ids is not None else V)
    if kind == "eagle" and Vd != V:
        raise ConfigError("EAGLE-1 heads draft over the target's whole vocabulary (no draft_vocab_size)")
    if not 1 <= Vd <= V:
        raise ConfigError(f"draft_vocab_size={Vd}: must be in 1..{V} (the target's vocab_size)")
    ids: tuple[int, ...] = ()
    if kind == "eagle3":
        ids = tuple(sorted(int(i) for i in (target_layer_ids if target_layer_ids is not None
                                            else default_eagle3_layers(t.num_hidden_layers))))
        if not ids or len(set(ids)) < len(ids) or ids[0] < 0 or ids[-1] >= t.num_hidden_layers:
            raise ConfigError(f"target_layer_ids={ids}: need distinct target layers, 0..{t.num_hidden_layers - 1}")
    # The target's shapes, RoPE and token ids, as a one-layer (num_layers) Llama without biases.
    args = replace(t, model_type="llama", num_hidden_layers=num_layers, attention_bias=False, tie_word_embeddings=False)
    cfg = EagleConfig(kind, t.hidden_size, Vd, ids, (kind == "eagle") if fc_bias is None else fc_bias)
    gen = torch.Generator().manual_seed(seed)
    head = EagleHead(args, cfg, own_embedding)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
            elif name.endswith("bias"):
                p.zero_()
    if kind == "eagle3":
        head.set_draft_vocab(torch.tensor(draft_token_ids) if draft_token_ids is not None else torch.arange(Vd))
    head = head.to(device=device, dtype=dtype)
    head.set_rope(args.max_position_embeddings)  # float32 again (Module.to cast the tables)
    return head
