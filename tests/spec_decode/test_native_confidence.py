"""The C++ confidence model (spec_decode/native_confidence.py) against the Python one
(spec_decode/confidence.py ConfidenceCurves): random steps through both give the same floats, so
"auto" tree sizes choose alike with either; the controller takes the C++ one unless turned off."""

from __future__ import annotations

import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfrog.spec_decode.adaptive import SpecController
from leapfrog.spec_decode.config import SpeculativeConfig
from leapfrog.spec_decode.confidence import GAMMAS, ConfidenceCurves, confidence_curves
from leapfrog.spec_decode.native_confidence import load_native_confidence, native_curves

pytestmark = pytest.mark.skipif(not load_native_confidence(), reason="the C++ confidence model did not build here")

#: Python's sum() of floats compensates from 3.12 on: the two then agree to rounding, not bit for bit
EXACT = sys.version_info < (3, 12)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b if EXACT else a == pytest.approx(b, rel=1e-12, abs=1e-15)


_prob = st.floats(0.0, 1.0)
_scores = st.lists(_prob, max_size=12).map(lambda xs: sorted(xs, reverse=True))   # (best first)


@st.composite
def _observe(draw):
    scores = draw(st.lists(_scores, min_size=1, max_size=4))
    verified = [draw(st.integers(0, 13)) for _ in scores]
    accepted = draw(st.one_of(st.none(), st.just([draw(st.integers(0, v)) for v in verified])))
    return ("observe", scores, verified, accepted)


_step = st.one_of(
    _observe(), _observe(), _observe(),
    st.tuples(st.just("calibrate"), st.floats(0, 40), st.lists(st.floats(0, 40), min_size=7, max_size=7)),
    st.tuples(st.just("replace"), st.floats(0, 40), st.lists(st.floats(0, 40), min_size=7, max_size=7)),
    st.tuples(st.just("model_curve"), st.integers(0, 14), st.sampled_from([None, *GAMMAS])),
    st.tuples(st.just("chain_prediction"), st.integers(0, 14), st.floats(0, 8)),
    st.tuples(st.just("index"), st.integers(0, len(GAMMAS) - 1)),
)


def _apply(cc, step):
    kind, *args = step
    if kind == "observe":
        return cc.observe(*args)
    if kind == "calibrate":
        return cc.calibrate(*args)
    if kind == "replace":
        return cc.replace_calibration(*args)
    if kind == "model_curve":
        return cc.model_curve(*args)
    if kind == "chain_prediction":
        return cc.chain_prediction(*args)
    cc.index = args[0]
    return None


def _state(cc) -> tuple:
    return (cc.curve, cc.index, cc.gamma, cc.calibration, [cc.calibration_at(g) for g in GAMMAS])


@settings(max_examples=150, deadline=None)
@given(K=st.integers(1, 10), depth=st.one_of(st.none(), st.integers(1, 10)), steps=st.lists(_step, max_size=30))
def test_random_steps_give_the_same_floats(K, depth, steps):
    py, cc = ConfidenceCurves(K, depth), native_curves(K, depth)
    assert (cc.K, cc.depth) == (py.K, py.depth)
    for step in steps:
        assert _same(_apply(cc, step), _apply(py, step)), step
        assert _same(_state(cc), _state(py)), step


def test_a_long_run_of_chains_and_trees_stays_equal():
    """Many steps of batch-1 chains and batch-4 trees, calibrated from their own predictions, as
    the controller runs them: the curves, the gamma picked and its calibration agree throughout."""
    rng = random.Random(3)
    py, cc = ConfidenceCurves(40, 7), native_curves(40, 7)
    for step in range(600):
        B = 1 if step % 3 else 4
        scores, verified, accepted = [], [], []
        for _ in range(B):
            n = 7 if B == 1 else rng.choice([7, 16, 39])
            c, sc = 1.0, []
            for _ in range(n):
                c *= rng.uniform(0.4, 1.0)
                sc.append(c)
            scores.append(sorted(sc, reverse=True))
            verified.append(n)
            accepted.append(rng.randint(0, 7))
        got, want = cc.observe(scores, verified, accepted), py.observe(scores, verified, accepted)
        assert _same(got, want)
        cc.calibrate(sum(accepted), got)
        py.calibrate(sum(accepted), want)
        assert _same(_state(cc), _state(py))
        assert _same(cc.model_curve(40), py.model_curve(40))
    assert py.gamma != 1.0 or py.calibration != 1.0   # (something was fitted)


def test_bad_arguments_are_refused_like_the_python_model():
    cc, py = native_curves(8), ConfidenceCurves(8)
    for model in (cc, py):
        with pytest.raises(ValueError):
            model.calibration_at(0.3)
        with pytest.raises(IndexError):
            model.index = len(GAMMAS)


def test_the_controller_takes_the_native_model_unless_turned_off(monkeypatch):
    cfg = SpeculativeConfig.from_dict({"method": "eagle3", "model": "h", "num_speculative_tokens": 4,
                                       "eagle_topk": 2, "num_draft_tokens": "auto"})
    assert not isinstance(SpecController(cfg, 256).confidence, ConfidenceCurves)
    assert not isinstance(confidence_curves(8), ConfidenceCurves)
    # (a controller that never sizes trees asks for no C++ model: nothing to build for it)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=True)
    assert isinstance(SpecController(ngram, 256).confidence, ConfidenceCurves)
    monkeypatch.setenv("LEAPFROG_NATIVE_CONFIDENCE", "0")
    assert isinstance(SpecController(cfg, 256).confidence, ConfidenceCurves)
