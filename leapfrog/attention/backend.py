"""Attention over the KV cache: the SDPA reference path, and a batch-invariant one.

The padded path runs one ``scaled_dot_product_attention`` over ``[B, S]`` queries and
``kv_len`` columns with a mask. Its kernel blocks the key axis by the batch's *longest*
sequence and the query axis by S, so the same token can round differently with other
sequences or drafts around it. The batch-invariant path (``AttnMeta.token_cols``) calls SDPA
once per token over exactly the columns it sees, with no mask: the call a lone decode step
makes for that token, so its output cannot depend on the rest of the batch. It costs one
small kernel launch per token and layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from leapfrog.attention.metadata import AttnMeta
from leapfrog.kv.cache import KVCache


def attend(q: Tensor,      # [B, S, H, Dh] new queries (rotated)
           k: Tensor,      # [B, S, Hkv, Dh] new keys (rotated)
           v: Tensor,      # [B, S, Hkv, Dh]
           layer: int, kv: KVCache | None, meta: AttnMeta | None) -> Tensor:  # [B, S, H, Dh]
    """Write the new k/v to the cache and attend; without a cache, causal over the new tokens."""
    gqa = q.shape[2] != k.shape[2]
    if kv is None:  # training, reference: plain causal attention over the new tokens
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=q.shape[1] > 1, enable_gqa=gqa)
        return o.transpose(1, 2)
    assert meta is not None
    if meta.token_cols is None:
        keys, values = kv.write_and_read(layer, meta, k, v)  # [B, Hkv, L, Dh]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=meta.mask,
                                           enable_gqa=gqa)
        return o.transpose(1, 2)
    kv.write(layer, meta, k, v)
    return _per_token(q, layer, kv, meta, gqa)


def _per_token(q: Tensor, layer: int, kv: KVCache, meta: AttnMeta, gqa: bool) -> Tensor:
    B, S, H, Dh = q.shape
    assert meta.token_cols is not None
    outs = []
    for b, s, row, cols in meta.token_cols:
        keys, values = kv.read_cols(layer, row, cols)  # [1, Hkv, n, Dh]
        qt = q[b, s].unsqueeze(1).unsqueeze(0)  # [1, H, 1, Dh]
        outs.append(F.scaled_dot_product_attention(qt, keys, values, enable_gqa=gqa)[0, :, 0])
    o = torch.stack(outs)  # [N, H, Dh]
    if len(outs) == B * S:  # no padding: tokens come in (b, s) order
        return o.view(B, S, H, Dh)
    out = q.new_zeros(B * S, H, Dh)  # padding positions stay zero (their results are never read)
    out[torch.tensor([b * S + s for b, s, _, _ in meta.token_cols], device=q.device)] = o
    return out.view(B, S, H, Dh)
