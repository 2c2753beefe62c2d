"""Attention over the KV cache for CUDA graphs, as one Triton kernel (the GPU's compiled path).

The compiled graphs' attention op (attention/backend.py ``cached_attention``) must not read a
tensor on the host inside a CUDA graph, so without this kernel it gathers each sequence's cache
row (``index_select``: a copy of the row) and runs SDPA over the cache's whole width, masked:
the cost grows with ``max_model_len`` and the batch, not with the context. This kernel reads the
rows in place and only the first ``kv_len`` columns (a device tensor: the loop bound is loaded
in the kernel), applying the graph's mask (causal, tree or sliding window) column by column.
It writes the step's new keys and values into the cache first (one launch per layer where the
index writes took two more: 3.5 us each in an H100 graph, 0.22 ms of a 6.5 ms 8B decode step).

One program per (sequence, KV head, query token): the ``G = H / Hkv`` query heads that share the
KV head are one tile (padded to 16 rows for ``tl.dot``), and the columns are visited in blocks
of ``BLOCK_N`` with an online softmax in float32 (flash attention's recurrence). float32 inputs
multiply in IEEE float32 (no TF32). A query row whose columns are all masked (a padding token)
gets zeros; its result is never read.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

import triton
import triton.language as tl

log = logging.getLogger("leapfrog.attention")


@triton.jit
def _decode_kernel(Q, K, V, Out, ROWS, MASK, KVLEN, KNEW, VNEW, WROWS, WCOLS,
                   sq_b, sq_s, sq_h, sk_r, sk_h, sk_n, so_b, so_s, so_h, sm_b, sm_s, sn_b, sn_s, sn_h,
                   scale, S, R, W, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                   BLOCK_N: tl.constexpr, IEEE: tl.constexpr, WRITE: tl.constexpr):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    row = tl.load(ROWS + b)
    L = tl.load(KVLEN)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    if WRITE:
        # the sequence's S new keys/values of this KV head, into the cache at their (row, column)
        # slots: every program of (b, h) writes all S of them (the same values, so the programs'
        # writes cannot disagree), then a barrier makes them visible to this program's reads. A slot
        # outside the cache's R rows x W columns is not written (index_put's bounds check, which
        # this replaces, would have stopped the step; callers check that the columns fit)
        for t in range(0, S):
            wr = tl.load(WROWS + b * S + t)
            wc = tl.load(WCOLS + b * S + t)
            wrd, wcd = tl.zeros([D], tl.int64) + wr, tl.zeros([D], tl.int64) + wc      # [D] (as vectors: the
            inside = (wrd >= 0) & (wrd < R) & (wcd >= 0) & (wcd < W)                   # interpreter's masks)
            src = b * sn_b + t * sn_s + h * sn_h + d
            dst = wr * sk_r + h * sk_h + wc * sk_n + d
            tl.store(K + dst, tl.load(KNEW + src).to(K.dtype.element_ty), mask=inside)
            tl.store(V + dst, tl.load(VNEW + src).to(V.dtype.element_ty), mask=inside)
        tl.debug_barrier()
    heads = h * G + g
    q = tl.load(Q + b * sq_b + s * sq_s + heads[:, None] * sq_h + d[None, :],
                mask=(g < G)[:, None], other=0.0)                                  # [GP, D]
    k_base = K + row * sk_r + h * sk_h
    v_base = V + row * sk_r + h * sk_h
    m_base = MASK + b * sm_b + s * sm_s
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for n0 in range(0, L, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        inb = n < L
        allowed = (tl.load(m_base + n, mask=inb, other=0) != 0) & inb               # [BLOCK_N]
        k = tl.load(k_base + n[:, None] * sk_n + d[None, :], mask=inb[:, None], other=0.0)   # [BLOCK_N, D]
        v = tl.load(v_base + n[:, None] * sk_n + d[None, :], mask=inb[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(allowed[None, :], sc * scale, float("-inf"))                # [GP, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(sc - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + b * so_b + s * so_s + heads[:, None] * so_h + d[None, :], out.to(Out.dtype.element_ty),
             mask=(g < G)[:, None])


def supported(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Head dims the kernel takes (a power of two, 16..256) on CUDA, contiguous caches of one
    shape (the kernel indexes both with the keys' strides); False once the kernel failed to build
    here."""
    dh = q.shape[-1]
    return (not _FAILED and q.is_cuda and 16 <= dh <= 256 and dh & (dh - 1) == 0 and k_cache.is_contiguous()
            and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16))


_FAILED: list[str] = []   # why the kernel could not run here (then the caller's SDPA path serves)


def try_decode_attention(*args) -> Tensor | None:
    """decode_attention, or None (logged once) when Triton cannot build or run it on this setup."""
    try:
        return decode_attention(*args)
    except Exception as e:  # noqa: BLE001 - a Triton/driver version the kernel does not suit
        _FAILED.append(f"{type(e).__name__}: {e}")
        log.warning("Triton decode attention unavailable (%s); graphs use gathered rows and SDPA", _FAILED[0][:300])
        return None


def decode_attention(q: Tensor,                        # [B, S, H, Dh]
                     k_cache: Tensor, v_cache: Tensor,  # [rows, Hkv, W, Dh], one layer's cache
                     rows: Tensor,                      # [B] long: each sequence's cache row
                     mask: Tensor,                      # [B, 1, S, W] bool: the columns each query sees
                     kv_len: Tensor,                    # [] long: columns to read
                     new: tuple[Tensor, Tensor, Tensor, Tensor] | None = None) -> Tensor:  # -> [B, S, H, Dh]
    """Attention of the queries over their rows' first ``kv_len`` columns. ``new``: (k, v
    [B, S, Hkv, Dh], write_rows, write_cols [B*S]), the step's new keys and values, written into
    the cache by the same kernel before it reads (kv/cache.py ``write_layer``'s index writes,
    without their two launches per layer)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    rows = rows if rows.is_contiguous() else rows.contiguous()   # (the op takes inputs of any strides)
    B, S, H, D = q.shape
    hkv = k_cache.shape[1]
    G = H // hkv
    out = q.new_empty(q.shape)   # contiguous whatever q's strides (the op's fake says so)
    m = mask if mask.stride(-1) == 1 else mask.contiguous()
    if new is not None:
        k, v, wrows, wcols = (x if x.is_contiguous() else x.contiguous() for x in new)
    else:
        k = v = wrows = wcols = q   # (unread)
    _decode_kernel[(B * hkv, S)](
        q, k_cache, v_cache, out, rows, m, kv_len, k, v, wrows, wcols,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2), m.stride(0), m.stride(2),
        S * hkv * D, hkv * D, D,
        D ** -0.5, S, k_cache.shape[0], k_cache.shape[2],
        HKV=hkv, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=64,
        IEEE=q.dtype == torch.float32, WRITE=new is not None)
    return out
