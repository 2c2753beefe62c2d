"""ModelRunner: one forward over a ragged batch of sequence chunks, for targets and drafts.

Each chunk is a sequence's new tokens starting at cache column ``start`` (positions equal
columns for chains). Chunks are padded to ``[B, S]``; padding writes to the cache's scratch
row, so no sequence's cache is realigned or copied.

``batch_invariant=True`` puts the model in batch-invariant mode (model/llama.py) and builds
per-token attention metadata: a token's logits are then bitwise the same whatever chunks run
with it, so greedy output with speculation equals output without, and any batch equals alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from leapfrog.attention.metadata import build_attn_meta
from leapfrog.kv.cache import KVCache
from leapfrog.model.llama import LlamaModel


@dataclass
class SeqChunk:
    row: int               # KV cache row
    start: int             # cache column (= position) of token_ids[0]
    token_ids: list[int]
    num_logits: int        # logits wanted for the last num_logits tokens (0 = none)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_rows: int, max_model_len: int,
                 batch_invariant: bool = False) -> None:
        a = model.args
        self.model = model
        self.batch_invariant = batch_invariant
        if batch_invariant:
            model.make_batch_invariant()
        self.device = model.device
        self.kv = KVCache(a.num_hidden_layers, num_rows, max_model_len, a.num_key_value_heads,
                          a.head_dim, model.dtype, self.device)

    @torch.inference_mode()
    def run(self, chunks: list[SeqChunk]) -> Tensor:
        """-> logits [sum(num_logits), V] float32, chunk by chunk in order."""
        B, S = len(chunks), max(len(c.token_ids) for c in chunks)
        tokens = [c.token_ids + [0] * (S - len(c.token_ids)) for c in chunks]
        positions = [list(range(c.start, c.start + len(c.token_ids))) + [0] * (S - len(c.token_ids))
                     for c in chunks]
        meta = build_attn_meta([c.row for c in chunks],
                               [list(range(c.start, c.start + len(c.token_ids))) for c in chunks],
                               self.kv.scratch_row, self.device, self.model.args.sliding_window,
                               per_token=self.batch_invariant)
        tok = torch.tensor(tokens, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(tok, pos, self.kv, meta).hidden  # [B, S, D]
        rows = [b * S + i for b, c in enumerate(chunks)
                for i in range(len(c.token_ids) - c.num_logits, len(c.token_ids))]
        if not rows:
            return torch.empty(0, self.model.args.vocab_size)
        flat = hidden.view(B * S, -1)
        sel = flat[rows[0]:rows[-1] + 1] if rows == list(range(rows[0], rows[-1] + 1)) else flat[rows]
        return self.model.compute_logits(sel).cpu()
