"""Persistent inputs of a compiled bucket on CPU: a step's integer inputs and mask in two writes.

A compiled graph's call takes token ids and positions ``[B, S]`` and the attention metadata
(attention/metadata.py ``build_attn_meta`` with ``graph_width``: cache rows, write rows and
columns, a ``[B, 1, S, max_len]`` mask, the context length), and a fused drafting graph two more
``[B]`` vectors. Made fresh, that is about ten small tensors and views per call. On this path
each one costs far more than its arithmetic: the graph has just streamed the model's weights
(47 MB of packed linears for the built-in target, more than a 2-core VM's share of the
last-level cache), which evicts the host path's code and data. Measured on a Zen 3 VM:
``torch.tensor`` of five ints 86-100 us right after streaming 64 MB against 7 us warm,
``torch.empty(5)`` 42 us, a slice 53 us.

A bucket's shapes never change, so ``GraphInputs`` makes its tensors once, as views of one int64
buffer (each segment 64-byte aligned, as fresh tensors are) and one bool mask, and each call
writes the values through numpy views of them: one assignment for every integer, one comparison
for the mask. The tensors a call returns are the same objects every time: the graph reads them
during the call and keeps nothing, and the next call of that bucket overwrites them.

Eager forwards through the C++ attention op (decode and verification steps of the default eager
engine, whose metadata is as wide as the cache too) take arenas of their own shapes as well
(``ModelRunner._inputs``): plain decode's inputs at batch 1 went from 63 to 36 us a step.

Only chains (every chunk's new tokens at consecutive columns and positions), without a sliding
window; trees and windows take ``build_attn_meta``. The values are exactly ``build_attn_meta``'s
(tests/model/test_graph_inputs.py checks them against it). Memory: one mask per bucket, at most
256 tokens x max_model_len bytes (make_buckets; an eager loop's, up to 8 MiB: eager_buckets), about
0.4 MB in all for the built-in pair's compiled buckets.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from leapfrog.attention.metadata import AttnMeta

_ALIGN = 8   # int64 elements per 64 bytes


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class GraphInputs:
    """The inputs of one ``[B, S]`` bucket of a compiled graph over a cache ``width`` columns wide
    (CPU). ``fill`` -> token ids, positions [B, S], the AttnMeta, and each chunk's last-token
    index and next column [B] (what the fused drafting graphs take)."""

    def __init__(self, batch: int, tokens: int, width: int, scratch_row: int) -> None:
        B, S = batch, tokens
        BS = B * S
        # segments: tok, pos, write_rows, write_cols, query columns [B*S]; rows, last, col [B]; kv_len
        sizes = [BS, BS, BS, BS, BS, B, B, B, 1]
        offsets, o = [], 0
        for n in sizes:
            offsets.append(o)
            o += _up(n)
        self.buf = torch.zeros(o, dtype=torch.long)
        self._np = self.buf.numpy()
        self._gaps = [[0] * (_up(n) - n) for n in sizes]   # zeros between segments (one list of values)
        seg = [self.buf[a:a + n] for a, n in zip(offsets, sizes)]
        self.tok, self.pos = seg[0].view(B, S), seg[1].view(B, S)
        self.write_rows, self.write_cols = seg[2], seg[3]
        self._qcols = self._np[offsets[4]:offsets[4] + BS].reshape(B, S, 1)
        self.rows, self.last, self.col = seg[5], seg[6], seg[7]
        self.kv_len = self.buf[offsets[8]]                    # [] int64
        self.mask = torch.zeros(B, 1, S, width, dtype=torch.bool)
        self._mask = self.mask.numpy().reshape(B, S, width)   # a view
        self._columns = np.arange(width, dtype=np.int64)[None, None, :]
        self.tokens, self.scratch_row = S, scratch_row

    def fill(self, rows: Sequence[int], starts: Sequence[int], token_ids: Sequence[Sequence[int]]
             ) -> tuple[Tensor, Tensor, AttnMeta, Tensor, Tensor]:
        """Sequence b's ``token_ids[b]`` at cache row ``rows[b]``, columns and positions
        ``starts[b]``, ``starts[b] + 1``, ... (at most S of them; the rest padding, written to the
        scratch row at columns 0, 1, ...)."""
        S, scratch = self.tokens, self.scratch_row
        tok: list[int] = []
        pos: list[int] = []
        wr: list[int] = []
        wc: list[int] = []
        qc: list[int] = []
        last: list[int] = []
        col: list[int] = []
        kv_len = 0
        for r, c0, ids in zip(rows, starts, token_ids):
            n = len(ids)
            pad = S - n
            cols = list(range(c0, c0 + n))
            tok += ids
            tok += [0] * pad
            pos += cols
            pos += [0] * pad
            wr += [r] * n
            wr += [scratch] * pad
            wc += cols
            wc += range(pad)
            qc += cols
            qc += [0] * pad
            last.append(n - 1)
            col.append(c0 + n)
            if n:
                kv_len = max(kv_len, c0 + n)
        g = self._gaps
        self._np[:] = (tok + g[0] + pos + g[1] + wr + g[2] + wc + g[3] + qc + g[4] + list(rows) + g[5]
                       + last + g[6] + col + g[7] + [kv_len] + g[8])
        np.less_equal(self._columns, self._qcols, out=self._mask)   # [B, S, width]: column <= query column
        meta = AttnMeta(rows=self.rows, write_rows=self.write_rows, write_cols=self.write_cols, kv_len=kv_len,
                        mask=self.mask, graph_kv_len=self.kv_len)
        return self.tok, self.pos, meta, self.last, self.col
