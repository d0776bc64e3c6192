"""The statistics of the canary verdict, as pure functions (no SciPy at run time).

- ``mann_whitney``: is one latency distribution shifted against the other? The rank test
  Kayenta's judge uses: no assumption about the shape of the distributions, robust to the
  long tails latency has. Normal approximation with the tie correction (fine from ~20
  samples a side; the verdict needs more than that anyway).
- ``two_proportions``: do two error rates differ? The pooled two-proportion z-test.
- ``median_change``: the relative change of the median, canary against baseline, with a
  confidence interval from the medians' distribution-free (order-statistic) intervals.
- ``wilson``: a proportion's interval (output agreement), right near 0 and 1 where the
  normal approximation is not; ``proportion_difference``: Newcombe's interval of the
  difference of two proportions, from their Wilson intervals; ``score_test``: is a
  proportion different from a given one (the test the Wilson interval inverts)?
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence


def _normal_two_sided(z: float) -> float:
    return math.erfc(abs(z) / math.sqrt(2))


def mann_whitney(baseline: Sequence[float], canary: Sequence[float]) -> tuple[float, float]:
    """(U of the canary, two-sided p-value). p = 1 when either side is empty or all equal."""
    n1, n2 = len(baseline), len(canary)
    if not n1 or not n2:
        return 0.0, 1.0
    pooled = sorted([(v, 0) for v in baseline] + [(v, 1) for v in canary])
    ranks_canary, ties, i = 0.0, 0.0, 0
    while i < len(pooled):  # mid-ranks of tied values
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        rank = (i + j) / 2 + 1
        t = j - i + 1
        ties += t ** 3 - t
        ranks_canary += rank * sum(1 for k in range(i, j + 1) if pooled[k][1] == 1)
        i = j + 1
    u = ranks_canary - n2 * (n2 + 1) / 2
    n = n1 + n2
    variance = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if variance <= 0:
        return u, 1.0
    mean = n1 * n2 / 2
    z = (u - mean - math.copysign(0.5, u - mean)) / math.sqrt(variance)  # continuity
    return u, min(1.0, _normal_two_sided(z))


def two_proportions(errors_a: int, n_a: int, errors_b: int, n_b: int) -> float:
    """Two-sided p-value that the two rates are equal (1 when undefined)."""
    if not n_a or not n_b:
        return 1.0
    pooled = (errors_a + errors_b) / (n_a + n_b)
    variance = pooled * (1 - pooled) * (1 / n_a + 1 / n_b)
    if variance <= 0:
        return 1.0
    return _normal_two_sided((errors_b / n_b - errors_a / n_a) / math.sqrt(variance))


def _log_median_and_se(values: Sequence[float]) -> tuple[float, float]:
    """ln(median) and its standard error, from the distribution-free interval of the median
    (the order statistics at n/2 -+ 1.96 sqrt(n)/2): one sort, any distribution."""
    ordered = sorted(values)
    n = len(ordered)
    half = 1.959964 * math.sqrt(n) / 2
    low = ordered[max(0, math.floor(n / 2 - half))]
    high = ordered[min(n - 1, math.ceil(n / 2 + half))]
    median = statistics.median(ordered)
    if median <= 0 or low <= 0:
        return math.log(median) if median > 0 else 0.0, 0.0
    return math.log(median), (math.log(high) - math.log(low)) / (2 * 1.959964)


def median_change(baseline: Sequence[float], canary: Sequence[float],
                  confidence: float = 0.95) -> tuple[float, float, float]:
    """(change, low, high): median(canary) / median(baseline) - 1 and its interval (the log
    ratio of the medians with their order-statistic standard errors; O(n log n), so a
    report on thousands of requests takes milliseconds)."""
    base, se_base = _log_median_and_se(baseline)
    can, se_can = _log_median_and_se(canary)
    if base == 0.0 and se_base == 0.0 and statistics.median(baseline) <= 0:
        return 0.0, 0.0, 0.0
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    ratio, se = can - base, math.sqrt(se_base ** 2 + se_can ** 2)
    return math.exp(ratio) - 1, math.exp(ratio - z * se) - 1, math.exp(ratio + z * se) - 1


def _z(confidence: float) -> float:
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of ``successes / n`` ((0, 1) when n is 0)."""
    if n <= 0:
        return 0.0, 1.0
    z, p = _z(confidence), successes / n
    scale = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / scale
    half = z / scale * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def proportion_difference(successes_a: int, n_a: int, successes_b: int, n_b: int,
                          confidence: float = 0.95) -> tuple[float, float, float]:
    """(p_b - p_a, low, high): Newcombe's hybrid score interval (his method 10)."""
    p_a, p_b = successes_a / n_a, successes_b / n_b
    low_a, high_a = wilson(successes_a, n_a, confidence)
    low_b, high_b = wilson(successes_b, n_b, confidence)
    d = p_b - p_a
    return (d, d - math.sqrt((p_b - low_b) ** 2 + (high_a - p_a) ** 2),
            d + math.sqrt((high_b - p_b) ** 2 + (p_a - low_a) ** 2))


def score_test(successes: int, n: int, expected: float) -> float:
    """Two-sided p-value that the proportion is ``expected`` (score test: p < alpha exactly
    when ``expected`` lies outside the Wilson interval at 1 - alpha)."""
    if n <= 0:
        return 1.0
    p = successes / n
    if expected <= 0.0 or expected >= 1.0:
        return 1.0 if p == expected else 0.0
    return _normal_two_sided((p - expected) / math.sqrt(expected * (1 - expected) / n))
