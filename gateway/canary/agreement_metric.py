"""Output agreement as judged metrics of a shadow pool: the share of its greedy pairs whose
texts are identical (``agreement``) and whose first ``prefix_chars`` characters are
(``prefix_agreement``), each with a Wilson interval.

Judged against a floor (``fail``: significantly below it, the floor above the interval;
``marginal``: below it, not significantly), or, with a reference pool (a shadow of the same
baseline that runs the baseline's own engine), as a drop in points against the reference's
agreement: an engine's greedy answers are not bit-stable across batch sizes, so its own
agreement is measured instead of assumed to be 100%. The drop is classed as the error rate's
rise is (two-proportion test, ``max_drop_points``), with Newcombe's interval. Only greedy
pairs count: sampled answers are meant to differ.
"""

from __future__ import annotations

from typing import Any, Sequence

from gateway.canary.samples import PairSample
from gateway.canary.stats import proportion_difference, score_test, two_proportions, wilson
from gateway.canary.config import CanaryJudgeConfig

AGREEMENT_METRICS = {"agreement": "agreed", "prefix_agreement": "prefix_agreed"}


def pair_counts(pairs: Sequence[PairSample]) -> dict[str, int]:
    """What the pairs of a window were: compared greedy ones, sampled ones, dropped ones,
    and copies skipped (never sent): together, every primary offered a copy."""
    greedy = [p for p in pairs if p.greedy and p.compared]
    return {"greedy_compared": len(greedy), "agreed": sum(p.agreed for p in greedy),
            "prefix_agreed": sum(p.prefix_agreed for p in greedy),
            "not_greedy": sum(1 for p in pairs if p.compared and not p.greedy),
            "dropped": sum(1 for p in pairs if not p.compared and not p.skipped),
            "skipped": sum(1 for p in pairs if p.skipped)}


def _base(name: str, config: CanaryJudgeConfig, canary_n: int,
          reference: str | None) -> dict[str, Any]:
    return {"metric": name, "canary_n": canary_n, "critical": name in config.critical,
            "reference": reference}


def judge_agreement(name: str, counts: dict[str, int], config: CanaryJudgeConfig,
                    ref_counts: dict[str, int] | None = None,
                    reference: str | None = None) -> dict[str, Any]:
    """One agreement metric of a shadow pool's pair counts (``pair_counts``; ``ref_counts``:
    the reference pool's, for the drop; None: the floor)."""
    field = AGREEMENT_METRICS[name]
    settings = config.agreement
    confidence = 1 - config.significance
    n, agreed = counts["greedy_compared"], counts[field]
    out = _base(name, config, n, reference if ref_counts is not None else None)
    out["pairs"] = counts
    low, high = wilson(agreed, n, confidence)
    if n:  # shown (and on the board) even while too few to judge
        out.update(canary_rate=agreed / n, canary_ci=[low, high])
    if ref_counts is None:
        floor = settings.floor if name == "agreement" else settings.prefix_floor
        out.update(baseline_n=None, threshold=floor, baseline_rate=floor)
        if n < config.min_samples:
            return {**out, "class": "insufficient data"}
        rate = agreed / n
        p = score_test(agreed, n, floor)
        cls = ("fail" if high < floor else "marginal" if rate < floor else "pass")
        return {**out, "change_points": 100 * (rate - floor),
                "change_ci": [100 * (low - floor), 100 * (high - floor)], "p_value": p,
                "class": cls}
    n_ref, agreed_ref = ref_counts["greedy_compared"], ref_counts[field]
    out.update(baseline_n=n_ref, threshold=settings.max_drop_points, reference_pairs=ref_counts)
    if n_ref:
        out["baseline_rate"] = agreed_ref / n_ref
    if n < config.min_samples or n_ref < config.min_samples:
        return {**out, "class": "insufficient data"}
    change, low, high = proportion_difference(agreed_ref, n_ref, agreed, n, confidence)
    # The test counts disagreements, as the error rate's counts errors.
    p = two_proportions(n_ref - agreed_ref, n_ref, n - agreed, n)
    drop = -100 * change
    significant = p < config.significance and drop > 0
    cls = ("fail" if significant and drop > settings.max_drop_points else
           "marginal" if drop > settings.max_drop_points else "pass")
    return {**out, "change_points": 100 * change,
            "change_ci": [100 * low, 100 * high], "p_value": p, "class": cls}
