"""AcceptanceResult: the verifier's answer, read by KV commit, proposers and outputs."""

from __future__ import annotations

from dataclasses import dataclass

PLACEHOLDER = -1


@dataclass
class AcceptanceResult:
    num_accepted: list[int]        # [B] drafts accepted per request
    output_ids: list[list[int]]    # [B] accepted drafts + one final token (recovered or bonus)
    num_draft: list[int]           # [B] drafts proposed per request

    def padded(self, width: int) -> list[list[int]]:
        """[B, width] rows padded with PLACEHOLDER (-1), as vLLM's output_token_ids."""
        return [ids + [PLACEHOLDER] * (width - len(ids)) for ids in self.output_ids]
