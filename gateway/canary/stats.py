"""The statistics of the canary verdict, as pure functions (no SciPy at run time).

- ``mann_whitney``: is one latency distribution shifted against the other? The rank test
  Kayenta's judge uses: no assumption about the shape of the distributions, robust to the
  long tails latency has. Normal approximation with the tie correction (fine from ~20
  samples a side; the verdict needs more than that anyway).
- ``two_proportions``: do two error rates differ? The pooled two-proportion z-test.
- ``median_change``: the relative change of the median, canary against baseline, with a
  seeded bootstrap confidence interval.
"""

from __future__ import annotations

import math
import random
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


def median_change(baseline: Sequence[float], canary: Sequence[float], confidence: float = 0.95,
                  resamples: int = 400, seed: int = 0) -> tuple[float, float, float]:
    """(change, low, high): median(canary) / median(baseline) - 1 and its bootstrap interval."""
    def change(a: Sequence[float], b: Sequence[float]) -> float:
        base = statistics.median(a)
        return statistics.median(b) / base - 1 if base else 0.0

    point = change(baseline, canary)
    rng = random.Random(seed)
    draws = sorted(change(rng.choices(baseline, k=len(baseline)),
                          rng.choices(canary, k=len(canary))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    low = draws[int(tail * (resamples - 1))]
    high = draws[int((1 - tail) * (resamples - 1))]
    return point, low, high
