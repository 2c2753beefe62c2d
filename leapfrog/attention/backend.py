"""Attention over the KV cache: the SDPA reference path, and a batch-invariant one.

The padded path runs one ``scaled_dot_product_attention`` over ``[B, S]`` queries and
``kv_len`` columns with a mask. Its kernel blocks the key axis by the batch's *longest*
sequence and the query axis by S, so the same token can round differently with other
sequences or drafts around it. The batch-invariant path (``AttnMeta.token_cols``) calls SDPA
once per token over exactly the columns it sees, with no mask: the call a lone decode step
makes for that token, so its output cannot depend on the rest of the batch. It costs one
small kernel launch per token and layer.

Single queries in half precision on CPU (``_sdpa``): PyTorch's CPU flash-attention kernel
takes a path for one query row in bf16/fp16 whose cost grows about 3x faster with the context
than for two rows (measured on AVX-512 bf16, 2 threads, 8 heads x 64: 1 row over 1000
columns 450 us, 2 rows 150 us). A lone query is therefore run as two copies of itself and the
first row kept; the row's result is that of the two-row call whenever it runs alone, so batch
invariance (every call of that token has the same shape) is kept.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from leapfrog.attention.metadata import AttnMeta
from leapfrog.kv.cache import KVCache, write_and_read_layer, write_layer


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
    if meta.graph_kv_len is not None:  # inside a compiled graph: one opaque op (see below)
        op = torch.ops.leapfrog_native.cached_attention if meta.native else torch.ops.leapfrog.cached_attention
        return op(q, k, v, kv.k[layer], kv.v[layer], meta.rows, meta.write_rows, meta.write_cols, meta.mask,
                  meta.graph_kv_len)
    if meta.token_cols is None:
        keys, values = kv.write_and_read(layer, meta, k, v)  # [B, Hkv, L, Dh]
        return _sdpa(q.transpose(1, 2), keys, values, meta.mask, gqa).transpose(1, 2)
    kv.write(layer, meta, k, v)
    return _per_token(q, layer, kv, meta, gqa)


def _per_token(q: Tensor, layer: int, kv: KVCache, meta: AttnMeta, gqa: bool) -> Tensor:
    B, S, H, Dh = q.shape
    assert meta.token_cols is not None
    outs = []
    for b, s, row, cols in meta.token_cols:
        keys, values = kv.read_cols(layer, row, cols)  # [1, Hkv, n, Dh]
        qt = q[b, s].unsqueeze(1).unsqueeze(0)  # [1, H, 1, Dh]
        outs.append(_sdpa(qt, keys, values, None, gqa)[0, :, 0])
    o = torch.stack(outs)  # [N, H, Dh]
    if len(outs) == B * S:  # no padding: tokens come in (b, s) order
        return o.view(B, S, H, Dh)
    out = q.new_zeros(B * S, H, Dh)  # padding positions stay zero (their results are never read)
    out[torch.tensor([b * S + s for b, s, _, _ in meta.token_cols], device=q.device)] = o
    return out.view(B, S, H, Dh)


# Registered with torch.library's low-level API: the kernel is called straight from the
# dispatcher (torch.library.custom_op's Python wrapper costs about 100 us per call).
# flexible_layout, as the C++ op (attention/native.py): every path takes inputs of any strides and
# returns a contiguous output, so inductor passes a graph's in-graph metadata (masks, write
# columns: computed once per round or draft step) to every layer as is, instead of a copy per layer.
_LIB = torch.library.Library("leapfrog", "FRAGMENT")
_LIB.define("cached_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
            "Tensor rows, Tensor write_rows, Tensor write_cols, Tensor mask, Tensor kv_len) -> Tensor",
            tags=(torch.Tag.flexible_layout,))


def cached_attention(q: Tensor, k: Tensor, v: Tensor,  # [B, S, H | Hkv, Dh]
                     k_cache: Tensor, v_cache: Tensor,  # one layer's cache [rows + 1, Hkv, max_len, Dh]
                     rows: Tensor,                      # [B]
                     write_rows: Tensor, write_cols: Tensor,  # [B*S]
                     mask: Tensor,                      # [B, 1, S, max_len] bool, read up to kv_len
                     kv_len: Tensor) -> Tensor:         # [] int64 -> [B, S, H, Dh]
    """The padded attention path as one op for compiled graphs (model/compiled.py): every input
    has a fixed shape and the context length is a tensor, so a graph compiled for a bucket serves
    every context length and keeps the static shapes inductor's GEMM kernels need (a dynamic
    context length turns its few-row GEMMs into generic ones).

    On CUDA the op reads no tensor on the host (a CUDA graph replays it: see model/compiled.py
    ``GraphReplay``). With Triton, one kernel writes the new keys and values and reads the rows in
    place over the first ``kv_len`` columns (attention/triton_decode.py). Without it, index writes,
    then the rows are gathered by index and SDPA attends over the cache's whole width, the mask
    hiding the columns past ``kv_len``: that reads ``max_model_len`` columns per row and layer
    whatever the context."""
    if k_cache.is_cuda:
        tri = _triton_decode()
        if tri is not None and tri.supported(q, k_cache, v_cache):   # the kernel writes k, v as well
            out = tri.try_decode_attention(q, k_cache, v_cache, rows, mask, kv_len, (k, v, write_rows, write_cols))
            if out is not None:
                return out
        meta = AttnMeta(rows=rows, write_rows=write_rows, write_cols=write_cols, kv_len=mask.shape[-1], mask=mask)
        write_layer(k_cache, v_cache, meta, k, v)
        keys, values = k_cache.index_select(0, rows), v_cache.index_select(0, rows)   # [B, Hkv, max_len, Dh]
    else:
        L = int(kv_len)
        meta = AttnMeta(rows=rows, write_rows=write_rows, write_cols=write_cols, kv_len=L, mask=mask[..., :L])
        keys, values = write_and_read_layer(k_cache, v_cache, meta, k, v)
    gqa = q.shape[2] != k.shape[2]
    return _sdpa(q.transpose(1, 2), keys, values, meta.mask, gqa).transpose(1, 2).contiguous()


@functools.cache
def _triton_decode():
    """attention/triton_decode.py, or None where Triton is not installed (it comes with CUDA builds of torch)."""
    try:
        from leapfrog.attention import triton_decode
        return triton_decode
    except ImportError:
        return None


_LIB.impl("cached_attention", cached_attention, "CPU")
_LIB.impl("cached_attention", cached_attention, "CUDA")


@torch.library.register_fake("leapfrog::cached_attention", lib=_LIB)
def _(q, k, v, k_cache, v_cache, rows, write_rows, write_cols, mask, kv_len):
    return q.new_empty(q.shape)   # contiguous, as every path returns it (q may come strided)


def _sdpa(q: Tensor,            # [B, H, S, Dh]
          k: Tensor, v: Tensor,  # [B, Hkv, L, Dh]
          mask: Tensor | None,   # [B, 1, S, L] bool or None
          gqa: bool) -> Tensor:  # [B, H, S, Dh]
    """scaled_dot_product_attention, with single half-precision CPU queries run as two rows
    (see the module docstring)."""
    if q.shape[2] == 1 and q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu":
        q2 = torch.cat([q, q], dim=2)  # a copy: a stride-0 expand is slower (measured)
        m2 = None if mask is None else mask.expand(-1, -1, 2, -1)
        return F.scaled_dot_product_attention(q2, k, v, attn_mask=m2, enable_gqa=gqa)[:, :, :1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
