"""Pure logits transforms. Order (documented, tested against a reference):

    allowed_token_ids / bad_words / min_tokens masks -> logit_bias
    -> penalties (repetition, presence, frequency) -> temperature -> min_p -> top_k -> top_p
    -> softmax

(vLLM's order.) Everything before the temperature also applies to greedy decoding.

Every function takes and returns new tensors; masked tokens get -inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LogitBias:
    """logit_bias of a batch's rows: short ones as entries, long ones as whole rows (the same sums)."""
    sparse: tuple[Tensor, Tensor, Tensor] | None   # (rows [M], token ids [M], values [M]): one per (row, id)
    dense: tuple[Tensor, Tensor] | None            # (rows [R], values [R, V]): distinct rows, 0 off the bias


def apply_token_rules(logits: Tensor, masked: Tensor | None, bias: LogitBias | None) -> Tensor:
    """logits [N, V]; masked [N, V] bool (tokens that may not come next: outside
    allowed_token_ids, banned by bad_words, stop tokens under min_tokens) or None; bias added to
    the logits, or None. Each biased logit becomes logit + value either way (a dense row adds
    0.0 elsewhere: the same values, -0.0 aside)."""
    if masked is not None:
        logits = logits.masked_fill(masked, float("-inf"))
    if bias is not None and bias.sparse is not None:
        rows, ids, values = bias.sparse
        logits = logits.index_put((rows, ids), values, accumulate=True)
    if bias is not None and bias.dense is not None:
        logits = logits.index_add(0, *bias.dense)
    return logits


def apply_penalties(logits: Tensor, seen: Tensor, counts: Tensor, repetition: Tensor,
                    presence: Tensor, frequency: Tensor) -> Tensor:
    """logits [N, V]; seen [N, V] bool (prompt or output); counts [N, V] output counts;
    penalties [N]. vLLM semantics: repetition over prompt+output, presence/frequency over output."""
    rep = repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0).to(logits.dtype)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens with p < min_p * p_max. logits [N, V], min_p [N] (0 = off)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: Tensor, top_k: Tensor) -> Tensor:
    """Keep tokens whose logit is >= the k-th largest (ties kept). top_k [N] long, <= 0 = off."""
    V = logits.shape[-1]
    k = torch.where(top_k <= 0, torch.full_like(top_k, V), top_k.clamp(max=V))
    kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])  # [N, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Nucleus: drop the low tail whose cumulative mass is <= 1 - top_p; the top token always stays."""
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= (1 - top_p)[:, None]
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(-1, idx, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
