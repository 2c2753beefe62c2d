"""Preallocated KV cache addressed by (row, column).

Each running sequence owns one *row* of ``max_model_len`` columns; column c holds the
key/value of the token at cache position c. A sequence's valid length lives in
``kv/manager.py`` (one integer per request), so rollback after a rejected draft is length
arithmetic: later writes overwrite the stale columns, and the attention mask never lets a
query see a column it has not (re)written. Row ``num_rows`` is a scratch row that padding
tokens write into, so ragged batches need no realignment copies.

Memory is bounded up front: ``num_rows * max_model_len`` tokens (the token budget).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from leapfrog.attention.metadata import AttnMeta


class KVCache:
    def __init__(self, num_layers: int, num_rows: int, max_model_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.num_rows = num_rows
        self.max_model_len = max_model_len
        shape = (num_rows + 1, num_kv_heads, max_model_len, head_dim)  # +1: scratch row
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        #: the engine whose requests are in this cache, where engines share it (LLMEngine
        #: ``share_kv_cache``): another may step only once that one has none unfinished
        self.holder: Any = None

    @property
    def scratch_row(self) -> int:
        return self.num_rows

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, meta: AttnMeta, k: Tensor, v: Tensor) -> None:
        """Write new k/v [B, S, Hkv, D] at meta's (row, column) slots."""
        write_layer(self.k[layer], self.v[layer], meta, k, v)

    def write_and_read(self, layer: int, meta: AttnMeta, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write new k/v [B, S, Hkv, D]; return the rows' K, V [B, Hkv, kv_len, D] for attention
        (a view when the batch's rows are contiguous)."""
        return write_and_read_layer(self.k[layer], self.v[layer], meta, k, v)

    def read_cols(self, layer: int, row: int, cols: slice | Tensor) -> tuple[Tensor, Tensor]:
        """K, V [1, Hkv, n, D] of one row's columns ``cols`` (a view for a slice): what one
        token attends to in batch-invariant mode. The same columns give the same strides
        whatever else is in the batch."""
        kc, vc = self.k[layer], self.v[layer]
        return kc[row:row + 1, :, cols], vc[row:row + 1, :, cols]

    def move_cols(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy columns ``src`` of ``row`` to columns ``dst`` in every layer (gathered first, so
        the ranges may overlap): after tree verification the accepted path's K/V becomes
        contiguous, and nothing else is copied."""
        if src == dst:
            return
        s = torch.tensor(src, device=self.k[0].device)
        d = torch.tensor(dst, device=self.k[0].device)
        for kc, vc in zip(self.k, self.v):
            kc[row, :, d] = kc[row, :, s]
            vc[row, :, d] = vc[row, :, s]


def write_layer(kc: Tensor, vc: Tensor, meta: AttnMeta, k: Tensor, v: Tensor) -> None:
    """KVCache.write on one layer's tensors (also called from inside compiled graphs' attention op)."""
    if meta.write_span is not None:  # one sequence, contiguous columns: slice assignment
        row, c0, c1 = meta.write_span
        kc[row, :, c0:c1] = k[0].transpose(0, 1)
        vc[row, :, c0:c1] = v[0].transpose(0, 1)
    else:
        kc[meta.write_rows, :, meta.write_cols] = k.flatten(0, 1)
        vc[meta.write_rows, :, meta.write_cols] = v.flatten(0, 1)


def write_and_read_layer(kc: Tensor, vc: Tensor, meta: AttnMeta, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """KVCache.write_and_read on one layer's tensors."""
    write_layer(kc, vc, meta, k, v)
    if meta.row_range is not None:
        r0, r1 = meta.row_range
        return kc[r0:r1, :, : meta.kv_len], vc[r0:r1, :, : meta.kv_len]
    if meta.rows.numel() == 1:  # one row: a view
        r = int(meta.rows[0])
        return kc[r:r + 1, :, : meta.kv_len], vc[r:r + 1, :, : meta.kv_len]
    return kc[meta.rows, :, : meta.kv_len], vc[meta.rows, :, : meta.kv_len]
