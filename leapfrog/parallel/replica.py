"""The target's embedding and LM head, whole, on rank 0 of a tensor-parallel group.

An EAGLE head (model/eagle.py) shares the target's token embedding and, for EAGLE-1, its LM head.
Under tensor parallelism each rank holds only a vocabulary slice of both, and using the sharded
ones would make every draft step a collective program (an all-reduce per embedding lookup, a
gather per head call) that the workers would have to join. The head runs on rank 0 alone, so rank
0 reads these two tensors whole from the checkpoint instead: one extra [V, D] table (two for an
untied EAGLE-1 target) in rank 0's memory, no communication while drafting. The head binds to a
``VocabReplica`` exactly as it binds to an unsharded ``LlamaModel``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from leapfrog.model.llama import LlamaModel, LogitsHead


class VocabReplica(nn.Module):
    """What an EAGLE head reads from its target (args, ``embed``, ``compute_logits``, the RoPE
    table length, dtype and device), with the vocabulary whole."""

    def __init__(self, target: LlamaModel, embed: Tensor, lm_head: Tensor | None) -> None:
        super().__init__()
        self.args = target.args
        self.tp = None   # unsharded: nothing here is a collective
        self.embed = nn.Embedding.from_pretrained(embed, freeze=True)       # [V, D]
        self.head = LogitsHead(embed if lm_head is None else lm_head)      # [V, D], float32 logits
        self.rope_cos = target.rope_cos   # shared, not copied (the head sizes its own table from it)
        self._check = target.check_logits

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, D] -> logits [N, V] float32, as the unsharded target's head computes them."""
        logits = self.head(hidden)
        self._check(logits)
        return logits

    def graph_logits(self, hidden: Tensor) -> Tensor:
        return self.head(hidden)

    def check_logits(self, logits: Tensor) -> None:
        self._check(logits)


def unsharded_view(target: LlamaModel, ckpt: Any, allow_pickle: bool = False) -> LlamaModel | VocabReplica:
    """``target`` itself when it is whole; for a tensor-parallel shard, a VocabReplica with the
    embedding and LM head read whole from ``ckpt`` (the target's loader.Checkpoint)."""
    if target.tp is None:
        return target
    from leapfrog.model.loader import load_whole
    w = load_whole(ckpt, ("embed.weight", "lm_head.weight"), target.dtype, target.device, allow_pickle)
    return VocabReplica(target, w["embed.weight"], w.get("lm_head.weight"))
