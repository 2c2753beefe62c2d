"""Statistical helpers for distribution tests (fixed false-alarm rates)."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def chisq_pvalue(counts: np.ndarray, ref: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness of fit of integer ``counts`` [V] to probabilities ``ref`` [V]; tokens with an
    expected count below ``min_expected`` are pooled into one tail bin. A token that ``ref`` gives
    probability 0 but that was drawn fails outright (p-value 0)."""
    counts = np.asarray(counts, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    n = counts.sum()
    if counts[ref <= 0].sum() > 0:
        return 0.0
    big = ref * n >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(ref[big], ref[~big].sum()) * n
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp = exp * obs.sum() / exp.sum()
    if len(obs) < 2:
        return 1.0
    return float(chisquare(obs, exp).pvalue)
