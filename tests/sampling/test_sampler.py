"""The sampler against an independent numpy reference, statistically and exactly."""

from __future__ import annotations

from unittest.mock import patch

import numpy as np
import pytest
import torch

from leapfrog.sampling import sampler
from leapfrog.sampling.sampler import RowSpec
from leapfrog.sampling_params import SamplingParams
from leapfrog.errors import ConfigError
from tests.stats import chisq_pvalue

V = 50


def reference_probs(logits: np.ndarray, sp: SamplingParams, prompt=(), output=()) -> np.ndarray:
    """Straightforward per-token reference of the documented order of transforms."""
    x = logits.astype(np.float64).copy()
    seen = set(prompt) | set(output)
    for t in seen:
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(output):
        x[t] -= sp.frequency_penalty * list(output).count(t) + sp.presence_penalty
    if sp.greedy:
        out = np.zeros_like(x)
        out[np.argmax(x)] = 1
        return out
    x = x / sp.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = np.ones(V, bool)
    if sp.min_p > 0:
        keep &= p >= sp.min_p * p.max()
    if sp.top_k > 0:
        kth = np.sort(np.where(keep, x, -np.inf))[::-1][sp.top_k - 1]
        keep &= x >= kth
    if sp.top_p < 1:
        order = np.argsort(np.where(keep, x, -np.inf))  # ascending
        q = np.where(keep, np.exp(x - x.max()), 0)
        q = q / q.sum()
        cum = np.cumsum(q[order])
        drop = cum <= 1 - sp.top_p
        drop[-1] = False
        keep[order[drop]] = False
    p = np.where(keep, np.exp(x - x.max()), 0)
    return p / p.sum()


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=0, repetition_penalty=2.0),
]


def logits_fixture(seed=0):
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("sp", SETTINGS, ids=lambda s: repr(s)[15:70])
def test_probs_equal_reference(sp):
    logits = logits_fixture()
    prompt, output = [1, 2, 3, 3], [4, 4, 5, 1]
    rows = sampler.build_rows([RowSpec(sp, prompt, output)], V)
    got = sampler.probs(logits[None], rows)[0].double().numpy()
    ref = reference_probs(logits.numpy(), sp, prompt, output)
    np.testing.assert_allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("sp", SETTINGS[:6], ids=lambda s: repr(s)[15:70])
def test_samples_follow_reference(sp):
    """Chi-square goodness of fit, 20000 draws, false-alarm rate 1e-3 per setting."""
    logits = logits_fixture(1)
    rows = sampler.build_rows([RowSpec(sp, [], [])] * 20000, V)
    p = sampler.probs(logits.expand(20000, V), rows)
    g = torch.Generator().manual_seed(123)
    draws = sampler.sample(p, [g] * 20000).numpy()
    ref = reference_probs(logits.numpy(), sp)
    assert chisq_pvalue(np.bincount(draws, minlength=V), ref) > 1e-3


def test_min_tokens_suppresses_stop_ids():
    logits = torch.zeros(V)
    logits[7] = 10
    sp = SamplingParams(temperature=0, min_tokens=3)
    rows = sampler.build_rows([RowSpec(sp, [1], [9], stop_ids=(7,)), RowSpec(sp, [1], [9, 9, 9], stop_ids=(7,))], V)
    assert sampler.greedy_tokens(logits.expand(2, V), rows).tolist()[1] == 7
    assert sampler.greedy_tokens(logits.expand(2, V), rows).tolist()[0] != 7


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                    dict(min_p=2), dict(max_tokens=0), dict(n=0), dict(stop=[""]),
                                    dict(presence_penalty=3), dict(repetition_penalty=0), dict(seed="x"),
                                    dict(min_tokens=5, max_tokens=2), dict(stop_token_ids=[-1])])
def test_invalid_params_rejected(kwargs):
    with pytest.raises(ConfigError, match=list(kwargs)[0]):
        SamplingParams(**kwargs)


def test_sample_never_draws_a_zero_probability_token():
    """U = 0 exactly must not let a p = 0 token win (E would be inf and every score 0)."""
    from leapfrog.sampling.sampler import PositionKey
    p = torch.zeros(3, 16)
    p[:, 7] = 1.0
    real_rand = torch.rand

    def zeros(*a, out=None, **kw):
        real_rand(*a, out=out, **kw)
        return out.zero_()
    torch.rand = zeros
    try:
        toks = sampler.sample(p, [PositionKey(1, 0), torch.Generator().manual_seed(0), None])
    finally:
        torch.rand = real_rand
    assert toks.tolist() == [7, 7, 7]


