"""The auto tree size's confidence model (spec_decode/confidence.py): C(n) per position, the
power gamma fitted by calibration, the tail past the grown candidates."""

from __future__ import annotations

import pytest

from leapfrog.spec_decode.confidence import GAMMAS, ConfidenceCurves

CHAIN = [0.8, 0.6, 0.45, 0.34]   # a chain's path confidences, depth 1..4


def _feed(cc: ConfidenceCurves, accepted_of, steps: int = 60) -> None:
    for _ in range(steps):
        predicted = cc.observe([CHAIN], [4])
        cc.calibrate(accepted_of(), predicted)


@pytest.mark.parametrize("gamma", [0.5, 0.75, 1.0, 1.25])
def test_the_power_that_explains_the_acceptance_is_picked(gamma):
    """A drafter whose candidate of confidence m is accepted with probability m ** gamma: the
    model in use becomes that gamma, calibrated at 1, and predicts each chain length's tokens."""
    cc = ConfidenceCurves(8, depth=4)
    _feed(cc, lambda: sum(m ** gamma for m in CHAIN))
    assert cc.gamma == gamma
    assert cc.calibration == pytest.approx(1.0, abs=1e-9)
    expected = [sum(m ** gamma for m in CHAIN[:n]) for n in range(1, 5)]
    assert cc.model_curve(4) == pytest.approx(expected)
    assert cc.calibration_at(1.0) == pytest.approx(expected[-1] / sum(CHAIN), rel=1e-9)


def test_ties_go_to_the_linear_model_and_nothing_measured_keeps_it():
    cc = ConfidenceCurves(8)
    assert cc.gamma == 1.0 and cc.calibration == 1.0 and cc.curve is None and cc.model_curve(4) == []
    for _ in range(10):   # confidences of 1: every gamma predicts the same
        cc.calibrate(2.0, cc.observe([[1.0] * 4], [4]))
    assert cc.gamma == 1.0 and cc.calibration == pytest.approx(0.5)


def test_the_power_stops_at_the_depth():
    """Candidates past the depth (a tree's siblings) count their confidence as it is."""
    cc = ConfidenceCurves(8, depth=2)
    cc.observe([[0.81, 0.64, 0.04, 0.01]], [4])
    assert cc.model_curve(4, gamma=0.5) == pytest.approx([0.9, 1.7, 1.74, 1.75])


def test_positions_past_the_grown_candidates_keep_their_shape():
    """A 16-candidate tree measured the tail; later chains of 2 less confident by half move it by
    the same factor (kept as it was, C(3) stood far above C(2) and a tree of 3 nodes looked worth
    more than a token)."""
    cc = ConfidenceCurves(16)
    tree = [0.9, 0.8, 0.3, 0.2] + [0.05] * 12
    cc.observe([tree], [16])
    before = list(cc.curve)
    for _ in range(40):
        cc.observe([[0.45, 0.4]], [2])
    assert cc.curve[1] == pytest.approx(0.85, rel=1e-3)   # (the moving average, 40 steps on)
    ratio = cc.curve[1] / before[1]
    assert cc.curve[2:] == pytest.approx([c * ratio for c in before[2:]], rel=1e-9)
    assert all(b >= a for a, b in zip(cc.curve, cc.curve[1:]))


def test_a_tail_scaled_below_the_grown_part_is_raised_to_it():
    cc = ConfidenceCurves(6)
    cc.observe([[0.5, 0.1, 0.1, 0.1]], [4])     # C = 0.5, 0.6, 0.7, 0.8, 0.8, 0.8
    for _ in range(30):
        cc.observe([[0.9, 0.9]], [2])           # C(2) -> 1.8: the tail scales by 3, past the head
    assert cc.curve[2] >= cc.curve[1] and cc.curve == sorted(cc.curve)
    cc2 = ConfidenceCurves(6)
    cc2.observe([[0.5, 0.4, 0.01]], [3])
    cc2.observe([[0.5, 0.4, 0.01]], [3])
    cc2.observe([[0.1]], [1])                   # C(1) falls: the tail falls with it, never below C(1)
    assert cc2.curve == sorted(cc2.curve)


def test_chain_prediction_and_nothing_verified():
    cc = ConfidenceCurves(8, depth=4)
    assert cc.chain_prediction(4, 2.0) is None
    assert cc.observe([CHAIN], [0]) is None      # grown, none verified
    pred = cc.chain_prediction(2, 3.0)
    assert len(pred) == len(GAMMAS)
    assert pred[GAMMAS.index(1.0)] == pytest.approx(3 * (0.8 + 0.6))
    assert pred[GAMMAS.index(0.5)] == pytest.approx(3 * (0.8 ** 0.5 + 0.6 ** 0.5))
