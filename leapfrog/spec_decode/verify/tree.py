"""Lossless verification of draft *trees*: matching (greedy / seeded) and recursive rejection
sampling. Pure functions; the chain functions (``greedy.py``, ``rejection.py``) are the special
case ``parents = [-1, 0, 1, ...]``, and the tests hold these to exactly that.

Trees (``spec_decode/draft.py``): ``parents[j]`` is the parent of draft node j as an index local
to its request (-1 = the root, the request's last committed token); parents come before their
children; siblings are distinct tokens, best first.

Row layout of the target tensors ([T + B] rows, T = sum T_b): request b owns rows
``s_b .. s_b + T_b`` with ``s_b = sum_{c<b} (T_c + 1)``; row ``s_b`` is the root and row
``s_b + 1 + j`` the state after draft node j. So node j is *scored* by its parent's row,
``s_b + 1 + parents[j]``, and the row of the last accepted node gives the final token.

Notation (``rejection.py``'s glossary): p = target distribution, q = draft distribution, both
processed by the one sampler; u ~ U(0, 1); norm(f) = f / sum(f). (Papers differ on which letter
is the target; these are this package's letters throughout.)

Matching (``tree_match_accept``): walk from the root; at the current node accept the child whose
token equals the target's own token at the node's row (its argmax, or its seeded draw, see
``greedy.py``); the final token is the target's token at the last accepted node's row.

Sampling (``tree_rejection_accept``): recursive rejection sampling, RRS (Jeon et al. 2024,
"Recursive Speculative Decoding: Accelerating LLM Inference via Sampling Without Replacement").
At a node with target p (the node's row) and children x_1 .. x_m (index order):

    p_1 = p
    for i = 1 .. m:
        q_i = norm(q with x_1 .. x_{i-1} set to 0)        # siblings drawn without replacement
        accept x_i if u_{x_i} < p_i(x_i) / q_i(x_i)      # then recurse into x_i with its row's p
        p_{i+1} = norm(max(p_i - q_i, 0))                 # else the residual (p_i if its mass is 0)
    all rejected (or no children): the final token ~ p_{m+1}

Point-mass drafts (q = None, q_i = one-hot of x_i) make this SpecInfer's multi-round speculative
sampling (Miao et al. 2024, "SpecInfer") with q = delta: x_i is accepted with probability
p_i(x_i), and p_{i+1} is p_i with x_i zeroed and renormalised. A rejected x_i has
p_i(x_i) < q_i(x_i), so p_{i+1}(x_i) = 0: the final token is never a rejected sibling.

When it is lossless (the first emitted token ~ p_root; given an accepted child c, the next ~ p_c):
- q = None: the children are any *deterministic* function of the context (n-gram, suffix tree,
  top-k of a draft model);
- q given: the children of a node are drawn *without replacement* from one q (Gumbel-top-k, as
  RSD draws them), independently of u, and ``q[t]`` is that shared q for each child t (a row
  already conditioned on the earlier siblings is fine too: zeroing them again changes nothing).
  Top-k children scored with the draft model's q are *not* samples of q: pass q = None for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from leapfrog.spec_decode.verify.rejection import on_device
from leapfrog.spec_decode.verify.result import AcceptanceResult


def _children(parents: list[int]) -> dict[int, list[int]]:
    """Node -> its children in index order (-1 = the root)."""
    out: dict[int, list[int]] = {-1: []}
    for j, par in enumerate(parents):
        out.setdefault(par, []).append(j)
    return out


def _starts(num_draft: list[int]) -> tuple[list[int], list[int]]:
    """(first target row s_b, first flat draft o_b) of each request."""
    rows, flats, r, t = [], [], 0, 0
    for k in num_draft:
        rows.append(r)
        flats.append(t)
        r += k + 1
        t += k
    return rows, flats


def tree_match_accept(target_tokens: list[int], draft_ids: list[int], parents: list[int],
                      num_draft: list[int]) -> AcceptanceResult:
    """target_tokens [T + B] (the target's token per row), draft_ids [T], parents [T] (local),
    num_draft [B] -> the accepted path per request plus the target's token after it.

    Example: drafts [a, b, c, d], parents [-1, -1, 1, 1], target tokens per row
    [b, x, d, y, z] (root, a, b, c, d) -> accept [b, d] (nodes [1, 3]), output [b, d, z].
    """
    num_accepted, outputs, nodes = [], [], []
    for s, o, k in zip(*_starts(num_draft), num_draft):
        kids = _children(parents[o:o + k])
        path, cur = [], -1
        while True:
            tok = target_tokens[s + 1 + cur]
            nxt = next((c for c in kids.get(cur, ()) if draft_ids[o + c] == tok), None)
            if nxt is None:
                break
            path.append(nxt)
            cur = nxt
        num_accepted.append(len(path))
        outputs.append([draft_ids[o + j] for j in path] + [target_tokens[s + 1 + cur]])
        nodes.append(path)
    return AcceptanceResult(num_accepted, outputs, list(num_draft), nodes)


@dataclass
class TreeRejectionOutcome:
    accepted_nodes: list[list[int]]   # [B] accepted drafts per request (local indices, root to leaf)
    final_probs: Tensor               # [B, V] distribution of each request's final token

    @property
    def num_accepted(self) -> list[int]:
        return [len(path) for path in self.accepted_nodes]


def _residual(p_i: Tensor, q_i: Tensor | None, x: Tensor) -> Tensor:
    """p_{i+1} = norm(max(p_i - q_i, 0)) ([V]); q_i None = one-hot of x; p_i where the mass is 0
    (p_i == q_i up to rounding, when rejection had probability ~0), as ``rejection.py``."""
    resid = p_i.index_fill(0, x, 0.0) if q_i is None else (p_i - q_i).clamp_min(0)
    mass = resid.sum()
    return torch.where(mass > 0, resid / mass.clamp_min(1e-30), p_i)


def tree_rejection_accept(
    p: Tensor,                 # [T + B, V] target probs, tree row layout (module docstring)
    q: Tensor | None,          # [T, V] draft probs of each node (its parent context), None => point mass
    draft_ids: Tensor,         # [T] long
    parents: list[int],        # [T] local parent per draft (-1 = root)
    num_draft: list[int],      # [B]
    u: Tensor,                 # [T] pre-drawn U(0, 1), one per draft node (each is tried at most once)
) -> TreeRejectionOutcome:
    """Recursive rejection sampling over each request's tree (module docstring). Host syncs: one
    for the first child tried at every node (p_1 = p, q_1 = q need no residual), then one per
    later sibling tried."""
    draft_ids, q, u = on_device(p.device, draft_ids, q, u)
    T, dev = len(draft_ids), p.device
    row_start, flat_start = _starts(num_draft)
    # First tries, all at once: node t against its parent's unmodified row.
    scoring = torch.tensor([s + 1 + parents[o + j] for s, o, k in zip(row_start, flat_start, num_draft)
                            for j in range(k)], dtype=torch.long, device=dev)
    if T:
        p_x = p[scoring, draft_ids]                                           # [T]
        q_x = q[torch.arange(T, device=dev), draft_ids] if q is not None else torch.ones_like(p_x)
        first_try = (u < p_x / q_x).tolist()                                  # one host transfer
    else:
        first_try = []
    paths, finals = [], []
    for s, o, k in zip(row_start, flat_start, num_draft):
        kids = _children(parents[o:o + k])
        path, cur = [], -1
        while True:
            p_i = p[s + 1 + cur]                                              # [V] view, never written
            tried: list[int] = []                                             # flat ids of rejected siblings
            for c in kids.get(cur, ()):
                t = o + c
                if not tried:
                    q_i = None if q is None else q[t]
                    ok = first_try[t]
                else:
                    q_i = None
                    if q is not None:
                        z = q[t].index_fill(0, draft_ids[tried], 0.0)         # without replacement
                        q_i = z / z.sum().clamp_min(1e-30)
                    ratio = p_i[draft_ids[t]] if q_i is None else p_i[draft_ids[t]] / q_i[draft_ids[t]]
                    ok = bool(u[t] < ratio)                                   # one host sync
                if ok:
                    break
                p_i = _residual(p_i, q_i, draft_ids[t:t + 1])
                tried.append(t)
            else:
                finals.append(p_i)
                break
            path.append(c)
            cur = c
        paths.append(path)
    final = torch.stack(finals) if finals else p.new_zeros(0, p.shape[-1])    # [B, V] (new tensor)
    return TreeRejectionOutcome(paths, final)