def test_inverse_cdf_draw_follows_the_mass_and_never_draws_zero_mass():
    """Draws with many uniforms follow the normalized mass (chi-square), a zero-mass token is
    never drawn, and a uniform at the top of [0, 1) still draws a token with mass."""
    mass = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 0.5])
    g = torch.Generator().manual_seed(0)
    w = torch.rand(20_000, generator=g, dtype=torch.float64)
    x = sampler.inverse_cdf_draw(mass.expand(len(w), -1), w)
    counts = torch.bincount(x, minlength=len(mass)).numpy()
    assert counts[mass.numpy() == 0].sum() == 0
    assert chisq_pvalue(counts, (mass / mass.sum()).numpy()) > 1e-3
    top = torch.tensor([1 - 2.0 ** -53], dtype=torch.float64)
    assert int(sampler.inverse_cdf_draw(mass[None], top)) == 6


def test_unseeded_rows_draw_one_uniform_each_by_inverse_cdf():
    """A row whose randomness is a request's generator takes one float64 uniform from it (rows of
    one generator consecutive draws, in a batch as alone) and draws by inverse CDF, beside seeded
    rows that race with their position's noise (unchanged by the batch) and greedy point masses."""
    from leapfrog.sampling.sampler import PositionKey, seed_key
    p = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(1)), -1)
    p[4] = 0.0
    p[4, 17] = 1.0                                      # a point mass (a greedy row)
    g = torch.Generator().manual_seed(3)
    keys = [PositionKey(seed_key(5), n) for n in range(2)]
    got = sampler.sample(p, [g, keys[0], g, keys[1], None])
    w = torch.rand(2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert got[[0, 2]].tolist() == sampler.inverse_cdf_draw(p[[0, 2]], w).tolist()
    assert got[[1, 3]].tolist() == sampler.sample(p[[1, 3]], keys).tolist()
    assert int(got[4]) == 17
    assert torch.equal(g.get_state(), _after(3, 2))     # one uniform per row, nothing more
    alone = sampler.sample(p[:1], [torch.Generator().manual_seed(3)])
    assert int(alone[0]) == int(got[0])


def _after(seed: int, n: int) -> torch.Tensor:
    """A CPU generator's state after ``n`` float64 uniforms from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    torch.rand(n, generator=g, dtype=torch.float64)
    return g.get_state()


def test_seeded_sample_is_a_pure_function_of_key_and_position():
    from leapfrog.sampling.sampler import PositionKey, seed_key
    p = torch.softmax(torch.randn(4, 300), -1)
    a = sampler.sample(p, [PositionKey(seed_key(5), n) for n in range(4)])
    b = sampler.sample(p, [PositionKey(seed_key(5), n) for n in range(4)])
    c = sampler.sample(p, [PositionKey(seed_key(6), n) for n in range(4)])
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert len({seed_key(s) for s in (0, -1, 1, 2**63, 2**64, -(2**64), 2**64 + 1, 10**40)}) == 8


def test_race_top_starts_with_the_sampled_token_and_skips_impossible_ones():
    """A seeded draft tree's children are the race's first finishers: the first must be the very
    token ``sample`` draws with the same noise (else a one-child tree would couple worse than a
    plain draw), the rest distinct, ordered, and never a token with q = 0."""
    from leapfrog.sampling.sampler import PositionKey, seed_key
    q = torch.softmax(torch.randn(6, 40), -1)
    q[:, 30:] = 0.0
    q[5, 3:] = 0.0                                    # only 3 possible tokens
    q = q / q.sum(-1, keepdim=True)
    rngs = [PositionKey(seed_key(9), n) for n in range(6)]
    race = sampler.race_top(q, rngs, 4)
    top = race.indices
    assert race.values[5, 3] == 0 and bool((race.values[:, :-1] >= race.values[:, 1:]).all())
    assert top[:, 0].tolist() == sampler.sample(q, rngs).tolist()
    assert top[5, 3] == -1 and sorted(top[5, :3].tolist()) == [0, 1, 2]
    for row, ids in zip(q, top[:5].tolist()):
        assert len(set(ids)) == 4 and all(0 <= i < 30 and row[i] > 0 for i in ids)
    # the first finishers: each beats the next under the same noise (p / E decreasing)
    e = -torch.log(sampler.noise(rngs, 40))
    r = q.double() / e
    for i, ids in enumerate(top[:5].tolist()):
        assert all(r[i, a] > r[i, b] for a, b in zip(ids, ids[1:]))


def test_temperature_probs_equal_probs_for_temperature_only_rows():
    """The engine's shortcut for batches of temperature-only and raw-greedy rows gives exactly
    ``probs`` (bitwise), and refuses non-finite rows as ``probs`` does."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3)) * 4
    temps = [0.7, None, 1.3, None, 0.05]
    specs = [RowSpec(SamplingParams(temperature=0.0 if t is None else t), [1, 2], [3]) for t in temps]
    want = sampler.probs(logits, sampler.build_rows(specs, 50))
    assert torch.equal(sampler.temperature_probs(logits, temps), want)
    bad = logits.clone()
    bad[2, 7] = float("nan")
    with pytest.raises(FloatingPointError, match="rows \\[2\\]"):
        sampler.temperature_probs(bad, temps)


def test_noise_draws_each_stream_in_order_whatever_the_runs():
    """Consecutive rows of one generator are drawn in one call: the rows equal drawing them one by
    one from the same stream (greedy rows and seeded positions between them, a position's noise
    shared by its rows), and the streams advance by the rows they gave."""
    V = 50

    def gen(seed):
        g = torch.Generator()
        g.manual_seed(seed)
        return g

    a, b, pk = gen(1), gen(2), sampler.PositionKey(7, 3)
    got = sampler.noise([a, a, None, a, pk, pk, b, b, a], V)
    ra, rb = gen(1), gen(2)
    row = lambda g: torch.rand(V, generator=g, dtype=torch.float64)   # noqa: E731
    want = torch.stack([row(ra), row(ra), torch.full((V,), 0.36787944117144233, dtype=torch.float64), row(ra),
                        sampler.position_noise([sampler.row_key(pk)], V, False)[0],
                        sampler.position_noise([sampler.row_key(pk)], V, False)[0],
                        row(rb), row(rb), row(ra)]).clamp(min=torch.finfo(torch.float64).tiny)
    assert torch.equal(got, want)
    assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=ra))


