"""Property: whatever values a caller passes, SamplingParams either refuses them with a ConfigError
or the one sampler handles them: finite probabilities, and the drawn token has p > 0 (hypothesis)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfrog.errors import ConfigError
from leapfrog.sampling import sampler
from leapfrog.sampling.sampler import PositionKey, RowSpec, seed_key
from leapfrog.sampling_params import SamplingParams, _texts_ok, token_ids_ok

V = 64
WILD = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                 st.sampled_from([0.0, 1e-300, 1e-6, 1e-5, 0.01, 1.0, 100.0, 1e4, 1e300, -1.0]))


def field(lo: float, hi: float):
    """Mostly values inside [lo, hi] (the edges included), sometimes anything at all."""
    return st.one_of(st.floats(lo, hi), st.floats(lo, hi), st.sampled_from([lo, hi]), WILD)


ints = st.one_of(st.integers(-3, 3 * V), st.integers(-(2**80), 2**80))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(temperature=st.one_of(st.just(0.0), field(0.0, 3.0)), top_p=field(0.01, 1.0), min_p=field(0.0, 1.0),
       repetition_penalty=field(0.01, 100.0), presence_penalty=field(-2.0, 2.0),
       frequency_penalty=field(-2.0, 2.0), top_k=ints, seed=st.one_of(st.none(), ints), min_tokens=st.integers(0, 3),
       logit_scale=st.sampled_from([1.0, 30.0, 1e4]))
def test_accepted_params_never_break_the_sampler(temperature, top_p, min_p, repetition_penalty, presence_penalty,
                                                 frequency_penalty, top_k, seed, min_tokens, logit_scale):
    try:
        sp = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty, top_k=top_k, seed=seed, min_tokens=min_tokens,
                            max_tokens=8)
    except ConfigError:
        return
    for v in (sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty):
        assert math.isfinite(v)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g) * logit_scale
    specs = [RowSpec(sp, [1, 2, 3], out, (0,)) for out in ([], [5], [5, 5, 7])]
    rows = sampler.build_rows(specs, V)
    p = sampler.probs(logits, rows)
    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(3), atol=1e-4)
    rng = [PositionKey(seed_key(seed), n) for n in range(3)] if seed is not None else [g] * 3
    tok = sampler.sample(p, [None if sp.greedy else r for r in rng])
    assert (p[torch.arange(3), tok] > 0).all()
    for i, s in enumerate(specs):  # the stop id is suppressed while fewer than min_tokens were generated
        if len(s.output_ids) < min_tokens:
            assert p[i, 0] == 0
    REACHED.append(sp.greedy)


REACHED: list[bool] = []


def test_the_property_reached_the_sampler():
    """Guard against a vacuous property: many examples, greedy and sampled, got past validation."""
    REACHED.clear()
    test_accepted_params_never_break_the_sampler()
    greedy = sum(REACHED)
    assert greedy >= 3 and len(REACHED) - greedy >= 10, (greedy, len(REACHED))


def test_integer_values_of_float_fields_are_stored_as_floats():
    """SamplingParams(temperature=1) keeps 1.0: tensors built from the fields are float ones (an
    int64 temperature tensor matched no compiled graph and failed the request)."""
    sp = SamplingParams(temperature=2, top_p=1, min_p=0, repetition_penalty=1, presence_penalty=-1, frequency_penalty=0)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert type(getattr(sp, name)) is float
    assert torch.tensor([sp.temperature]).dtype == torch.float32


class Tok(int):   # an int subclass (an IntEnum's kind): an id like any int
    pass


class Text(str):   # a str subclass: a string like any
    pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(ints, st.booleans(), st.floats(0, 10), st.integers(0, 9).map(Tok), st.none()), max_size=8),
       st.one_of(st.none(), st.integers(1, 3 * V)))
def test_token_ids_ok_is_the_item_by_item_rule(ids, end):
    """The C-loop check (types as a set, min, max) accepts exactly what the item-by-item rule
    accepts: non-negative ints, no bools, below ``end``."""
    want = all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 and (end is None or t < end) for t in ids)
    assert token_ids_ok(ids, end) is want
    assert token_ids_ok(tuple(ids), end) is want


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=3), st.integers(), st.none(), st.text(max_size=2).map(Text)), max_size=6),
       st.booleans())
def test_texts_ok_is_the_item_by_item_rule(texts, strip):
    """The C-loop check of stop strings and bad words accepts what the item-by-item rule accepts."""
    want = all(isinstance(t, str) and (t.strip() if strip else t) for t in texts)
    assert bool(_texts_ok(texts, strip)) is want
