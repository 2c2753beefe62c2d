"""Suffix structures for SuffixDecoding (Oliaro et al., NeurIPS 2025, arXiv 2411.04975): pure
data structures and the draft-tree expansion, no torch.

Two sources of continuations, both counted (frequency-scored):

- ``SuffixTree``: a depth-capped suffix tree with counts over many sequences, here the outputs of
  earlier requests (the paper's *global* tree). Every suffix ``seq[i : i + max_depth]`` of every
  inserted sequence is a root path; ``count(node)`` is how many inserted suffixes pass through it,
  so ``count(child) / count(node)`` is the empirical probability of the child's token after the
  node's context. Edges are compressed (radix tree): a node's edge label is ``seq[start:end]`` of
  one of the sequences, so memory grows with the number of suffixes (at most two nodes each), not
  with their depth. Sequences can be removed again (``remove``), which is how the cache evicts.
- ``local_root``: the request's own prompt and output (the paper's *per-request* tree), matched
  directly on the token array (numpy): the occurrences of the context's longest suffix that
  occurred earlier are the node, the tokens that followed them its children. Nothing is built or
  kept per token, so the request's tree is always current at no cost.

Both give a ``Cursor`` (where the context's suffix ends in the tree and how long the match is),
and ``expand`` grows a draft tree from it greedily by path probability (the paper's best-first
speculation): pop the most probable candidate, emit it, push its children with probability
``prob(parent) * count(child) / count(parent)``; drop candidates below ``min_token_prob``; stop at
``max_tokens`` nodes. Its score is the sum of the emitted probabilities, the expected number of
accepted tokens, which decides between the local and the global tree.

Example: sequences "a b c a b d" and "a b c" inserted with max_depth 4: the path "a b" has count 3
(suffixes "a b c", "a b d", "a b c"), its children c (count 2) and d (count 1). Matching the
context "x a b" finds "a b" (match length 2); ``expand`` with min_token_prob 0.1 proposes
c (2/3), then d (1/3) and c's child a (2/3 * 1/2: only one "a b c" continues with "a").
"""

from __future__ import annotations

import heapq
import sys
from array import array
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np


@dataclass
class DraftTree:
    """A proposed tree: ``parents[j]`` is node j's parent (local index, -1 = the root: the
    context's last token); parents come before children; siblings are distinct, best first."""
    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)   # path probability of each node
    match_len: int = 0

    @property
    def score(self) -> float:
        """Expected accepted tokens if every node's probability were exact."""
        return sum(self.probs)


# ------------------------------------------------------------------------------- the global tree
class _Node:
    __slots__ = ("count", "children", "seq", "start", "end")

    def __init__(self, count: int, seq: Sequence[int], start: int, end: int) -> None:
        self.count = count
        self.children: dict[int, _Node] | None = None
        self.seq, self.start, self.end = seq, start, end   # the edge label into this node


