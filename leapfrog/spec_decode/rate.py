"""Accepted tokens per tried (or predicted) token over a window of recent tokens: the acceptance
rate and calibrations of the adaptive controllers (spec_decode/adaptive.py, confidence.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_RATE_WINDOW = 64   # tried (predicted) draft tokens: the acceptance rate's and calibration's memory (TokenRate)
_RATE_STEPS = 16    # ... and steps, at most
#: ... and steps, at least: at large batches one step brings a window of tokens (a batch of 16
#: verifying chains of 4-7 predicts 60-110 tokens a step), and a memory of one or two steps
#: swung an auto tree's calibration 0.83-1.11 from one weighing to the next at a batch of 16, T
#: = 0 (AMX Xeon): a low one turned speculation off where the chains ran 1.14x none, and while
#: off nothing measured moved it again (stop 97). Four steps of 16 sequences average 64 chains.
_RATE_MIN_STEPS = 4


@dataclass
class TokenRate:
    """Accepted tokens per token of ``per``, over sums that forget at a rate per token of ``per``
    (a window of about ``window`` of them (_RATE_WINDOW), however many steps or sequences brought them), and
    within about ``steps`` steps at most (_RATE_STEPS) (when acceptance collapses, a chain tries one token a
    step: 64 steps of drafting in vain before speculation turned off):

    - alpha, the per-token acceptance rate of chains: accepted / tried. A draft token is tried
      when every one before it in its chain was accepted, so a chain tries its accepted tokens
      plus the rejected one, if any (the geometric model's maximum-likelihood estimate);
    - an auto tree's calibrations: accepted / predicted (confidence.py: each confidence model's
      C_gamma of the verified candidates).

    Moving averages per step swung with single steps (at T = 0.7, batch 1: a few unlucky steps
    turned speculation off for 128 tokens; at T = 0 a tree's calibration for 24 steps). Where a
    step brings more than a window of tokens (large batches) the memory is still about
    ``min_steps`` steps (_RATE_MIN_STEPS). ``prior`` until something is measured."""
    accepted: float = 0.0
    per: float = 0.0
    prior: float = 0.7
    window: float = _RATE_WINDOW   # tokens of ``per`` remembered
    steps: int = _RATE_STEPS       # steps remembered, at most
    min_steps: int = _RATE_MIN_STEPS   # ... and at least

    @property
    def value(self) -> float:
        return self.accepted / self.per if self.per > 0 else self.prior

    def update(self, accepted: float, per: float) -> None:
        """One step's accepted tokens, and tried (predicted) ones."""
        update_rates((self,), accepted, (per,))


def update_rates(rates: Sequence[TokenRate], accepted: float, per: Sequence[float]) -> None:
    """``TokenRate.update`` of each of ``rates`` (one memory: the first's window and steps) with
    the same accepted tokens and its own ``per``: a confidence model's calibrations, one per gamma
    (confidence.py), in one loop (a call each was a third of their 20 us a step)."""
    first = rates[0]
    base, least, most = 1 - 1 / first.window, 1 - 1 / first.min_steps, 1 - 1 / first.steps
    for rate, p in zip(rates, per):
        if p > 0:
            keep = base ** p   # (within least..most: min and max calls cost more than the rest)
            if keep < least:
                keep = least
            if keep > most:
                keep = most
            rate.accepted, rate.per = keep * rate.accepted + accepted, keep * rate.per + p


#: DepthShape's prior: tokens of the pooled rate each position's own rate is shrunk toward
_DEPTH_PRIOR = 8.0
#: DepthShape's memory: tried tokens (all positions together), and steps at most
_DEPTH_WINDOW = 4 * _RATE_WINDOW
_DEPTH_STEPS = 4 * _RATE_STEPS


@dataclass
class DepthShape:
    """How chains' acceptance changes with the draft position: per position i (1-based), accepted
    and tried tokens there (a position is tried when every one before it was accepted), over sums
    that forget alike at every position (by the tokens tried at all of them: a window of
    _DEPTH_WINDOW, within _DEPTH_STEPS steps), kept as a shape around their pooled rate d. The
    expected tokens of a chain of L then take the level from alpha (the controller's pooled rate,
    which probes may replace) and the shape from here:
    E[tokens](L) = 1 + sum_{i <= L} prod_{j <= i} min(1, alpha f_j), f_j = d_j / d, d_j shrunk
    toward d by _DEPTH_PRIOR tokens (so a position tried little, or long ago, counts near d: the
    geometric model's), and positions never tried take the deepest tried one's f. Chains only:
    rounds (``observe_rounds``) move alpha, not the shape.
    The product of per-position rates pooled over a batch's requests is the batch's mean chance of
    accepting through position i, where the geometric model with one pooled alpha is not: its rate
    is weighted toward the requests that accept most (they try more positions: two requests at
    0.95 and 0.4 a position, chains of 7, 4.58 tokens expected for 4.20 made), and it takes every
    position alike (acceptance falling from 0.95 to 0.65 over 7 positions: 4.63 expected for 5.05
    made), so chains of different lengths were weighed with errors of their own."""
    accepted: list[float]
    tried: list[float]
    _factors: list[float] | None = None   # (factors(), until the next update)

    @classmethod
    def new(cls, depth: int) -> "DepthShape":
        return cls([0.0] * depth, [0.0] * depth)

    def update(self, chains: list[tuple[int, int]]) -> None:
        """One step's chains, each as (accepted, tried) draft tokens: positions 1..tried were
        tried, 1..accepted accepted (positions past the shape's depth are not kept)."""
        accepted, tried = [0] * len(self.tried), [0] * len(self.tried)
        for m, t in chains:
            for i in range(min(t, len(tried))):
                tried[i] += 1
                accepted[i] += i < m
        if (n := sum(tried)) <= 0:
            return
        keep = min((1 - 1 / _DEPTH_WINDOW) ** n, 1 - 1 / _DEPTH_STEPS)
        self.accepted = [keep * x + a for x, a in zip(self.accepted, accepted)]
        self.tried = [keep * x + t for x, t in zip(self.tried, tried)]
        self._factors = None

    def factors(self) -> list[float] | None:
        """f_j per position (None until something is accepted)."""
        if self._factors is not None:
            return self._factors
        acc, per = sum(self.accepted), sum(self.tried)
        if per <= 0 or acc <= 0:
            return None
        d = acc / per
        out, last = [], 1.0
        for a, t in zip(self.accepted, self.tried):
            if t > 0:
                last = (a + _DEPTH_PRIOR * d) / (t + _DEPTH_PRIOR) / d
            out.append(last)
        self._factors = out
        return out

    def expected_tokens(self, alpha: float, k: int) -> float:
        """E[tokens] of a chain of k drafts (docstring); the geometric model's until measured."""
        f = self.factors()
        if f is None:
            return geometric_tokens(alpha, k)
        total, through = 1.0, 1.0
        for i in range(k):
            through *= min(1.0, alpha * f[min(i, len(f) - 1)])
            total += through
        return total


def geometric_tokens(alpha: float, k: int) -> float:
    """E[tokens] of a chain of k drafts, every position accepted at rate alpha: 1 + alpha + ... +
    alpha^k (the verified step's own token counted)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)
