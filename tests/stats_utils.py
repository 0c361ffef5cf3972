"""Goodness-of-fit statistics for the distribution tests: a G-test of observed counts against exact cell
probabilities, with rare cells pooled so the chi-square approximation holds."""
from __future__ import annotations

import numpy as np
from scipy import stats


def pooled(observed: np.ndarray, expected: np.ndarray, min_expected: float) -> tuple[np.ndarray, np.ndarray]:
    """Merge the cells of smallest expected count into one until every cell expects >= min_expected
    (or a single cell is left)."""
    order = np.argsort(expected, kind="stable")
    cum = np.cumsum(expected[order])
    # pool the cells below min_expected, then more of the smallest until the pool itself is big enough
    n_pool = max(int(np.sum(expected[order] < min_expected)), int(np.searchsorted(cum, min_expected)) + 1)
    n_pool = min(n_pool, len(order)) if np.any(expected < min_expected) else 0
    if n_pool <= 1:
        return observed, expected
    pool, keep = order[:n_pool], order[n_pool:]
    return (np.append(observed[keep], observed[pool].sum()), np.append(expected[keep], expected[pool].sum()))


def g_test(observed, probs, min_expected: float = 5.0) -> float:
    """p-value of the G-test that counts `observed` [..., C] were drawn from cell probabilities `probs`
    [..., C] (each row sums to 1). Leading dimensions are strata, each with its own total; their G
    statistics and degrees of freedom add up. A count in a cell of probability zero gives p = 0."""
    observed = np.asarray(observed, dtype=np.float64)
    probs = np.broadcast_to(np.asarray(probs, dtype=np.float64), observed.shape)
    observed, probs = observed.reshape(-1, observed.shape[-1]), probs.reshape(-1, probs.shape[-1])
    if not np.allclose(probs.sum(-1), 1.0, atol=1e-6):
        raise ValueError("cell probabilities must sum to 1 in every stratum")
    if np.any(observed[probs <= 0] > 0):
        return 0.0  # an outcome the target can never produce
    g, dof = 0.0, 0
    for obs, p in zip(observed, probs):
        total = obs.sum()
        if total == 0:
            continue
        obs, exp = pooled(obs[p > 0], total * p[p > 0], min_expected)
        nz = obs > 0
        g += 2.0 * float(np.sum(obs[nz] * np.log(obs[nz] / exp[nz])))
        dof += len(obs) - 1
    return 1.0 if dof == 0 else float(stats.chi2.sf(g, dof))
