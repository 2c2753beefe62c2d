"""Attention metadata for one forward over a padded batch ``[B, S]`` of new tokens.

Worked example (2 sequences, S = 3; row 0 has 5 cached tokens and 3 new ones, row 2 has
8 cached and 1 new; ``*`` is padding written to the scratch row R):

    rows       = [0, 2]
    write_cols = [[5, 6, 7], [8, 0*, 1*]]     write_rows = [0, 0, 0, 2, R, R]
    kv_len     = 9                            (max column + 1 over real tokens)
    mask[b, s, c] = c <= query column (+ sliding window), padding rows see column 0 only
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


def build_attn_meta(rows: list[int], cols: list[list[int]], scratch_row: int, device: torch.device | str,
                    sliding_window: int | None = None, tree_mask: Tensor | None = None) -> AttnMeta:
    """Metadata for sequences ``rows`` whose new tokens go to columns ``cols[b]`` (ragged).

    The default mask is causal by cache column. ``tree_mask`` ([B, S, kv_len] bool), when
    given, replaces it (tree verification passes prefix + tree-ancestor masks here).
    """
    B = len(rows)
    S = max(len(c) for c in cols)
    kv_len = max(max(c) for c in cols if c) + 1
    write_rows, write_cols, q_cols = [], [], []
    for r, c in zip(rows, cols):
        pad = S - len(c)
        write_rows += [r] * len(c) + [scratch_row] * pad
        write_cols += list(c) + list(range(pad))
        q_cols.append(list(c) + [0] * pad)
    contiguous = rows == list(range(rows[0], rows[0] + B))
    single_span = B == 1 and cols[0] == list(range(cols[0][0], cols[0][0] + S))
    if tree_mask is not None:
        mask = tree_mask[:, None]
    elif B == 1 and S == 1 and sliding_window is None:
        mask = None  # one query at the last column attends to every column
    else:
        qc = torch.tensor(q_cols, device=device)[:, :, None]  # [B, S, 1]
        kc = torch.arange(kv_len, device=device)[None, None, :]  # [1, 1, L]
        allowed = kc <= qc
        if sliding_window is not None:
            allowed &= kc > qc - sliding_window
        mask = allowed[:, None]  # [B, 1, S, L]
    return AttnMeta(
        rows=torch.tensor(rows, device=device),
        write_rows=torch.tensor(write_rows, device=device),
        write_cols=torch.tensor(write_cols, device=device),
        kv_len=kv_len,
        mask=mask,
        row_range=(rows[0], rows[0] + B) if contiguous else None,
        write_span=(rows[0], cols[0][0], cols[0][0] + S) if single_span else None,
    )
