"""AcceptanceResult: the verifier's answer, read by KV commit, proposers and outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

PLACEHOLDER = -1


@dataclass
class AcceptanceResult:
    num_accepted: list[int]        # [B] drafts accepted per request
    output_ids: list[list[int]]    # [B] accepted drafts + one final token (recovered or bonus)
    num_draft: list[int]           # [B] drafts proposed per request
    # [B] the accepted drafts' indices (local to the request, root to leaf); empty lists for
    # chains, where the accepted drafts are 0..num_accepted-1 (see ``accepted``)
    accepted_nodes: list[list[int]] = field(default_factory=list)
    # [B] each output token's logprobs (engine.accept fills it for requests that ask), else empty
    logprobs: list = field(default_factory=list)

    def accepted(self, b: int) -> list[int]:
        """Request b's accepted drafts (local indices, in path order)."""
        if self.accepted_nodes:
            return self.accepted_nodes[b]
        return list(range(self.num_accepted[b]))

    def select(self, idx: list[int]) -> "AcceptanceResult":
        """The results of requests ``idx`` (in that order)."""
        return AcceptanceResult([self.num_accepted[b] for b in idx], [self.output_ids[b] for b in idx],
                                [self.num_draft[b] for b in idx],
                                [self.accepted_nodes[b] for b in idx] if self.accepted_nodes else [])

    def padded(self, width: int) -> list[list[int]]:
        """[B, width] rows padded with PLACEHOLDER (-1), as vLLM's output_token_ids."""
        return [ids + [PLACEHOLDER] * (width - len(ids)) for ids in self.output_ids]
