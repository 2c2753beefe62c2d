"""Log-probabilities of chosen tokens (vLLM's ``logprobs`` / ``prompt_logprobs``), pure.

The values always come from the target's logits at the token's row: for an accepted draft
that is the verify forward's row, never the drafter's q. ``logprobs_mode`` (vLLM's names):

    raw_logprobs        log_softmax of the model's logits (default)
    raw_logits          the model's logits
    processed_logprobs  log_softmax of the logits the sampler draws from (token rules,
                        penalties, temperature, min_p/top_k/top_p; masked tokens -inf)
    processed_logits    those logits

Prompt logprobs use the raw family of the mode (no sampling happens at prompt positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from leapfrog.sampling import sampler
from leapfrog.sampling.sampler import RowSpec

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the chosen token's value and rank (1 = most likely), and the top k."""
    token_id: int
    value: float
    rank: int
    top: tuple[tuple[int, float], ...]   # (token id, value), best first, k entries


def values(logits: Tensor, mode: str, specs: Sequence[RowSpec] | None = None) -> Tensor:
    """logits [N, V] float32 -> [N, V] per ``mode``. Processed modes need the rows' ``specs``
    (the same processing the sampler applies, sampling/sampler.py)."""
    if mode.startswith("processed") and specs is not None:
        logits = sampler.processed_logits(logits, sampler.build_rows(specs, logits.shape[-1], logits.device))
    return torch.log_softmax(logits.float(), dim=-1) if mode.endswith("logprobs") else logits.float()


def gather(vals: Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """vals [N, V] (see ``values``), the chosen token of each row, k top entries per row ->
    one TokenLogprobs per row (one host transfer)."""
    N = vals.shape[0]
    if N == 0:
        return []
    tok = torch.tensor(list(token_ids), dtype=torch.long, device=vals.device)
    chosen = vals.gather(1, tok[:, None])[:, 0]                       # [N]
    rank = (vals > chosen[:, None]).sum(-1) + 1                        # [N]
    kmax = max(ks)
    top_v, top_i = vals.topk(kmax, dim=-1) if kmax else (vals[:, :0], tok[:, None][:, :0])
    chosen_l, rank_l, top_vl, top_il = chosen.tolist(), rank.tolist(), top_v.tolist(), top_i.tolist()
    return [TokenLogprobs(int(token_ids[i]), chosen_l[i], rank_l[i],
                          tuple(zip(top_il[i][:ks[i]], top_vl[i][:ks[i]]))) for i in range(N)]
