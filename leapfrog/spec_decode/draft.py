"""DraftBatch: what a proposer hands the verifier.

Ragged and flat (STYLE B5): request b's drafts are ``token_ids[cu[b-1]:cu[b]]`` with
``cu = cumsum(num_draft)``. Zero drafts for a request is legal (plain decode). ``draft_probs``
is the draft distribution q at each drafted position (None = point-mass drafts, as n-gram
lookup proposes). ``parents`` (-1 = root) lets a tree ride the same type later; a chain is
``[-1, 0, 1, ...]`` per request and may be left as None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DraftBatch:
    token_ids: Tensor                 # [T] long, flattened over requests
    num_draft: list[int]              # [B] drafts per request
    draft_probs: Tensor | None = None  # [T, V] q, None => point mass
    parents: Tensor | None = None     # [T] tree parents (None => chains)

    @classmethod
    def empty(cls, batch_size: int) -> "DraftBatch":
        return cls(torch.empty(0, dtype=torch.long), [0] * batch_size)

    @classmethod
    def from_lists(cls, drafts: list[list[int]], draft_probs: Tensor | None = None) -> "DraftBatch":
        flat = [t for d in drafts for t in d]
        return cls(torch.tensor(flat, dtype=torch.long), [len(d) for d in drafts], draft_probs)

    def offsets(self) -> list[int]:
        """Start of each request's drafts in the flat arrays ([B + 1])."""
        out = [0]
        for n in self.num_draft:
            out.append(out[-1] + n)
        return out

    def lists(self) -> list[list[int]]:
        flat = self.token_ids.tolist()
        o = self.offsets()
        return [flat[o[b]:o[b + 1]] for b in range(len(self.num_draft))]

    def select(self, batch_idx: list[int]) -> "DraftBatch":
        """The drafts of requests ``batch_idx`` (in that order) as a DraftBatch of their own."""
        o = self.offsets()
        flat = [i for b in batch_idx for i in range(o[b], o[b + 1])]
        idx = torch.tensor(flat, dtype=torch.long)
        q = None if self.draft_probs is None else self.draft_probs[idx]
        parents = None if self.parents is None else self.parents[idx]
        return DraftBatch(self.token_ids[idx], [self.num_draft[b] for b in batch_idx], q, parents)

    @property
    def total(self) -> int:
        return sum(self.num_draft)
