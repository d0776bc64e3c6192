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
    counts: dict[float, list[int]] = {}
    for side, values in enumerate((baseline, canary)):
        for v in values:
            counts.setdefault(v, [0, 0])[side] += 1
    ordered = [counts[v] for v in sorted(counts)]  # each distinct value: a group of ties
    return mann_whitney_grouped([a for a, _ in ordered], [b for _, b in ordered])


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


# --- on histogram buckets (a verdict from Prometheus alone) ----------------------------------

def mann_whitney_grouped(baseline: Sequence[float],
                         canary: Sequence[float]) -> tuple[float, float]:
    """The rank test on counts per ordered group (distinct values, or histogram buckets with
    the same bounds both sides): a group's values are ties (mid-ranks, tie correction), so
    on buckets the test sees the buckets' order and nothing inside a bucket."""
    n1, n2 = sum(baseline), sum(canary)
    if not n1 or not n2:
        return 0.0, 1.0
    ranks_canary = ties = below = 0.0
    for a, b in zip(baseline, canary):
        t = a + b
        if t:
            ranks_canary += b * (below + (t + 1) / 2)
            ties += t ** 3 - t
            below += t
    u = ranks_canary - n2 * (n2 + 1) / 2
    n = n1 + n2
    variance = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if variance <= 0:
        return u, 1.0
    mean = n1 * n2 / 2
    z = (u - mean - math.copysign(0.5, u - mean)) / math.sqrt(variance)
    return u, min(1.0, _normal_two_sided(z))


def bucket_value(counts: Sequence[float], bounds: Sequence[float], rank: float) -> float:
    """The value of the ``rank``-th observation (0-based), interpolated linearly inside its
    bucket as Prometheus's histogram_quantile does (the first bucket starts at 0)."""
    below = 0.0
    for i, count in enumerate(counts):
        if count and rank < below + count:
            low = bounds[i - 1] if i else 0.0
            if math.isinf(bounds[i]):  # the +Inf bucket: its lower bound, as Prometheus
                return low
            return low + (bounds[i] - low) * (rank - below + 0.5) / count
        below += count
    return bounds[-2] if math.isinf(bounds[-1]) else bounds[-1]


def bucket_of(counts: Sequence[float], bounds: Sequence[float],
              rank: float) -> tuple[float, float]:
    """The bounds of the bucket holding the ``rank``-th observation."""
    below = 0.0
    for i, count in enumerate(counts):
        if count and rank < below + count:
            return (bounds[i - 1] if i else 0.0), bounds[i]
        below += count
    return bounds[len(counts) - 2], bounds[len(counts) - 1]


def median_change_grouped(baseline: Sequence[float], canary: Sequence[float],
                          bounds: Sequence[float], confidence: float = 0.95
                          ) -> tuple[float, float, float, float, float]:
    """``median_change`` on bucket counts, its order statistics interpolated inside their
    buckets: (change, low, high, median baseline, median canary)."""
    z = _z(confidence)

    def log_median(counts: Sequence[float]) -> tuple[float, float, float]:
        n = sum(counts)
        half = z * math.sqrt(n) / 2
        median = bucket_value(counts, bounds, (n - 1) / 2)
        low = bucket_value(counts, bounds, max(0.0, math.floor(n / 2 - half)))
        high = bucket_value(counts, bounds, min(n - 1, math.ceil(n / 2 + half)))
        if median <= 0 or low <= 0:
            return median, 0.0, 0.0
        return median, math.log(median), (math.log(high) - math.log(low)) / (2 * z)

    m_a, base, se_a = log_median(baseline)
    m_b, can, se_b = log_median(canary)
    if m_a <= 0 or m_b <= 0:
        return 0.0, 0.0, 0.0, m_a, m_b
    se = math.sqrt(se_a ** 2 + se_b ** 2)
    ratio = can - base
    return (math.exp(ratio) - 1, math.exp(ratio - z * se) - 1, math.exp(ratio + z * se) - 1,
            m_a, m_b)
