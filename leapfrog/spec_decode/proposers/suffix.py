"""SuffixDecoding proposer (Oliaro et al., NeurIPS 2025; ArcticInference's vLLM plugin).

Per step and request: match the context's suffix (its last ``suffix_cache_max_depth - 1``
tokens at most) in two suffix structures (``suffix_tree.py``):

- the request's own prompt and output (the per-request tree), and
- the global tree over the outputs of earlier requests of this engine (``SuffixCache``: the
  last ``suffix_cache_max_requests`` finished requests, the oldest evicted first; it lives in
  the proposer, so it is per engine and never shared between models),

expand a draft tree from each match (best first by estimated path probability, nodes below
``min_token_prob`` dropped, at most ``min(K, match_len * max_spec_factor + max_spec_offset)``
nodes: a longer match earns a longer speculation), and propose the tree with the higher score
(expected accepted tokens). The paper scores every match length in each tree; this scores the
longest match in each (the most specific context), which keeps a step to two matches in Python.

Drafts are a deterministic function of the committed tokens (point-mass, q = None), so the tree
verifier (``verify/tree.py``: matching for greedy/seeded, recursive rejection sampling otherwise)
keeps the output exactly the target's.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

import torch

from leapfrog.request import Request
from leapfrog.spec_decode.adaptive import tree_depth_cap
from leapfrog.spec_decode.config import SpeculativeConfig
from leapfrog.spec_decode.draft import DraftBatch
from leapfrog.spec_decode.proposers.base import ContextBuffers, StatelessProposer, TargetInfo, register_proposer
from leapfrog.spec_decode.proposers.suffix_tree import DraftTree, SuffixTree, expand, local_root, spec_length


class SuffixCache:
    """The global tree: outputs of the last ``max_requests`` finished requests (FIFO eviction)."""

    def __init__(self, max_depth: int, max_requests: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.max_requests = max_requests
        self.seqs: OrderedDict[str, array] = OrderedDict()
        self.num_tokens = 0
        self.evictions = 0

    def add(self, key: str, tokens: list[int]) -> None:
        if self.max_requests <= 0 or not tokens:
            return
        if key in self.seqs:   # a reused request id: the newer output replaces the older
            self._drop(key)
        seq = array("i", tokens)
        self.tree.insert(seq)
        self.seqs[key] = seq
        self.num_tokens += len(seq)
        while len(self.seqs) > self.max_requests:
            self._drop(next(iter(self.seqs)))
            self.evictions += 1

    def _drop(self, key: str) -> None:
        seq = self.seqs.pop(key)
        self.tree.remove(seq)
        self.num_tokens -= len(seq)

    def stats(self) -> dict[str, int]:
        """Size of the global tree (reported in /metrics)."""
        return {"requests": len(self.seqs), "tokens": self.num_tokens, "nodes": self.tree.num_nodes,
                "bytes": self.tree.nbytes() + self.num_tokens * 4, "evictions": self.evictions}


@register_proposer("suffix")
class SuffixProposer(StatelessProposer):
    def __init__(self, cfg: SpeculativeConfig, target: TargetInfo) -> None:
        self.cfg = cfg
        self.cache = SuffixCache(cfg.suffix_cache_max_depth, cfg.suffix_cache_max_requests)
        self._ctx = ContextBuffers()
        self._seq = 0   # finished requests so far (the cache's keys: request ids may be reused)

    def speculate(self, req: Request, k: int) -> DraftTree:
        """The better of the local and the global draft tree for this request (k nodes at most)."""
        cfg = self.cfg
        depth = min(tree_depth_cap(req), cfg.suffix_cache_max_depth - 1)
        if k <= 0 or depth <= 0:
            return DraftTree()
        ctx = self._ctx.get(req)
        best = DraftTree()
        roots = [local_root(ctx, cfg.suffix_cache_max_depth - 1)]
        if self.cache.seqs:
            roots.append(self.cache.tree.match(ctx[-(cfg.suffix_cache_max_depth - 1):].tolist()))
        for root in roots:
            if root is None:
                continue
            n = spec_length(root.match_len, k, cfg.max_spec_factor, cfg.max_spec_offset)
            tree = expand(root, n, cfg.min_token_prob, max_depth=depth)
            if tree.score > best.score:
                best = tree
        return best

    def propose(self, reqs: list[Request], ks: list[int]) -> DraftBatch:
        trees = [self.speculate(r, k) for r, k in zip(reqs, ks)]
        batch = DraftBatch.from_lists([t.token_ids for t in trees])
        batch.parents = torch.tensor([p for t in trees for p in t.parents], dtype=torch.long)
        return batch

    def finish(self, req: Request) -> None:
        self._ctx.drop(req)
        if req.finish_reason != "error":
            self._seq += 1
            self.cache.add(f"{self._seq}", list(req.output_ids))

    def reset(self, req: Request) -> None:
        self._ctx.drop(req)

    def stats(self) -> dict[str, int]:
        return self.cache.stats()

    def clear_cache(self) -> None:
        """Forget every earlier output (benchmarks: no repeat drafts from an earlier repeat's outputs)."""
        self.cache = SuffixCache(self.cfg.suffix_cache_max_depth, self.cfg.suffix_cache_max_requests)
