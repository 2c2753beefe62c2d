"""Seeded positions' noise (sampler.position_noise): the counter-based uniforms against a plain
Python splitmix64, the exponentials against a correctly rounded log, the C++ op and races
(sampling/native.py) bitwise the torch twin's rows and races, and seeded draws following p."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from leapfrog.sampling import native, sampler
from leapfrog.sampling.sampler import PositionKey, row_key, seed_key, signed64
from tests.stats import chisq_pvalue

_M = (1 << 64) - 1


def _keys(n: int) -> list[int]:
    seeds = (0, -1, 5, 2**63, 10**30)
    return [row_key(PositionKey(seed_key(seeds[i % len(seeds)]), i)) for i in range(n)]


def _twin(keys: list[int], V: int, exponential: bool) -> torch.Tensor:
    u = sampler._twin_uniforms(torch.tensor([signed64(k) for k in keys]), V)
    return sampler._twin_neg_log(u) if exponential else u


@pytest.fixture(scope="module")
def op():
    if not native.load_native_noise():
        pytest.skip("the noise op cannot be built here")


def test_uniforms_are_splitmix64_and_exponentials_are_minus_log_u():
    keys, V = _keys(6), 300
    u, e = _twin(keys, V, False), _twin(keys, V, True)
    for i, k in enumerate(keys):
        for v in (0, 1, 255, 256, V - 1):
            h = sampler._mix64((k + (v + 1) * 0x9E3779B97F4A7C15) & _M)
            assert u[i, v].item() == ((h >> 12) + 0.5) * 2.0 ** -52
    assert bool((u > 0).all() and (u < 1).all() and (e > 0).all())
    ref = torch.tensor([[-math.log(x) for x in row] for row in u.tolist()], dtype=torch.float64)
    assert ((e - ref).abs() / ref).max().item() < 5e-16
    # the extremes of U: 2^-53 and 1 - 2^-53, around sqrt(1/2), and powers of two
    ext = torch.tensor([2.0 ** -53, 1 - 2.0 ** -53, 0.7071067811865475, 0.7071067811865476, 0.5, 0.25],
                       dtype=torch.float64)
    got = sampler._twin_neg_log(ext)
    assert all(abs(g + math.log(x)) <= 5e-16 * -math.log(x) for g, x in zip(got.tolist(), ext.tolist()))
    # distinct positions and keys give different rows
    assert len({tuple(r[:4]) for r in u.tolist()}) == len(keys)


@pytest.mark.parametrize("V", [50, 4099, 8192])
def test_the_op_computes_the_twins_rows_bit_for_bit(op, V):
    keys = _keys(9)
    k = torch.tensor([signed64(x) for x in keys])
    for exponential in (False, True):
        assert torch.equal(native.noise_rows(k, V, exponential), _twin(keys, V, exponential))


@pytest.mark.parametrize("V", [50, 4099, 8192])
def test_the_ops_race_finds_what_racing_every_column_finds(op, V):
    """race_rows (E only where a column can finish in the top k) against p / E over every column:
    peaked and flat rows, rows with few columns of p > 0 (top-p), float32 and float64 p, greedy
    rows beside, k = 1 and 4."""
    g = torch.Generator().manual_seed(V)
    for trial in range(12):
        N = 6
        p = torch.softmax(torch.randn(N, V, generator=g) * (0.3 + trial % 4) / 0.7, -1)
        if trial % 3 == 0:
            thr = p.topk(3, -1).values[:, -1:]
            p = torch.where(p >= thr, p, torch.zeros_like(p))
            p = p / p.sum(-1, keepdim=True)
        if trial % 4 == 1:
            p = p.double()
        rngs = [PositionKey(seed_key(trial), n) if n % 3 else None for n in range(N)]
        r = p / sampler.exponentials(rngs, V)
        keys = sampler.noise_keys(rngs)
        for k in (1, 4):
            values, columns = native.race_rows(p, keys, k)
            want = r.topk(k, -1)
            assert torch.equal(values, want.values)
            live = want.values > 0   # (columns of p = 0 tie at 0: torch.topk's order is any)
            assert torch.equal(columns[live], want.indices[live])
            for row in range(N):   # the op's: the earliest of equal values first, as race_top_row
                dead = columns[row][~live[row]].tolist()
                zeros = [v for v in range(V) if r[row, v] == 0]
                assert dead == zeros[:len(dead)]
            if k == 1:
                assert torch.equal(columns[:, 0], r.argmax(-1))


def test_sample_and_race_top_give_the_same_with_the_op_and_without(op, monkeypatch):
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(8, 500, generator=g) * 3, -1)
    rngs = [PositionKey(seed_key(7), n) if n != 2 else None for n in range(8)]
    a, ta = sampler.sample(p, rngs), sampler.race_top(p, rngs, 3)
    monkeypatch.setattr(native, "noise_op_loaded", lambda: False)
    b, tb = sampler.sample(p, rngs), sampler.race_top(p, rngs, 3)
    assert torch.equal(a, b) and torch.equal(ta.values, tb.values) and torch.equal(ta.indices, tb.indices)


def test_seeded_draws_follow_p():
    """One draw per seed at one position, 6000 seeds: the token counts fit p (the race with this
    noise is exact sampling)."""
    V = 40
    p = torch.softmax(torch.randn(1, V, generator=torch.Generator().manual_seed(2)) * 1.5, -1)
    keys = [row_key(PositionKey(seed_key(s), 3)) for s in range(6000)]
    e = _twin(keys, V, True)
    x = (p.double() / e).argmax(-1).numpy()
    assert chisq_pvalue(np.bincount(x, minlength=V), p[0].double().numpy()) > 1e-4


def test_race_top_refuses_stream_rows():
    """An unseeded request's stream draws by inverse CDF: racing it would read noise it has none of."""
    with pytest.raises(TypeError, match="inverse CDF"):
        sampler.race_top(torch.full((1, 4), 0.25), [torch.Generator()], 1)
