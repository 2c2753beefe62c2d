"""The auto tree size's confidence model (spec_decode/confidence.py): C(n) per position, the
power gamma fitted by calibration, the tail past the grown candidates; each test on the Python
model and on the C++ one (spec_decode/native_confidence.py)."""

from __future__ import annotations

import pytest

from leapfrog.spec_decode.confidence import GAMMAS, ConfidenceCurves
from leapfrog.spec_decode.native_confidence import native_curves

CHAIN = [0.8, 0.6, 0.45, 0.34]   # a chain's path confidences, depth 1..4


def accepted_counts(p: list[float], n: int = 1000) -> list[int]:
    """Accepted tokens of n chains whose candidate i is accepted (with all before it) with
    probability p[i] (non-increasing): the exact frequencies, up to 1/n."""
    return [sum(j < n * q for q in p) for j in range(n)]


def _native(K: int, depth: int | None = None):
    cc = native_curves(K, depth)
    if cc is None:
        pytest.skip("the C++ confidence model did not build here (no compiler?)")
    return cc


@pytest.fixture(params=["python", "native"])
def make(request):
    """A ConfidenceCurves constructor: the Python model, or the C++ one."""
    return ConfidenceCurves if request.param == "python" else _native


def _feed(cc: ConfidenceCurves, p: list[float], steps: int = 40, n: int = 1000) -> None:
    ks = accepted_counts(p, n)
    for _ in range(steps):
        cc.calibrate(sum(ks), cc.observe([CHAIN] * n, [4] * n, ks))


@pytest.mark.parametrize("gamma", [0.5, 0.75, 1.0, 1.25])
def test_the_power_that_explains_the_acceptance_by_depth_is_picked(gamma, make):
    """A drafter whose candidate of confidence m is accepted with probability m ** gamma: the
    model in use becomes that gamma, calibrated at 1, and predicts each chain length's tokens."""
    cc = make(8, depth=4)
    _feed(cc, [m ** gamma for m in CHAIN])
    assert cc.gamma == gamma
    assert cc.calibration == pytest.approx(1.0, abs=0.01)
    expected = [sum(m ** gamma for m in CHAIN[:n]) for n in range(1, 5)]
    assert cc.model_curve(4) == pytest.approx(expected)


@pytest.mark.parametrize("factor", [0.7, 1.2])
def test_a_drafter_off_by_one_factor_keeps_the_linear_model(factor, make):
    """Acceptance factor x m at every depth: the depth shape is linear, the factor is the
    calibration (picking the gamma whose calibration is nearest 1 fitted it with a wrong power)."""
    cc = make(8, depth=4)
    _feed(cc, [min(1.0, factor * m) for m in CHAIN])
    assert cc.gamma == 1.0
    assert cc.calibration == pytest.approx(factor, rel=0.01)


def test_ties_go_to_the_linear_model_and_nothing_measured_keeps_it(make):
    cc = make(8)
    assert cc.gamma == 1.0 and cc.calibration == 1.0 and cc.curve is None and cc.model_curve(4) == []
    for _ in range(10):   # confidences of 1: every gamma predicts the same
        cc.calibrate(2.0, cc.observe([[1.0] * 4], [4], [2]))
    assert cc.gamma == 1.0 and cc.calibration == pytest.approx(0.5)


def test_the_power_stops_at_the_depth(make):
    """Candidates past the depth (a tree's siblings) count their confidence as it is."""
    cc = make(8, depth=2)
    cc.observe([[0.81, 0.64, 0.04, 0.01]], [4])
    assert cc.model_curve(4, gamma=0.5) == pytest.approx([0.9, 1.7, 1.74, 1.75])


def test_positions_past_the_grown_candidates_keep_their_increments(make):
    """A 16-candidate tree measured the tail; later chains of 2, less confident, move it by as
    much as C(2) moved (kept as it was, C(3) stood far above C(2) and a tree of 3 nodes looked
    worth more than a token; scaled, a tail of small siblings grew with a confident chain)."""
    cc = make(16)
    tree = [0.9, 0.8, 0.3, 0.2] + [0.05] * 12
    cc.observe([tree], [16])
    before = list(cc.curve)
    for _ in range(40):
        cc.observe([[0.45, 0.4]], [2])
    assert cc.curve[1] == pytest.approx(0.85, rel=1e-3)   # (the moving average, 40 steps on)
    assert [c - cc.curve[1] for c in cc.curve[2:]] == pytest.approx([c - before[1] for c in before[2:]])
    small = make(16)
    small.observe([[0.02] * 16], [16])
    for _ in range(40):
        small.observe([[0.9]], [1])
    assert small.curve[-1] - small.curve[0] == pytest.approx(15 * 0.02)


def test_a_grown_part_that_falls_is_raised(make):
    """Position 2's mean over the proposals that grew it can fall below position 1's over all of
    them: C never decreases."""
    cc = make(4)
    cc.observe([[0.1, 0.05], [0.9]], [2, 1])    # C(1) = 0.5, C(2) over the first alone = 0.15
    assert cc.curve == pytest.approx([0.5, 0.5, 0.5, 0.5])


def test_chain_prediction_and_nothing_verified(make):
    cc = make(8, depth=4)
    assert cc.chain_prediction(4, 2.0) is None
    assert cc.observe([CHAIN], [0]) is None      # grown, none verified
    pred = cc.chain_prediction(2, 3.0)
    assert len(pred) == len(GAMMAS)
    assert pred[GAMMAS.index(1.0)] == pytest.approx(3 * (0.8 + 0.6))
    assert pred[GAMMAS.index(0.5)] == pytest.approx(3 * (0.8 ** 0.5 + 0.6 ** 0.5))
