"""The target's embedding and LM head, whole, on rank 0 of a tensor-parallel group.

An EAGLE head (model/eagle.py) shares the target's token embedding and, for EAGLE-1, its LM head.
Under tensor parallelism each rank holds only a vocabulary slice of both, and using the sharded
ones would make every draft step a collective program (an all-reduce per embedding lookup, a
gather per head call) that the workers would have to join. The head runs on rank 0 alone, so rank
0 reads what the head uses whole from the checkpoint instead, no communication while drafting.
Memory on rank 0: the [V, D] embedding in the model's dtype unless the head has its own, and for
EAGLE-1 the target's LM head as the unsharded target's head keeps it on CPU (a float32 copy,
V x D x 4 bytes, packed; bf16 weights through model/native_linear.py's kernel on AVX-512 BF16).
The head binds to a ``VocabReplica`` exactly as it binds to an unsharded ``LlamaModel``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from leapfrog.model.llama import LlamaModel, LogitsHead


class VocabReplica(nn.Module):
    """What an EAGLE head reads from its target (args, ``embed``, ``compute_logits``, the RoPE
    table length, dtype and device), with the vocabulary whole. ``embed`` / ``lm_head`` None: the
    head does not use it (it has its own embedding; an EAGLE-3 head has its own LM head)."""

    def __init__(self, target: LlamaModel, embed: Tensor | None, lm_head: Tensor | None) -> None:
        super().__init__()
        self.args = target.args
        self.tp = None   # unsharded: nothing here is a collective
        self.embed = None if embed is None else nn.Embedding.from_pretrained(embed, freeze=True)   # [V, D]
        self.head = None if lm_head is None else LogitsHead(lm_head)   # [V, D] -> float32 logits
        self.rope_cos = target.rope_cos   # shared, not copied (the head sizes its own table from it)
        self._check = target.check_logits
        self._dtype, self._device = target.dtype, target.device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, D] -> logits [N, V] float32, as the unsharded target's head computes them."""
        logits = self.graph_logits(hidden)
        self._check(logits)
        return logits

    def graph_logits(self, hidden: Tensor) -> Tensor:
        assert self.head is not None, "this replica was built without the LM head (need_head=False)"
        return self.head(hidden)

    def check_logits(self, logits: Tensor) -> None:
        self._check(logits)


def unsharded_view(target: LlamaModel, ckpt: Any, allow_pickle: bool = False, need_embed: bool = True,
                   need_head: bool = True) -> LlamaModel | VocabReplica:
    """``target`` itself when it is whole; for a tensor-parallel shard, a VocabReplica with the
    embedding (``need_embed``) and the LM head (``need_head``; a tied model's is its embedding)
    read whole from ``ckpt`` (the target's loader.Checkpoint)."""
    if target.tp is None:
        return target
    if ckpt is None:
        raise ValueError("a tensor-parallel target's whole embedding / LM head are read from its checkpoint: "
                         "pass it (TargetInfo.checkpoint)")
    from leapfrog.model.loader import load_whole
    tied = target.args.tie_word_embeddings
    names = tuple(n for n, need in (("embed.weight", need_embed or (need_head and tied)),
                                    ("lm_head.weight", need_head and not tied)) if need)
    w = load_whole(ckpt, names, target.dtype, target.device, allow_pickle)
    head = w.get("embed.weight") if tied else w.get("lm_head.weight")
    return VocabReplica(target, w.get("embed.weight") if need_embed else None, head if need_head else None)
