"""Confidence intervals used by the quality benchmarks."""

from __future__ import annotations

import math


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson, 1927), 95% by default.

    Returns ``(low, high)`` in [0, 1]; ``(0.0, 1.0)`` when ``n`` is 0.

    Raises:
        ValueError: ``successes`` outside ``[0, n]``.
    """
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n={n}], got {successes}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def mean_ci(values: list[float], level: float = 0.95) -> dict:
    """Mean of ``values`` with a Student-t confidence interval (two-sided, ``level``).

    Returns ``{"mean", "ci_low", "ci_high", "n"}``; with fewer than 2 values the
    interval is ``None`` (undefined), with none the mean is ``None`` too.
    """
    from scipy.stats import t

    n = len(values)
    if n == 0:
        return {"mean": None, "ci_low": None, "ci_high": None, "n": 0}
    m = sum(values) / n
    if n < 2:
        return {"mean": round(m, 5), "ci_low": None, "ci_high": None, "n": 1}
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    half = float(t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return {"mean": round(m, 5), "ci_low": round(m - half, 5), "ci_high": round(m + half, 5), "n": n}
