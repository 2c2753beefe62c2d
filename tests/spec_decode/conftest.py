"""Scripted proposers for speculation tests (registered under test-only method names)."""

from __future__ import annotations

import pytest

from leapfrog.spec_decode.draft import DraftBatch
from leapfrog.spec_decode.proposers.base import PROPOSERS, StatelessProposer


class OracleProposer(StatelessProposer):
    """Knows each prompt's greedy continuation; drafts it, but wrong from ``wrong_at`` (draft position)
    on, so partial acceptance happens at known places."""

    def __init__(self, cfg, target, script: dict[tuple[int, ...], list[int]], wrong_at: int | None,
                 vocab_size: int):
        self.script, self.wrong_at, self.V = script, wrong_at, vocab_size

    def propose(self, reqs, ks):
        drafts = []
        for r, k in zip(reqs, ks):
            cont = self.script[tuple(r.prompt_ids)]
            n = len(r.output_ids)
            d = list(cont[n:n + k])
            if self.wrong_at is not None:
                d = [t if j < self.wrong_at else (t + 1) % self.V for j, t in enumerate(d)]
            drafts.append(d)
        return DraftBatch.from_lists(drafts)


@pytest.fixture
def oracle():
    """oracle(script, wrong_at) -> method name to put in speculative_config."""
    names = []

    def make(script, wrong_at=None, vocab_size=320):
        name = f"oracle_test_{len(PROPOSERS)}"
        PROPOSERS[name] = lambda cfg, target: OracleProposer(cfg, target, script, wrong_at, vocab_size)
        names.append(name)
        return name
    yield make
    for n in names:
        PROPOSERS.pop(n, None)
