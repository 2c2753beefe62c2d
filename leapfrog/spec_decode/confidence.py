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

So each gamma of a small grid (``GAMMAS``) has its own calibration a (accepted over predicted
tokens, TokenRate), and the model in use is the gamma whose a is nearest 1: a grows with gamma
(m ** gamma shrinks), so that is where the power alone explains the acceptance, and a stays as
the residual factor. gamma = 1 is the linear model, which ties go to. (Kept per mean position
rather than per candidate: one curve, a few powers a step, where a curve per gamma cost 55 us a
step and its heavy tails made every tree size look worth weighing.)

C(n) is a moving average per position: position n moves only with the proposals that grew at
least n candidates (a small tree says nothing about a larger one's n-th candidate: padding its
sum flat made larger trees look worthless, and the tree never grew back), and positions past
every proposal's candidates keep their shape, scaled by how the last grown position moved (kept
as they were, a drop in a chain's confidence on a harder stretch of text left C(depth + 1) far
above C(depth), and a tree of one node more looked worth more than a token).
"""

from __future__ import annotations

import itertools
import math

from leapfrog.spec_decode.rate import TokenRate

#: exponents of the confidence model (module docstring)
GAMMAS = (0.5, 0.625, 0.75, 0.875, 1.0, 1.25, 1.5)
_LINEAR = GAMMAS.index(1.0)
_EMA = 0.2


class ConfidenceCurves:
    """C(n), n = 1..K, and the calibration a of each gamma of GAMMAS; ``gamma`` and
    ``calibration`` are the model in use, ``expected`` its accepted tokens."""

    def __init__(self, K: int, depth: int | None = None) -> None:
        self.K = K
        #: the power applies to the best ``depth`` candidates (default: all), past them confidences
        #: count as they are (module docstring)
        self.depth = K if depth is None else depth
        self.curve: list[float] | None = None
        self.rates = [TokenRate(prior=1.0) for _ in GAMMAS]
        self.index = _LINEAR
        self._model: list[float] = []   # C_gamma(n) of the model in use, n = 1..len (cache)

    @property
    def gamma(self) -> float:
        return GAMMAS[self.index]

    @property
    def calibration(self) -> float:
        return self.rates[self.index].value

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
        curve = self.curve[:n]
        m = [max(c - p, 0.0) for c, p in zip(curve, [0.0] + curve[:-1])]
        return [x ** g for x in m[:self.depth]] + m[self.depth:]

    def observe(self, scores: list[list[float]], verified: list[int]) -> list[float] | None:
        """Move the curve by one step's proposals: each one's candidate scores (best first) and
        how many of its best candidates were verified. -> the tokens each gamma predicts for them
        ([G]: sum over the proposals of C_gamma(verified)), or None when nothing was."""
        L = max((min(len(sc), self.K) for sc in scores), default=0)   # positions < L were grown
        if L == 0:
            return None
        sums: list[list[float]] = [[] for _ in range(L)]   # per position: C(n) of each proposal that grew n
        for sc in scores:
            for i, c in enumerate(itertools.accumulate(sc[:self.K])):
                sums[i].append(c)
        means = [sum(col) / len(col) for col in sums]
        if self.curve is None:   # first proposals: positions they did not reach hold their total
            self.curve = means + [means[-1]] * (self.K - L)
        else:
            old = self.curve
            # past every proposal's candidates: the shape kept, scaled by how position L moved
            head = [(1 - _EMA) * o + _EMA * m for o, m in zip(old, means)]
            scale = head[-1] / old[L - 1] if old[L - 1] > 0 else 1.0
            self.curve = head + [o * scale for o in old[L:]]
        curve = self.curve
        for i in range(1, self.K):   # C is a cumulative sum: never decreasing in n
            if curve[i] < curve[i - 1]:
                curve[i] = curve[i - 1]
            elif i >= L:
                break   # (the tail: non-decreasing already, scaled, and not below the head's end)
        self._model = []
        n = [min(v, len(sc), self.K) for v, sc in zip(verified, scores)]
        if not any(n):
            return None
        return self._predict(n)

    def chain_prediction(self, k: int, chains: float) -> list[float] | None:
        """What each gamma predicts for ``chains`` proposals verifying their best ``k`` candidates."""
        return None if self.curve is None else [p * chains for p in self._predict([k])]

    def _predict(self, verified: list[int]) -> list[float]:
        """[G]: sum over ``verified`` of C_gamma(n), from the current curve."""
        top = max(verified)
        out = []
        for g in GAMMAS:
            run = list(itertools.accumulate(self._powered(top, g)))
            out.append(sum(run[v - 1] for v in verified if v))
        return out

    def calibrate(self, accepted: float, predicted: list[float]) -> None:
        """One step's accepted tokens against each gamma's prediction ([G])."""
        for rate, p in zip(self.rates, predicted):
            rate.update(accepted, p)
        self._pick()

    def replace_calibration(self, accepted: float, predicted: list[float]) -> None:
        """The calibrations from these sums alone (a probe's)."""
        self.rates = [TokenRate(accepted, p, 1.0) for p in predicted]
        self._pick()

    def _pick(self) -> None:
        """The model in use: the gamma whose calibration is nearest 1 (ties: the gamma nearest 1)."""
        index, off = self.index, math.inf
        for g, rate in enumerate(self.rates):
            if rate.per > 0 and rate.accepted > 0:
                d = abs(math.log(rate.accepted / rate.per))
                if d < off - 1e-12 or (d <= off + 1e-12 and abs(math.log(GAMMAS[g])) < abs(math.log(GAMMAS[index]))):
                    index, off = g, d
        if index != self.index:
            self.index, self._model = index, []
