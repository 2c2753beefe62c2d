"""spec_decode/rate.py: DepthShape, the chains' acceptance by draft position, against exact
expectations (the geometric model with one pooled rate as the contrast)."""

from __future__ import annotations

import math

import pytest
import torch

from leapfrog.spec_decode.adaptive import SpecController
from leapfrog.spec_decode.config import SpeculativeConfig
from leapfrog.spec_decode.draft import DraftBatch
from leapfrog.spec_decode.rate import DepthShape, TokenRate, geometric_tokens
from leapfrog.spec_decode.verify.result import AcceptanceResult


def _exact(p: list[float], k: int) -> float:
    """E[tokens] of a chain of k whose position i is accepted (given all before) with p[i]."""
    return 1.0 + sum(math.prod(p[:i + 1]) for i in range(k))


def _chains(groups: list[tuple[list[float], int]], depth: int) -> list[tuple[int, int]]:
    """(accepted, tried) of n chains of ``depth`` per group (p per position, n): the exact
    frequencies of each accepted count, up to 1 / n."""
    out = []
    for p, n in groups:
        for j in range(n):
            m = sum(j < n * math.prod(p[:i + 1]) for i in range(depth))
            out.append((m, m + (m < depth)))
    return out


def _feed(shape: DepthShape, chains: list[tuple[int, int]], steps: int = 20) -> None:
    for _ in range(steps):
        shape.update(chains)


def _pooled(chains: list[tuple[int, int]]) -> float:
    return sum(m for m, _ in chains) / sum(t for _, t in chains)


def test_acceptance_falling_with_depth_is_expected_as_it_falls():
    """A drafter whose acceptance falls with the position: chains are expected as they are, where
    the geometric model at the pooled rate, taking every position alike, underrates them; chains
    longer than any measured take the deepest position's rate."""
    p = [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65]
    shape = DepthShape.new(7)
    chains = _chains([(p, 1000)], 7)
    _feed(shape, chains)
    alpha = _pooled(chains)
    for k in (1, 3, 5, 7):
        assert shape.expected_tokens(alpha, k) == pytest.approx(_exact(p, k), rel=0.03), k
    assert geometric_tokens(alpha, 7) < 0.95 * _exact(p, 7)
    # measured on chains of 5 only: deeper positions take the deepest one's shape
    shape5 = DepthShape.new(7)
    chains5 = _chains([(p, 1000)], 5)
    _feed(shape5, chains5)
    a5 = _pooled(chains5)
    assert shape5.expected_tokens(a5, 5) == pytest.approx(_exact(p, 5), rel=0.03)
    assert shape5.expected_tokens(a5, 7) == pytest.approx(_exact(p[:5] + [p[4]] * 2, 7), rel=0.03)


def test_a_batch_of_unlike_requests_is_expected_at_their_mean():
    """Requests that accept 0.95 and 0.4 a position, in one batch: the batch's tokens per chain are
    the mean of theirs; the geometric model at the pooled rate (weighted toward the request that
    tries more) overrates them."""
    hi, lo = [0.95] * 7, [0.4] * 7
    shape = DepthShape.new(7)
    chains = _chains([(hi, 500), (lo, 500)], 7)
    _feed(shape, chains)
    alpha = _pooled(chains)
    mean = (_exact(hi, 7) + _exact(lo, 7)) / 2
    assert shape.expected_tokens(alpha, 7) == pytest.approx(mean, rel=0.03)
    assert geometric_tokens(alpha, 7) > 1.05 * mean


def test_the_level_is_alpha_and_only_the_shape_comes_from_the_positions():
    """With every position accepted alike, the shape is flat: the geometric model at whatever alpha
    is given (a probe's fresh rate replaces the level, not the shape); untried: geometric."""
    shape = DepthShape.new(5)
    assert shape.expected_tokens(0.6, 5) == geometric_tokens(0.6, 5)
    _feed(shape, _chains([([0.8] * 5, 1000)], 5))
    for alpha in (0.5, 0.8, 0.9):
        assert shape.expected_tokens(alpha, 5) == pytest.approx(geometric_tokens(alpha, 5), rel=0.02)


def test_the_controller_weighs_sampled_chains_by_their_depth_shape():
    """Steps of sampled chains observed by the controller teach its depth shape: a chain of 7 is
    then expected as it makes, above the geometric model's tokens at the same alpha."""
    cfg = SpeculativeConfig.from_dict({"method": "eagle3", "model": "h", "num_speculative_tokens": 7,
                                       "eagle_topk": 1})
    ctl = SpecController(cfg, 4096)
    ctl.sampled = True
    p = [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65]
    chains = _chains([(p, 50)], 7)
    num_accepted = [m for m, _ in chains]
    drafts = DraftBatch(torch.zeros(7 * len(chains), dtype=torch.long), [7] * len(chains))
    result = AcceptanceResult(num_accepted, [[0] * (m + 1) for m in num_accepted], [7] * len(chains))
    reqs = [_Sampled() for _ in chains]
    for _ in range(10):
        ctl.observe(reqs, drafts, result, 0.001, 0.002)
    assert ctl.sampled and ctl.alpha == pytest.approx(_pooled(chains), rel=0.01)
    assert ctl.expected_chain_tokens(7) == pytest.approx(_exact(p, 7), rel=0.05)
    assert geometric_tokens(ctl.alpha, 7) < 0.95 * ctl.expected_chain_tokens(7)
    assert isinstance(ctl.acceptance, TokenRate)


class _Sampled:
    sampled = True
    unseeded_sampled = True
    num_speculative_tokens = None
    max_tokens = 1000
    output_ids = [1]
    num_computed = 10

    def __init__(self) -> None:
        self.request_id = id(self)


def test_a_rate_remembers_a_few_steps_however_many_tokens_each_brings():
    """A window of tokens is about one step at large batches (a batch of 16 verifying chains of 4
    predicts 64 tokens a step): the memory is still about _RATE_MIN_STEPS steps, so one unlucky step
    moves the rate by about a quarter of its miss, where it replaced it nearly whole; at batch 1
    (a few tokens a step) the window of tokens rules as before."""
    from leapfrog.spec_decode.rate import _RATE_MIN_STEPS, _RATE_STEPS, _RATE_WINDOW
    large = TokenRate(prior=1.0)
    for _ in range(20):
        large.update(64.0, 64.0)          # calibrated: accepted = predicted
    large.update(32.0, 64.0)              # one step at half
    assert 1 - 0.5 / _RATE_MIN_STEPS - 0.05 < large.value < 1 - 0.5 / _RATE_MIN_STEPS + 0.05
    small = TokenRate(prior=1.0)
    for _ in range(40):
        small.update(4.0, 4.0)
    small.update(2.0, 4.0)
    keep = min((1 - 1 / _RATE_WINDOW) ** 4, 1 - 1 / _RATE_STEPS)   # (no floor from _RATE_MIN_STEPS)
    assert keep > 1 - 1 / _RATE_MIN_STEPS
    expected = (keep * 4.0 * (1 - keep ** 40) / (1 - keep) + 2.0) / (keep * 4.0 * (1 - keep ** 40) / (1 - keep) + 4.0)
    assert small.value == pytest.approx(expected, rel=1e-9)
