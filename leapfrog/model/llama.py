"""The Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, SmolLM, TinyLlama).

One class, one forward contract, used for targets and drafts alike:

    forward(token_ids [B, S], positions [B, S], kv, attn) -> ForwardOutput
        .hidden  [B, S, D]  final-norm hidden states of every new token
        .aux     list of [B, S, D] residual-stream outputs of the layers in ``aux_layers``
    compute_logits(hidden [N, D]) -> [N, V]   only for the rows a caller asks for

q/k/v and gate/up projections are fused (``wqkv``, ``w13``) at load time: fewer, larger
matmuls is what keeps the per-token framework overhead low on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leapfrog.attention.metadata import AttnMeta
from leapfrog.kv.cache import KVCache
from leapfrog.model.args import LlamaArgs
from leapfrog.model.rope import apply_rope, rope_table


@dataclass
class ForwardOutput:
    hidden: Tensor                                   # [B, S, D]
    aux: list[Tensor] = field(default_factory=list)  # [B, S, D] per requested layer


class DecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.a = a
        qkv_bias = a.attention_bias or a.model_type == "qwen2"
        o_bias = a.attention_bias and a.model_type == "llama"
        self.wqkv = nn.Linear(a.hidden_size, a.q_size + 2 * a.kv_size, bias=qkv_bias)
        self.wo = nn.Linear(a.q_size, a.hidden_size, bias=o_bias)
        self.w13 = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.w2 = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(a.hidden_size))
        self.mlp_norm = nn.Parameter(torch.ones(a.hidden_size))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, kv: KVCache | None,
                attn: AttnMeta | None) -> Tensor:
        a = self.a
        B, S, _ = x.shape
        h = F.rms_norm(x, (a.hidden_size,), self.attn_norm, a.rms_norm_eps)
        qkv = self.wqkv(h)  # [B, S, q + 2kv]
        q, k, v = qkv.split((a.q_size, a.kv_size, a.kv_size), dim=-1)
        q = apply_rope(q.view(B, S, a.num_attention_heads, a.head_dim), cos, sin)
        k = apply_rope(k.view(B, S, a.num_key_value_heads, a.head_dim), cos, sin)
        v = v.view(B, S, a.num_key_value_heads, a.head_dim)
        if kv is not None:
            assert attn is not None
            keys, values = kv.write_and_read(layer, attn, k, v)  # [B, Hkv, L, D]
            mask = attn.mask
        else:  # no cache (training, reference): plain causal attention over the new tokens
            keys, values, mask = k.transpose(1, 2), v.transpose(1, 2), None
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=kv is None and S > 1,
            enable_gqa=a.num_key_value_heads != a.num_attention_heads,
        )  # [B, H, S, D]
        x = x + self.wo(o.transpose(1, 2).reshape(B, S, a.q_size))
        h = F.rms_norm(x, (a.hidden_size,), self.mlp_norm, a.rms_norm_eps)
        gate, up = self.w13(h).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs, max_positions: int | None = None) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(args) for _ in range(args.num_hidden_layers)])
        self.norm = nn.Parameter(torch.ones(args.hidden_size))
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(
            args.hidden_size, args.vocab_size, bias=False)
        cos, sin = rope_table(args.rope, args.head_dim, args.max_position_embeddings,
                              max_positions or args.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.head: nn.Module | None = None  # packed LM head for inference (see pack_for_inference)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def forward(self, token_ids: Tensor, positions: Tensor, kv: KVCache | None = None,
                attn: AttnMeta | None = None, aux_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """token_ids, positions: [B, S] (positions absolute; padding rows any valid value)."""
        x = self.embed(token_ids)  # [B, S, D]
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(2)  # [B, S, 1, Dh]
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(2)
        aux: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, kv, attn)
            if i in aux_layers:
                aux.append(x)
        hidden = F.rms_norm(x, (self.args.hidden_size,), self.norm, self.args.rms_norm_eps)
        return ForwardOutput(hidden=hidden, aux=aux)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, D] -> logits [N, V] (float32)."""
        if self.head is not None:
            return self.head(hidden).float()
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, w).float()

    def pack_for_inference(self) -> bool:
        """Swap linear layers (and the LM head) for oneDNN-packed ones when the CPU supports the
        dtype; the model can no longer be trained afterwards. -> whether it packed."""
        from leapfrog.model.packed import PackedLinear, can_pack, pack_linears
        if not can_pack(self.dtype, self.device):
            return False
        pack_linears(self.layers)
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        self.head = PackedLinear(w, None)
        self.lm_head = None  # the packed head replaces it (embed stays for the token lookup)
        return True

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
