"""Statistics the development benchmarks report: the p99 of a run, whether two rows' p99
differ beyond chance (a paired block bootstrap), and a mean over seeds with its 95% interval."""

from __future__ import annotations

import heapq
import math
import random
import statistics
from typing import Sequence

from gateway.bench.report import percentile


def top_percentile(values: Sequence[float], q: float) -> float:
    """``percentile(sorted(values), q)`` for a high ``q``, from the few largest values only."""
    k = (len(values) - 1) * q / 100
    lo = math.floor(k)
    top = heapq.nlargest(len(values) - lo, values)  # descending: top[-1] is rank lo
    above = top[-2] if len(top) > 1 else top[-1]
    return top[-1] + (above - top[-1]) * (k - lo)


def p99_difference(rows: Sequence[Sequence[float | None]],
                   baselines: Sequence[Sequence[float | None]], rounds: int = 1000,
                   block: int = 100, seed: int = 0) -> tuple[float, float, float]:
    """How far one policy's TTFT p99 is from another's on the same schedules, and whether
    chance could explain it: the mean over schedules of (p99 - the baseline's p99), and a 95%
    interval from a paired circular block bootstrap (each draw takes the same requests from
    both, in blocks of ``block`` consecutive arrivals, since a request's TTFT depends on its
    neighbours'). Each argument holds one list of per-request TTFTs per schedule, in arrival
    order; None (a request not served, or not the gateway's) is left out of both."""
    rng = random.Random(seed)
    observed, draws = [], [0.0] * rounds
    for row, base in zip(rows, baselines, strict=True):
        both = [(a, b) for a, b in zip(row, base, strict=True) if a is not None and b is not None]
        a, b = [x for x, _ in both], [y for _, y in both]
        n = len(a)
        observed.append(top_percentile(a, 99) - top_percentile(b, 99))
        a2, b2 = a + a, b + b  # a block may wrap around the end
        for i in range(rounds):
            starts = [rng.randrange(n) for _ in range(-(-n // block))]
            pick_a, pick_b = [], []
            for start in starts:
                pick_a += a2[start:start + block]
                pick_b += b2[start:start + block]
            draws[i] += top_percentile(pick_a[:n], 99) - top_percentile(pick_b[:n], 99)
    draws = sorted(d / len(observed) for d in draws)
    low, high = percentile(draws, 2.5), percentile(draws, 97.5)
    assert low is not None and high is not None  # rounds > 0
    return statistics.mean(observed), low, high


# Student's t, two-sided 95%, by degrees of freedom (past the table: 2.0, a little wide).
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
       10: 2.23, 11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11,
       18: 2.10, 19: 2.09, 20: 2.09, 25: 2.06, 30: 2.04}


def t95(df: int) -> float:
    """The 95% t quantile for ``df`` degrees of freedom (the next lower df in the table: wider)."""
    return T95[max(k for k in T95 if k <= df)] if df <= 30 else 2.0


def mean_half_width(values: Sequence[float]) -> tuple[float, float]:
    """The mean of independent values (one per seed) and the half-width of its 95% t
    interval; with a paired difference per seed, an interval that holds 0 means the seeds
    cannot tell the two rows apart. One value: half-width 0 (no interval)."""
    m = statistics.mean(values)
    if len(values) < 2:
        return m, 0.0
    return m, t95(len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
