"""Attention metadata for one forward over a padded batch ``[B, S]`` of new tokens.

Worked example (2 sequences, S = 3; row 0 has 5 cached tokens and 3 new ones, row 2 has
8 cached and 1 new; ``*`` is padding written to the scratch row R):

    rows       = [0, 2]
    write_cols = [[5, 6, 7], [8, 0*, 1*]]     write_rows = [0, 0, 0, 2, R, R]
    kv_len     = 9                            (max column + 1 over real tokens)
    mask[b, s, c] = c <= query column (+ sliding window), padding rows see column 0 only

Batch-invariant metadata (``per_token=True``) has no mask; instead each real token lists the
columns it sees, and attention runs once per token over exactly those (attention/backend.py):

    token_cols = [(0, 0, 0, 0:6), (0, 1, 0, 0:7), (0, 2, 0, 0:8), (1, 0, 2, 0:9)]
                  (b, s, row, columns)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AttnMeta:
    rows: Tensor                 # [B] cache row per sequence
    write_rows: Tensor           # [B*S] row each new token is written to (scratch for padding)
    write_cols: Tensor           # [B*S] column each new token is written to
    kv_len: int                  # columns read for attention
    mask: Tensor | None          # [B, 1, S, kv_len] bool (True = attend) or None (attend to all)
    row_range: tuple[int, int] | None = None   # rows are r0..r1-1 in order: read a view
    write_span: tuple[int, int, int] | None = None  # B == 1: (row, c0, c1) slice write
    # batch-invariant mode: (b, s, row, columns) per real token, columns a slice when they are
    # contiguous (chains, sliding windows), else a [n] index tensor (tree nodes: prefix + ancestors)
    token_cols: list[tuple[int, int, int, slice | Tensor]] | None = None
    # compiled graphs: the context length as a [] int64 tensor, with ``mask`` [B, 1, S, max_len]
    # (attention/backend.py cached_attention); None in eager forwards
    graph_kv_len: Tensor | None = None
    native: bool = False  # compiled graphs: call the C++ op (attention/native.py), not the Python one


def build_attn_meta(rows: list[int], cols: list[list[int]], scratch_row: int, device: torch.device | str,
                    sliding_window: int | None = None, tree_mask: Tensor | None = None,
                    per_token: bool = False, pad_to: int | None = None,
                    graph_width: int | None = None, columns: Tensor | None = None) -> AttnMeta:
    """Metadata for sequences ``rows`` whose new tokens go to columns ``cols[b]`` (ragged).

    The default mask is causal by cache column. ``tree_mask`` ([B, S, kv_len] bool), when
    given, replaces it (tree verification passes prefix + tree-ancestor masks here).
    ``per_token``: the batch-invariant form (``token_cols``, no mask). ``pad_to``: S, when
    more than the longest sequence (a compiled graph's bucket). ``graph_width``: metadata for a
    compiled graph (model/compiled.py): a mask ``graph_width`` columns wide whatever kv_len,
    kv_len as a tensor, index writes and reads (no int the graph would be specialized on).
    ``columns``: arange(graph_width) on ``device``, when the caller keeps one (a step's host work
    is a few small tensors: each one made fresh costs microseconds).
    """
    B = len(rows)
    S = max(max(len(c) for c in cols), pad_to or 0)
    kv_len = max(max(c) for c in cols if c) + 1
    write_rows, write_cols, q_cols = [], [], []
    for r, c in zip(rows, cols):
        pad = S - len(c)
        write_rows += [r] * len(c) + [scratch_row] * pad
        write_cols += list(c) + list(range(pad))
        q_cols.append(list(c) + [0] * pad)
    # every integer input from one tensor (on a step's host path each tensor made costs microseconds):
    # rows [B], write_rows [B*S], write_cols [B*S], query columns [B*S], kv_len
    BS = B * S
    ints = torch.tensor(rows + write_rows + write_cols + [c for q in q_cols for c in q] + [kv_len], device=device)
    contiguous = rows == list(range(rows[0], rows[0] + B))
    single_span = B == 1 and cols[0] == list(range(cols[0][0], cols[0][0] + S))
    mask = token_cols = None
    if per_token:
        token_cols = _token_cols(rows, cols, sliding_window, tree_mask)
    elif tree_mask is not None:
        mask = tree_mask[:, None]
    elif graph_width is not None or not (B == 1 and S == 1 and sliding_window is None):
        # (a lone query without a window sees every column: no mask)
        # (a graph's mask is graph_width columns wide: columns >= kv_len are past every query
        # column, so comparing over the whole width gives the padded mask in one op)
        qc = ints[B + 2 * BS:B + 3 * BS].view(B, S, 1)  # [B, S, 1]
        if columns is None or graph_width is None:
            columns = torch.arange(graph_width or kv_len, device=device)
        kc = columns[None, None, :]  # [1, 1, L]
        allowed = kc <= qc
        if sliding_window is not None:
            allowed &= kc > qc - sliding_window
        mask = allowed[:, None]  # [B, 1, S, L]
    graph_kv_len = None
    if graph_width is not None:
        assert mask is not None
        if tree_mask is not None:  # (the causal mask above is graph_width wide already)
            mask = torch.nn.functional.pad(mask, (0, graph_width - kv_len))  # [B, 1, S, graph_width]
        graph_kv_len = ints[-1]
    return AttnMeta(
        rows=ints[:B],
        write_rows=ints[B:B + BS],
        write_cols=ints[B + BS:B + 2 * BS],
        kv_len=kv_len,
        mask=mask,
        row_range=(rows[0], rows[0] + B) if contiguous and graph_width is None else None,
        write_span=(rows[0], cols[0][0], cols[0][0] + S) if single_span and graph_width is None else None,
        token_cols=token_cols,
        graph_kv_len=graph_kv_len,
    )


def _token_cols(rows: list[int], cols: list[list[int]], sliding_window: int | None,
                tree_mask: Tensor | None) -> list[tuple[int, int, int, slice | Tensor]]:
    """The columns each real token attends to: 0..c (the last ``sliding_window`` of them), or
    the tree mask's row for that token."""
    out: list[tuple[int, int, int, slice | Tensor]] = []
    for b, (r, cs) in enumerate(zip(rows, cols)):
        for s, c in enumerate(cs):
            if tree_mask is not None:
                seen = tree_mask[b, s].nonzero().flatten()
                lo, n = int(seen[0]), len(seen)
                contiguous = int(seen[-1]) == lo + n - 1
                out.append((b, s, r, slice(lo, lo + n) if contiguous else seen))
            else:
                lo = 0 if sliding_window is None else max(0, c - sliding_window + 1)
                out.append((b, s, r, slice(lo, c + 1)))
    return out
