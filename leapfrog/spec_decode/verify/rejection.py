"""Lossless verification of drafts against the target (Leviathan et al. 2023; Chen et al. 2023).

Notation (the paper's): p = target distribution, q = draft distribution, both the
*processed* distributions the one sampler (``leapfrog/sampling``) would draw from.

Terms:
- accepted token: a draft token x kept because u < min(1, p(x) / q(x)), u ~ U(0, 1);
- recovered token: after the first rejection, a token drawn from norm(max(p - q, 0));
- bonus token: after all k drafts are accepted, a token drawn from p at position k + 1;
- output tokens: accepted tokens followed by exactly one recovered or bonus token.

A point-mass draft (n-gram lookup: q(x) = 1) accepts with probability p(x) and recovers
from p with x removed. A greedy target is a point mass too (p = one-hot of its argmax), so
the same rule yields "accept while argmax matches; the correction is the argmax".

These functions are pure: they read tensors and return new ones. Drawing the final token
from the returned distribution is the sampler's job, so the three callers share one sampler.

Row layout of ``p`` ([T + B, V]): request b owns rows ``start_b .. start_b + k_b``, one per
draft position and then the bonus row; ``start_b = sum_{c<b} (k_c + 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def on_device(device: torch.device, draft_ids: Tensor, q: Tensor | None,
              u: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
    """The drafts, their q and the uniforms on p's device. On CUDA, p is on the host (the runner
    returns logits there) while a drafter's q may stay on the device (the H100 found "Expected all
    tensors to be on the same device", with the engine's uniforms drawn there too then)."""
    return draft_ids.to(device), None if q is None else q.to(device), u.to(device)


@dataclass
class RejectionOutcome:
    num_accepted: list[int]   # [B]
    final_probs: Tensor       # [B, V] distribution of each request's final token


def rejection_accept(
    p: Tensor,                 # [T + B, V] target probs: draft rows then the bonus row, per request
    q: Tensor | None,          # [T, V] draft probs, None => point-mass drafts
    draft_ids: Tensor,         # [T] long
    num_draft: list[int],      # [B]
    u: Tensor,                 # [T] pre-drawn U(0, 1)
) -> RejectionOutcome:
    draft_ids, q, u = on_device(p.device, draft_ids, q, u)
    B = len(num_draft)
    starts, s = [], 0
    for k in num_draft:
        starts.append(s)
        s += k + 1
    # Target rows that score drafts: row start_b + j for draft j of request b.
    draft_rows = torch.tensor([starts[b] + j for b, k in enumerate(num_draft) for j in range(k)],
                              dtype=torch.long, device=p.device)
    T = len(draft_ids)
    if T:
        p_x = p[draft_rows, draft_ids]                                   # [T]
        q_x = q[torch.arange(T, device=p.device), draft_ids] if q is not None else torch.ones_like(p_x)
        accept = (u < p_x / q_x).tolist()                                # one host transfer
    else:
        accept = []
    num_accepted, final_rows, residual_of = [], [], []
    t = 0
    for b, k in enumerate(num_draft):
        n = 0
        while n < k and accept[t + n]:
            n += 1
        num_accepted.append(n)
        final_rows.append(starts[b] + n)
        residual_of.append(t + n if n < k else -1)  # flat draft index of the rejected token
        t += k
    final = p[torch.tensor(final_rows, dtype=torch.long)].clone()        # [B, V]
    rejected = [b for b in range(B) if residual_of[b] >= 0]
    if rejected:
        idx = torch.tensor([residual_of[b] for b in rejected], dtype=torch.long)
        rows = final[rejected]
        if q is not None:
            resid = (rows - q[idx]).clamp_min(0)
        else:
            resid = rows.scatter(1, draft_ids[idx][:, None], 0.0)
        mass = resid.sum(-1, keepdim=True)
        # mass == 0 only when p == q up to rounding (then rejection had probability ~0): keep p.
        final[rejected] = torch.where(mass > 0, resid / mass.clamp_min(1e-30), rows)
    return RejectionOutcome(num_accepted, final)
