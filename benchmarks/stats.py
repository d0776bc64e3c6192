"""Statistics the development benchmarks report: the p99 of a run, and whether two rows' p99
differ beyond chance (a paired block bootstrap)."""

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
