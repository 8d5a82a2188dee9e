"""Chi-square goodness of fit without scipy (Wilson-Hilferty normal approximation)."""

from __future__ import annotations

import numpy as np


def chi_square_z(observed: np.ndarray, expected: np.ndarray, min_expected: float = 5.0
                 ) -> float:
    """z-score of the chi-square statistic; cells with small expectation are pooled.

    Large z (say > 4, p < 3e-5) means the observed counts do not follow ``expected``.
    """
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    big = expected >= min_expected
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    if np.any(obs[~keep] > 0):
        return float("inf")  # something happened that should be impossible
    obs, exp = obs[keep], exp[keep]
    k = len(obs) - 1
    if k < 1:
        return 0.0
    x = float(((obs - exp) ** 2 / exp).sum())
    return ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / np.sqrt(2 / (9 * k))


def two_sample_z(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square homogeneity test of two count vectors over the same categories."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    total = a + b
    expected_a = total * a.sum() / total.sum()
    expected_b = total * b.sum() / total.sum()
    big = (expected_a >= 5) & (expected_b >= 5)
    rows = np.stack([np.append(a[big], a[~big].sum()), np.append(b[big], b[~big].sum())])
    exp = np.stack([np.append(expected_a[big], expected_a[~big].sum()),
                    np.append(expected_b[big], expected_b[~big].sum())])
    keep = exp.min(axis=0) > 0
    rows, exp = rows[:, keep], exp[:, keep]
    k = rows.shape[1] - 1
    if k < 1:
        return 0.0
    x = float(((rows - exp) ** 2 / exp).sum())
    return ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / np.sqrt(2 / (9 * k))