def test_kept_position_noise_is_the_drawn_noise_drawn_once():
    """A seeded request's positions (NoiseRows) are drawn once and then given back as drawn; the
    positions before its output are forgotten, and at most ``budget`` bytes are kept (the most
    recently used)."""
    from leapfrog.sampling.sampler import NoiseRows, PositionKey, seed_key
    V, key, rows, calls = 40, seed_key(3), NoiseRows(budget=16 * 40 * 3), []
    real = sampler.position_noise

    def counted(keys, vocab_size, exponential):
        calls.extend(keys)
        return real(keys, vocab_size, exponential)
    fresh = sampler.noise([PositionKey(key, n) for n in range(5)], V)
    with patch.object(sampler, "position_noise", counted):
        first = sampler.noise([PositionKey(key, n, rows) for n in range(3)], V)
        again = sampler.noise([PositionKey(key, n, rows) for n in (2, 1, 0, 0)], V)
        calls[:] = [[sampler.row_key(PositionKey(key, n)) for n in range(8)].index(c) for c in calls]
        assert calls == [0, 1, 2] and len(rows) == 3
        assert torch.equal(first, fresh[:3]) and torch.equal(again, fresh[[2, 1, 0, 0]])
        sampler.noise([PositionKey(key, 3, rows), PositionKey(key, 4, rows)], V)   # over budget: 1 and 2 go
        assert len(rows) == 3 and rows.get(0, V) is not None and rows.get(1, V) is None
        rows.drop_below(4)
        assert len(rows) == 1 and rows.get(4, V) is not None
        calls.clear()
        out = sampler.noise([PositionKey(key, n, rows) for n in (3, 4)], V)
        calls[:] = [[sampler.row_key(PositionKey(key, n)) for n in range(8)].index(c) for c in calls]
        assert calls == [3] and torch.equal(out, fresh[3:5])


def test_stream_rows_take_each_generators_next_uniforms():
    """The unseeded rows' uniforms that graphs take: row i the next counts[i] float64 draws of its
    generator (consecutive, nothing more drawn), zeros after them and for rows without one."""
    g, h = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
    w = sampler.stream_rows([g, None, h], [2, 5, 4], 4)
    assert w.shape == (3, 4) and w.dtype == torch.float64
    assert w[0, :2].tolist() == torch.rand(2, generator=torch.Generator().manual_seed(3), dtype=torch.float64).tolist()
    assert w[0, 2:].tolist() == [0.0, 0.0] and w[1].tolist() == [0.0] * 4
    assert w[2].tolist() == torch.rand(4, generator=torch.Generator().manual_seed(4), dtype=torch.float64).tolist()
    assert torch.equal(g.get_state(), _after(3, 2)) and torch.equal(h.get_state(), _after(4, 4))
