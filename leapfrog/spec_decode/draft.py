"""DraftBatch: what a proposer hands the verifier.

Ragged and flat (STYLE B5): request b's drafts are ``token_ids[cu[b-1]:cu[b]]`` with
``cu = cumsum(num_draft)``. Zero drafts for a request is legal (plain decode). ``draft_probs``
is the draft distribution q at each drafted position (None = point-mass drafts, as n-gram
lookup proposes).

Trees: ``parents[t]`` is the parent of flat draft t as an index *within its request's drafts*
(-1 = a child of the root, the request's last committed token). Parents come before their
children; siblings are distinct tokens, best first. A chain is ``[-1, 0, 1, ...]`` per request
and may be left as None. Example, one request with drafts [a, b, c, d] and parents
[-1, -1, 0, 0]: the root has children a and b, a has children c and d; depths [1, 1, 2, 2];
the paths are [a], [b], [a, c], [a, d].

Verification rows (``spec_decode/verify``): request b owns T_b + 1 target rows starting at
``offsets[b] + b``; its row 0 is the root, row 1 + j the state after draft j, so draft j is
scored by the row of its parent (row 0 for the root's children).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DraftBatch:
    token_ids: Tensor                 # [T] long, flattened over requests
    num_draft: list[int]              # [B] drafts per request
    draft_probs: Tensor | None = None  # [T, V] q, None => point mass
    parents: Tensor | None = None     # [T] tree parents (None => chains)
    # per request, the path confidences of every candidate the proposer considered, best first,
    # or None for a chain drawn without them (an unseeded sampled request's: x ~ q) (tree
    # proposers; read by the auto tree-size controller, spec_decode/adaptive.py)
    candidate_scores: list[list[float] | None] | None = None

    @classmethod
    def empty(cls, batch_size: int) -> "DraftBatch":
        return cls(torch.empty(0, dtype=torch.long), [0] * batch_size)

    @classmethod
    def from_lists(cls, drafts: list[list[int]], draft_probs: Tensor | None = None) -> "DraftBatch":
        flat = [t for d in drafts for t in d]
        return cls(torch.tensor(flat, dtype=torch.long), [len(d) for d in drafts], draft_probs)

    @classmethod
    def merge(cls, parts: list[tuple[list[int], "DraftBatch"]], batch_size: int) -> "DraftBatch":
        """One batch from the drafts of several proposers: ``parts`` are (request indices in the
        merged batch, their DraftBatch); requests in no part get no drafts. Parents are filled
        in (chains) when any part has a tree; q is one-hot for point-mass parts when any part
        has q (a point-mass draft is q = one-hot: the verifiers treat both alike)."""
        if len(parts) == 1 and parts[0][0] == list(range(batch_size)):
            return parts[0][1]
        owner: dict[int, tuple[DraftBatch, int]] = {}
        for idx, part in parts:
            for j, b in enumerate(idx):
                owner[b] = (part, j)
        q_any = next((p.draft_probs for _, p in parts if p.draft_probs is not None), None)
        V = None if q_any is None else q_any.shape[1]
        trees = any(p.parents is not None for _, p in parts)
        ids, nums, qs, pars = [], [], [], []
        for b in range(batch_size):
            if b not in owner:
                nums.append(0)
                continue
            part, j = owner[b]
            o = part.offsets()
            tok = part.token_ids[o[j]:o[j + 1]]
            ids.append(tok)
            nums.append(len(tok))
            if V is not None:
                qs.append(part.draft_probs[o[j]:o[j + 1]] if part.draft_probs is not None
                          else torch.nn.functional.one_hot(tok, V).to(q_any))
            if trees:
                pars.append(part.parents[o[j]:o[j + 1]] if part.parents is not None
                            else torch.arange(-1, len(tok) - 1))
        empty = torch.empty(0, dtype=torch.long)
        return cls(torch.cat(ids) if ids else empty, nums,
                   torch.cat(qs) if V is not None and qs else None,
                   torch.cat(pars) if trees and pars else None)

    def offsets(self) -> list[int]:
        """Start of each request's drafts in the flat arrays ([B + 1])."""
        out = [0]
        for n in self.num_draft:
            out.append(out[-1] + n)
        return out

    def lists(self) -> list[list[int]]:
        if not any(self.num_draft):   # (plain decode: no tensor to read)
            return [[] for _ in self.num_draft]
        flat = self.token_ids.tolist()
        o = self.offsets()
        return [flat[o[b]:o[b + 1]] for b in range(len(self.num_draft))]

    def select(self, batch_idx: list[int]) -> "DraftBatch":
        """The drafts of requests ``batch_idx`` (in that order) as a DraftBatch of their own (this
        one when that is every request in order: nothing to copy)."""
        if batch_idx == list(range(len(self.num_draft))):
            return self
        o = self.offsets()
        flat = [i for b in batch_idx for i in range(o[b], o[b + 1])]
        idx = torch.tensor(flat, dtype=torch.long)
        q = None if self.draft_probs is None else self.draft_probs[idx]
        parents = None if self.parents is None else self.parents[idx]
        return DraftBatch(self.token_ids[idx], [self.num_draft[b] for b in batch_idx], q, parents)

    def parent_lists(self) -> list[list[int]]:
        """[B] per request: the parent of each draft (local index, -1 = root); chains filled in."""
        if self.parents is None:
            return [list(range(-1, n - 1)) for n in self.num_draft]
        flat = self.parents.tolist()
        o = self.offsets()
        return [flat[o[b]:o[b + 1]] for b in range(len(self.num_draft))]

    @property
    def is_tree(self) -> bool:
        """Whether any request's drafts branch (a chain given with explicit parents is not a tree)."""
        return self.parents is not None and any(
            p != list(range(-1, len(p) - 1)) for p in self.parent_lists())

    @property
    def total(self) -> int:
        return sum(self.num_draft)


def chain_length(logprobs: list[float], levels: int, min_confidence: float | None) -> int:
    """How many of a greedy chain's drafts to verify: ``levels``, or fewer when its path
    confidence (the product of the drafter's q along it; ``logprobs``: log q of each draft, as
    many as were drafted) falls below ``min_confidence`` (SpeculativeConfig.min_draft_confidence):
    the draft where it does is the chain's last (already drafted, it costs one verified row; the
    next would cost a drafter forward too). At least one draft when any was drafted."""
    n = min(levels, len(logprobs))
    if min_confidence is None:
        return n
    path = 0.0
    for d in range(n):
        path += logprobs[d]
        if chain_ended(path, min_confidence):
            return d + 1
    return n


def chain_ended(path: float, min_confidence: float | None) -> bool:
    """Whether a greedy chain whose drafts' log q sum to ``path`` (in float64, draft by draft) drafts
    no further: its path confidence is below ``min_confidence`` (None: never). The one test of
    ``chain_length``, the eager expansion and the draft model's per-token loop; the fused loops
    make it on tensors (model/compiled.py CompiledChain._steps)."""
    return min_confidence is not None and path < math.log(min_confidence)


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (children of the root have depth 1), parents before children."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path_to(parents: list[int], j: int) -> list[int]:
    """Indices of the nodes from the root's child down to node j (inclusive); [] for j = -1."""
    path = []
    while j >= 0:
        path.append(j)
        j = parents[j]
    return path[::-1]
