"""Chi-square goodness of fit with pooling of sparse cells."""

from __future__ import annotations

import numpy as np
from scipy import stats


def chisquare_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """p-value of observed counts against cell probabilities; cells with expected < 5 are pooled.

    A cell with probability 0 and a positive count makes the fit impossible: p-value 0.
    """
    observed = np.asarray(observed, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = observed.sum()
    expected = probs * n
    if np.any((probs <= 0) & (observed > 0)):
        return 0.0
    keep = expected >= 5
    obs = list(observed[keep])
    exp = list(expected[keep])
    if (~keep).any() and expected[~keep].sum() > 0:
        obs.append(observed[~keep].sum())
        exp.append(expected[~keep].sum())
    if len(obs) < 2:
        return 1.0  # a single cell always fits
    exp_arr = np.array(exp)
    exp_arr *= sum(obs) / exp_arr.sum()  # guard against float rounding in the totals
    return float(stats.chisquare(obs, exp_arr).pvalue)
