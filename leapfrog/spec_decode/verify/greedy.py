"""Verification by matching: accept while the draft equals the target's own token; the final
token (correction or bonus) is the target's token at the first mismatch. Same row layout as
``rejection.py``.

The target's token at each row is either
- its argmax (greedy requests): the point-mass special case of rejection sampling, without
  building [T + B, V] one-hots; or
- its seeded draw x_n = argmax_v p_n(v) / E_n(v), with E_n ~ Exp(1) a pure function of the
  request's seed and the output position n (``sampling.sampler.sample`` with a PositionKey).
  This is drafter-invariant speculative decoding (Daliri, Musco, Suresh, "Coupling without
  communication and drafter-invariant speculative decoding", 2024): the output is exactly the
  sequence the target alone produces with that seed, whatever was drafted, so it is lossless and
  seeded output does not depend on K, adaptive choices, the batch or the method. A draft model
  draws its proposal with the same E_n (a Gumbel coupling), so it matches with probability at
  least (1 - TV(p, q)) / (1 + TV(p, q)); a point-mass draft x matches with probability p(x),
  exactly as in rejection sampling.

Example: drafts [5, 7, 9], target tokens [5, 7, 2, 4] -> accept 2, output [5, 7, 2].
"""

from __future__ import annotations

from leapfrog.spec_decode.verify.result import AcceptanceResult


def greedy_accept(target_tokens: list[int], draft_ids: list[int], num_draft: list[int]) -> AcceptanceResult:
    """target_tokens [T + B] (the target's token per row), draft_ids [T], num_draft [B]."""
    num_accepted, outputs = [], []
    r = t = 0
    for k in num_draft:
        n = 0
        while n < k and draft_ids[t + n] == target_tokens[r + n]:
            n += 1
        num_accepted.append(n)
        outputs.append(draft_ids[t:t + n] + [target_tokens[r + n]])
        r += k + 1
        t += k
    return AcceptanceResult(num_accepted, outputs, list(num_draft))
