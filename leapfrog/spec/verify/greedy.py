"""Greedy verification: accept while the draft equals the target's argmax; the final token
(correction or bonus) is the target's argmax at the first mismatch. Same row layout as
``rejection.py``; this is its point-mass special case, without building [T + B, V] one-hots.

Example: drafts [5, 7, 9], target argmax rows [5, 7, 2, 4] -> accept 2, output [5, 7, 2].
"""

from __future__ import annotations

from leapfrog.spec.verify.result import AcceptanceResult


def greedy_accept(target_argmax: list[int], draft_ids: list[int], num_draft: list[int]) -> AcceptanceResult:
    num_accepted, outputs = [], []
    r = t = 0
    for k in num_draft:
        n = 0
        while n < k and draft_ids[t + n] == target_argmax[r + n]:
            n += 1
        num_accepted.append(n)
        outputs.append(draft_ids[t:t + n] + [target_argmax[r + n]])
        r += k + 1
        t += k
    return AcceptanceResult(num_accepted, outputs, list(num_draft))