class SuffixTree:
    """Depth-capped, counted, edge-compressed suffix tree over many sequences (module docstring)."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(0, array("i"), 0, 0)
        self.num_nodes = 0

    def insert(self, seq: Sequence[int]) -> None:
        """Add every suffix of ``seq`` (up to max_depth tokens each). ``seq`` must not change
        afterwards (edge labels point into it)."""
        for i in range(len(seq)):
            self._walk(seq, i, min(i + self.max_depth, len(seq)), +1)

    def remove(self, seq: Sequence[int]) -> None:
        """Take back an ``insert(seq)`` (the same sequence object or an equal one)."""
        for i in range(len(seq)):
            self._walk(seq, i, min(i + self.max_depth, len(seq)), -1)

    def _walk(self, seq: Sequence[int], k: int, end: int, delta: int) -> None:
        node = self.root
        node.count += delta
        while k < end:
            kids = node.children
            child = kids.get(seq[k]) if kids else None
            if child is None:
                if delta < 0:
                    raise KeyError("remove() of a sequence that was not inserted")
                if kids is None:
                    kids = node.children = {}
                kids[seq[k]] = _Node(1, seq, k, end)
                self.num_nodes += 1
                return
            lab, j, n = child.seq, child.start, child.end - child.start
            m = 1
            while m < n and k + m < end and lab[j + m] == seq[k + m]:
                m += 1
            if m < n:  # the suffix leaves (or ends inside) the edge: split it at m
                if delta < 0:
                    raise KeyError("remove() of a sequence that was not inserted")
                mid = _Node(child.count, lab, j, j + m)
                mid.children = {lab[j + m]: child}
                child.start = j + m
                kids[seq[k]] = mid
                self.num_nodes += 1
                child = mid
            child.count += delta
            if child.count == 0:  # nothing passes here any more: drop the subtree
                del kids[seq[k]]
                self.num_nodes -= _size(child)
                if not kids:
                    node.children = None
                return
            k += m
            node = child

    def match(self, pattern: Sequence[int]) -> "TreeCursor | None":
        """The longest suffix of ``pattern`` (at most max_depth - 1 tokens, leaving room for a
        continuation) that is a path in the tree, as a cursor; None if not even its last token is."""
        n = len(pattern)
        for s in range(max(0, n - self.max_depth + 1), n):
            cur = self._find(pattern, s)
            if cur is not None:
                return cur
        return None

    def _find(self, pattern: Sequence[int], k: int) -> "TreeCursor | None":
        node, n, start = self.root, len(pattern), k
        while k < n:
            child = node.children.get(pattern[k]) if node.children else None
            if child is None:
                return None
            lab, j, L = child.seq, child.start, child.end - child.start
            m = 1
            while m < L and k + m < n:
                if lab[j + m] != pattern[k + m]:
                    return None
                m += 1
            k += m
            if m < L:
                return TreeCursor(child, m, n - start)
            node = child
        return TreeCursor(node, node.end - node.start, n - start)

    def nbytes(self) -> int:
        """Rough memory of the nodes (the sequences are counted by their owner)."""
        return self.num_nodes * _NODE_BYTES


def _size(node: _Node) -> int:
    stack, n = [node], 0
    while stack:
        x = stack.pop()
        n += 1
        if x.children:
            stack.extend(x.children.values())
    return n


# a node object plus its share of its parent's dict entry (CPython, 64-bit)
_NODE_BYTES = sys.getsizeof(_Node(0, (), 0, 0)) + 64


@dataclass
class TreeCursor:
    """A position in a SuffixTree: ``off`` tokens down the edge into ``node`` (off == the edge's
    length: at the node itself); ``match_len`` pattern tokens matched to get here."""
    node: _Node
    off: int
    match_len: int

    @property
    def count(self) -> int:
        return self.node.count

    def children(self) -> Iterator[tuple[int, int, "TreeCursor"]]:
        """(token, count, cursor) of each continuation."""
        nd = self.node
        if self.off < nd.end - nd.start:  # inside an edge: one continuation, everything passes
            yield nd.seq[nd.start + self.off], nd.count, TreeCursor(nd, self.off + 1, self.match_len)
            return
        for tok, child in (nd.children or {}).items():
            yield tok, child.count, TreeCursor(child, 1, self.match_len)


# ------------------------------------------------------------------------------- the local tree
@dataclass
class LocalCursor:
    """A node of the request's own implicit suffix tree: ``starts`` are the positions in
    ``context`` where the node's continuation begins (one per occurrence of the matched suffix),
    ``depth`` tokens of continuation already walked."""
    context: np.ndarray
    starts: np.ndarray
    depth: int
    match_len: int

    @property
    def count(self) -> int:
        return len(self.starts)

    def children(self) -> Iterator[tuple[int, int, "LocalCursor"]]:
        pos = self.starts + self.depth
        pos = pos[pos < len(self.context)]            # occurrences that run into the end stop here
        if not len(pos):
            return
        toks = self.context[pos]
        if len(toks) == 1 or (toks == toks[0]).all():
            yield int(toks[0]), len(toks), LocalCursor(self.context, pos - self.depth, self.depth + 1,
                                                       self.match_len)
            return
        values, counts = np.unique(toks, return_counts=True)
        for v, c in zip(values.tolist(), counts.tolist()):
            keep = pos[toks == v] - self.depth
            yield v, c, LocalCursor(self.context, keep, self.depth + 1, self.match_len)


def local_root(context: np.ndarray, max_len: int, max_occurrences: int = 64) -> LocalCursor | None:
    """context [L] int -> the cursor after the longest suffix (at most ``max_len`` tokens) that also
    occurs earlier with at least one token after it (its ``max_occurrences`` latest occurrences);
    None if the last token never occurred before. Vectorised: one pass over the context, then
    one filter per extra matched token."""
    L = len(context)
    if L < 2 or max_len < 1:
        return None
    ends = np.flatnonzero(context[:L - 1] == context[L - 1])   # e: context[e] == last token, e < L - 1
    m = 1
    while len(ends) and m < max_len:
        ok = ends >= m
        ok[ok] = context[ends[ok] - m] == context[L - 1 - m]
        if not ok.any():
            break
        ends = ends[ok]
        m += 1
    if not len(ends):
        return None
    return LocalCursor(context, ends[-max_occurrences:] + 1, 0, m)


# ------------------------------------------------------------------------------- expansion
def expand(root: TreeCursor | LocalCursor, max_tokens: int, min_token_prob: float,
           max_depth: int | None = None) -> DraftTree:
    """Best-first draft tree from a cursor (module docstring), at most ``max_tokens`` nodes and
    ``max_depth`` levels."""
    out = DraftTree(match_len=root.match_len)
    if max_tokens <= 0 or root.count <= 0 or max_depth == 0:
        return out
    heap: list[tuple[float, int, int, int, int, object]] = []   # (-prob, tie, parent, depth, token, cursor)
    tie = 0

    def push(cur, prob: float, parent: int, depth: int) -> None:
        nonlocal tie
        if max_depth is not None and depth > max_depth:
            return
        for tok, cnt, child in cur.children():
            p = prob * cnt / cur.count
            if p >= min_token_prob:
                heapq.heappush(heap, (-p, tie, parent, depth, tok, child))
                tie += 1

    push(root, 1.0, -1, 1)
    while heap and len(out.token_ids) < max_tokens:
        negp, _, parent, depth, tok, cur = heapq.heappop(heap)
        j = len(out.token_ids)
        out.token_ids.append(tok)
        out.parents.append(parent)
        out.probs.append(-negp)
        push(cur, -negp, j, depth + 1)
    return out


def spec_length(match_len: int, max_tokens: int, max_spec_factor: float, max_spec_offset: float) -> int:
    """How many nodes a match of ``match_len`` tokens earns: the paper's adaptive speculation
    length, ``min(max_tokens, floor(match_len * max_spec_factor + max_spec_offset))``."""
    return max(0, min(max_tokens, int(match_len * max_spec_factor + max_spec_offset + 1e-6)))
