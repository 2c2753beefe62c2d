"""Prompt-lookup (n-gram) proposer.

Pure core: find the longest suffix of the context (length n in [min_n, max_n], longest
first) that occurred earlier, take the most recent earlier occurrence, and propose the k
tokens that followed it. Example, context [1 2 3 4 1 2 3 5 1 2], n = 2: the suffix
[1 2] occurred at 0 and 4; the most recent is 4, followed by [3 5 1 2] -> k = 3 gives [3 5 1].

Matching is vectorised over numpy arrays, so an 8k-token context costs microseconds.
"""

from __future__ import annotations

import numpy as np

from leapfrog.request import Request
from leapfrog.spec_decode.config import SpeculativeConfig
from leapfrog.spec_decode.draft import DraftBatch
from leapfrog.spec_decode.proposers.base import ContextBuffers, StatelessProposer, TargetInfo, register_proposer


def occurrences(hay: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """Start indices i (ascending) with hay[i:i+len(pattern)] == pattern: candidates for the
    first token, filtered by one vectorised comparison per further token."""
    m = len(pattern)
    if m == 0 or len(hay) < m:
        return np.empty(0, dtype=np.int64)
    starts = np.flatnonzero(hay[:len(hay) - m + 1] == pattern[0])
    for j in range(1, m):
        if not len(starts):
            break
        starts = starts[hay[starts + j] == pattern[j]]
    return starts


def ngram_propose(context: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """context [L] int -> up to k proposed tokens (possibly none)."""
    L = len(context)
    if k <= 0:
        return context[:0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # starts i with context[i:i+n] == the suffix and i + n <= L - 1 (a follower exists)
        starts = occurrences(context[:L - 1], context[L - n:])
        if len(starts):
            i = int(starts[-1]) + n  # most recent match
            return context[i:i + k]
    return context[:0]


@register_proposer("ngram")
class NgramProposer(StatelessProposer):
    def __init__(self, cfg: SpeculativeConfig, target: TargetInfo) -> None:
        self.min_n, self.max_n = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        self._ctx = ContextBuffers()

    def propose(self, reqs: list[Request], ks: list[int]) -> DraftBatch:
        return DraftBatch.from_lists(
            [ngram_propose(self._ctx.get(r), self.min_n, self.max_n, k).tolist() if k else []
             for r, k in zip(reqs, ks)])

    def finish(self, req: Request) -> None:
        self._ctx.drop(req)
