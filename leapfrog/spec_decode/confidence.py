"""How many drafted tokens verifying a drafter's best n candidates gets accepted: the auto tree
size's model (spec_decode/adaptive.py, "Tree size").

The drafter ranks its candidates by path confidence c (the product of its probabilities along
the path from the root, ``DraftBatch.candidate_scores``, best first). ``curve`` is C(n), the
mean over recent proposals of c_1 + ... + c_n, and m_i = C(i) - C(i - 1) the mean confidence of
the i-th best candidate. Verifying the best n candidates accepts about

    a * C_gamma(n),    C_gamma(n) = m_1 ** gamma + ... + m_n ** gamma

tokens, where gamma and a calibrate the drafter's confidence against the target. A path's
confidence multiplies one probability per level, so a drafter that is under-confident per level
is under-confident the more, the deeper the candidate. Measured on the built-in pair (chains of
7 at T = 0, 287 steps), accepted / confidence per depth 1..7: 1.05, 1.13, 1.23, 1.27, 1.37, 1.44,
1.56. One linear factor (gamma = 1), fitted on a mix of sizes, overrated short chains against
long ones, and "auto" verified chains of 2-3 for stretches of text where the chain of 5 was
faster. The acceptance per depth is about m ** 0.65 at every depth (0.68 / 0.65 / 0.65 / 0.62
fit depths 1 / 3 / 5 / 7 exactly).

The power applies to the best ``depth`` candidates (``num_speculative_tokens``): it is measured
along the chain, one candidate per depth. Past them (a tree's siblings, of small confidence) the
confidences count as they are: with the power on them too (m ** 0.5 makes a sibling of 0.03 worth
0.17), "auto" verified trees of 21 nodes at batch 1, where they cost twice a chain's step.

So each gamma of a small grid (``GAMMAS``) keeps three calibrations (accepted over predicted
tokens, TokenRate): over all verified candidates (a, the one in use), and over the shallow and the
deep half of the chains verified (proposals of at most ``depth`` candidates, where candidate i sits
at depth i and is accepted when the chain accepts at least i tokens). The model in use is the
gamma under which both halves are calibrated alike (their ratio nearest 1; ties and nothing
measured: the linear model, gamma = 1), and a is its overall calibration. A drafter off by one
factor at every depth keeps gamma = 1 with that factor as a. (A first version picked the gamma
whose overall a was nearest 1: it fitted such a drafter with a wrong power, and a 32-prompt run
chose shorter chains than before.) (The powers apply to the mean confidence per position rather
than per candidate: one curve, a few powers a step, where a curve per gamma cost 55 us a step.)

C(n) is a moving average per position: position n moves only with the proposals that grew at
least n candidates (a small tree says nothing about a larger one's n-th candidate: padding its
sum flat made larger trees look worthless, and the tree never grew back), and positions past
every proposal's candidates keep their increments, moved with the last grown position (kept as
they were, a drop in a chain's confidence on a harder stretch of text left C(depth + 1) far above
C(depth), and a tree of one node more looked worth more than a token; scaled rather than moved, a
tail of small siblings grew with one confident chain). A chain shorter than the depth comes here
extended to the depth (spec_decode/adaptive.py ``_observe_tree``: the levels it did not draft at
its last confidence times a child's ratio), so the chain range's positions move every step; only
the positions past the depth (trees' siblings) wait for proposals that grow them.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Any

from leapfrog.spec_decode.native_confidence import native_curves
from leapfrog.spec_decode.rate import TokenRate, update_rates

#: exponents of the confidence model (module docstring)
GAMMAS = (0.5, 0.625, 0.75, 0.875, 1.0, 1.25, 1.5)
_LINEAR = GAMMAS.index(1.0)
_FROM_LINEAR = [abs(math.log(g)) for g in GAMMAS]   # (how far each gamma is from the linear model)
_EMA = 0.2
_KEEP = 1 - _EMA
_SHAPE_WINDOW = 512   # predicted tokens: the shape fit's memory (TokenRate)
_SHAPE_STEPS = 128    # ... and steps, at most


class ConfidenceCurves:
    """C(n), n = 1..K, and the calibration a of each gamma of GAMMAS; ``gamma`` and
    ``calibration`` are the model in use (``model_curve``: its C_gamma). The reference model:
    spec_decode/native_confidence.py's C++ ``Curves`` computes the same floats (``confidence_curves``
    picks)."""

    def __init__(self, K: int, depth: int | None = None) -> None:
        self.K = K
        #: the power applies to the best ``depth`` candidates (default: all), past them confidences
        #: count as they are (module docstring)
        self.depth = K if depth is None else depth
        self.curve: list[float] | None = None
        self.rates = [TokenRate(prior=1.0) for _ in GAMMAS]   # a per gamma: accepted / predicted
        #: per gamma, the calibrations of the chains' shallow and deep halves (the shape fit; a head's
        #: miscalibration by depth changes slowly: a longer memory than a's)
        self.shallow = [TokenRate(prior=1.0, window=_SHAPE_WINDOW, steps=_SHAPE_STEPS) for _ in GAMMAS]
        self.deep = [TokenRate(prior=1.0, window=_SHAPE_WINDOW, steps=_SHAPE_STEPS) for _ in GAMMAS]
        self._index = _LINEAR
        self._model: list[float] = []   # C_gamma(n) of the model in use, n = 1..len (cache)

    @property
    def index(self) -> int:
        """The model in use: its gamma's place in GAMMAS (set: that gamma until the next calibration)."""
        return self._index

    @index.setter
    def index(self, i: int) -> None:
        if not 0 <= i < len(GAMMAS):
            raise IndexError("gamma index out of range")
        self._index, self._model = i, []

    @property
    def gamma(self) -> float:
        return GAMMAS[self._index]

    @property
    def calibration(self) -> float:
        return self.rates[self._index].value

    def calibration_at(self, gamma: float) -> float:
        return self.rates[GAMMAS.index(gamma)].value

    def model_curve(self, n: int, gamma: float | None = None) -> list[float]:
        """C_gamma(1..n) (default: the model in use's gamma)."""
        if self.curve is None:
            return []
        g = self.gamma if gamma is None else gamma
        if g == 1.0:
            return self.curve[:n]
        if gamma is None and len(self._model) >= n:
            return self._model[:n]
        out = list(itertools.accumulate(self._powered(n, g)))
        if gamma is None:
            self._model = out
        return out

    def _powered(self, n: int, g: float) -> list[float]:
        """m_i ** g for the best ``depth`` of candidates 1..n, m_i past them."""
        return self._power(self._increments(n), g)

    def _increments(self, n: int) -> list[float]:
        """m_1..m_n, the mean confidences of candidates 1..n."""
        curve = self.curve[:n]
        return [max(c - p, 0.0) for c, p in zip(curve, [0.0] + curve[:-1])]

    def _power(self, m: list[float], g: float) -> list[float]:
        """m_i ** g for the best ``depth`` of the increments m, m_i past them."""
        return ([x ** g for x in m[:self.depth]] if g != 1.0 else m[:self.depth]) + m[self.depth:]

    def observe(self, scores: list[list[float]], verified: list[int],
                accepted: list[int] | None = None) -> list[float] | None:
        """Move the curve by one step's proposals: each one's candidate scores (best first), how
        many of its best candidates were verified and (``accepted``) how many tokens it accepted
        (the shape fit: ``_fit_shape``). -> the tokens each gamma predicts for them ([G]: sum over
        the proposals of C_gamma(verified)), or None when nothing was. (Every step of "auto" runs
        this: plain loops, one proposal's apart; at batch 1 it cost 60 us a step in the engine,
        2 % of the built-in pair's step: the controller takes the C++ model, native_confidence.py,
        where it builds.)"""
        K = self.K
        if len(scores) == 1:   # (batch 1: its sums are the means)
            means = list(itertools.accumulate(scores[0][:K]))
            L = len(means)
        else:
            L = max((min(len(sc), K) for sc in scores), default=0)   # positions < L were grown
            sums: list[list[float]] = [[] for _ in range(L)]   # per position: C(n) of each proposal that grew n
            for sc in scores:
                for i, c in enumerate(itertools.accumulate(sc[:K])):
                    sums[i].append(c)
            means = [sum(col) / len(col) for col in sums]
        if L == 0:
            return None
        old = self.curve
        head = means if old is None else [_KEEP * o + _EMA * m for o, m in zip(old, means)]
        head = list(itertools.accumulate(head, max))   # C is a cumulative sum: never decreasing in n
        last = head[-1]
        if old is None:   # first proposals: positions they did not reach hold their total
            self.curve = head + [last] * (K - L)
        else:   # past every proposal's candidates: their increments kept, moved with position L
            at = old[L - 1]
            self.curve = head + [o + last - at for o in old[L:]]
        self._model = []
        n = [min(v, len(sc), K) for v, sc in zip(verified, scores)]
        top = max(n, default=0)
        if not top:
            return None
        # C_gamma(0..top) per gamma, and how many proposals verified each size
        m = self._increments(top)
        prefix = [[0.0, *itertools.accumulate(self._power(m, g))] for g in GAMMAS]   # [G][top + 1]
        if accepted is not None:
            self._fit_shape(prefix, n, accepted)
        if len(n) == 1:   # (one proposal: its own prediction)
            return [pre[top] for pre in prefix]
        sizes = Counter(v for v in n if v)
        return [sum(c * pre[v] for v, c in sizes.items()) for pre in prefix]

    def _fit_shape(self, prefix: list[list[float]], verified: list[int], accepted: list[int]) -> None:
        """Each gamma's calibration on the shallow and on the deep half of the chains verified
        (proposals of at most ``depth`` candidates: a chain, candidate i at depth i, accepted when
        the chain accepted at least i); ``prefix``: C_gamma(0..) per gamma."""
        h = max(1, self.depth // 2)
        chains = [(v, min(k, v)) for v, k in zip(verified, accepted) if 0 < v <= self.depth]
        if not chains:
            return
        shallow_acc = sum(min(k, h) for _, k in chains)
        deep_acc = sum(max(0, k - h) for _, k in chains)
        if len(chains) == 1:   # (one chain: its own sizes)
            v = chains[0][0]
            half = min(h, v)
            shallow_pred = [pre[half] for pre in prefix]
            update_rates(self.shallow, shallow_acc, shallow_pred)
            update_rates(self.deep, deep_acc, [pre[v] - s for pre, s in zip(prefix, shallow_pred)])
            return
        sizes = [(v, min(h, v), c) for v, c in Counter(v for v, _ in chains).items()]
        shallow_preds, deep_preds = [], []
        for pre in prefix:
            shallow_pred = whole = 0
            for v, half, c in sizes:   # (plain loops: generator sums per gamma cost ~10 us a step)
                shallow_pred += c * pre[half]
                whole += c * pre[v]
            shallow_preds.append(shallow_pred)
            deep_preds.append(whole - shallow_pred)
        update_rates(self.shallow, shallow_acc, shallow_preds)
        update_rates(self.deep, deep_acc, deep_preds)

    def chain_prediction(self, k: int, chains: float) -> list[float] | None:
        """What each gamma predicts for ``chains`` proposals verifying their best ``k`` candidates."""
        return None if self.curve is None else [sum(self._powered(k, g)) * chains for g in GAMMAS]

    def calibrate(self, accepted: float, predicted: list[float]) -> None:
        """One step's accepted tokens against each gamma's prediction ([G])."""
        update_rates(self.rates, accepted, predicted)
        self._pick()

    def replace_calibration(self, accepted: float, predicted: list[float]) -> None:
        """The calibrations from these sums alone (a probe's)."""
        self.rates = [TokenRate(accepted, p, 1.0) for p in predicted]
        self._pick()

    def _pick(self) -> None:
        """The model in use: the gamma under which the chains' deep half is calibrated like their
        shallow half (the ratio of the two calibrations nearest 1; ties: the gamma nearest 1); the
        linear model until both halves are measured. (The gamma whose overall calibration was
        nearest 1 fitted a drafter that is off by one factor at every depth with a wrong power.)"""
        index, off = _LINEAR, math.inf
        for g, (shallow, deep) in enumerate(zip(self.shallow, self.deep)):
            sa, sp, da, dp = shallow.accepted, shallow.per, deep.accepted, deep.per   # (read once: every step)
            if sp > 0 and dp > 0 and sa > 0 and da > 0:
                d = abs(math.log((da / dp) / (sa / sp)))
                if d < off - 1e-12 or (d <= off + 1e-12 and _FROM_LINEAR[g] < _FROM_LINEAR[index]):
                    index, off = g, d
        if index != self._index:
            self._index, self._model = index, []


def confidence_curves(K: int, depth: int | None = None, native: bool = True) -> Any:
    """The confidence model of an auto tree size's controller: the C++ one
    (spec_decode/native_confidence.py: the same floats, one call a step) where it builds and
    ``native`` (a controller that never observes a tree asks for none: no build), else
    ConfidenceCurves."""
    curves = native_curves(K, depth) if native else None
    return curves if curves is not None else ConfidenceCurves(K, depth)
