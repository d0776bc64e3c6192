"""The verdict's scoring: is the canary pool worse than the baseline pool serving beside it?

Per metric, both pools' samples from the same time window side by side: the relative change
of the median with a confidence interval and a rank test (latencies, throughput), or the
difference in points with a two-proportion test (error rate). Each metric is classed:

- ``fail``: significantly worse (p < significance) by more than its threshold;
- ``marginal``: worse by more than the threshold but not (yet) significantly;
- ``pass`` otherwise: better, or no worse than the threshold, significantly or not (as in
  Kayenta's effect-size bounds: with thousands of samples a 0.3% change is significant, and
  on identical pools ITL, e2e and tokens/s move together, so counting such changes as
  marginal judged identical pools marginal).

The overall verdict follows Kayenta's judge: a score of 0-100 from the classes (pass 1,
marginal 1/2), ``pass`` at ``pass_score`` or above, ``fail`` below ``marginal_score``,
``marginal`` between; a critical metric that fails fails the canary whatever the score.
Fewer than ``min_samples`` requests on either side is ``insufficient data``, never a pass.
A shadow canary is also judged on its output agreement (gateway/canary/agreement_metric.py).
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from gateway.canary.agreement_metric import AGREEMENT_METRICS, judge_agreement, pair_counts
from gateway.canary.samples import PairSample, Sample
from gateway.canary.stats import mann_whitney, median_change, two_proportions
from gateway.canary.config import CanaryJudgeConfig

# metric -> (sample field, +1 if higher is worse, -1 if lower is worse)
LATENCY_METRICS = {"ttft": ("ttft", 1), "itl": ("itl", 1), "e2e": ("e2e", 1),
                   "tokens_per_s": ("tokens_per_s", -1)}
EXIT_CODES = {"pass": 0, "fail": 1, "insufficient data": 2, "marginal": 3}
# llm_gateway_canary_verdict's values: worse is higher; no judgment yet is -1
GAUGE_CODES = {"insufficient data": -1, "pass": 0, "marginal": 1, "fail": 2}


def _values(samples: Sequence[Sample], field: str) -> list[float]:
    return [v for s in samples if not s.error and (v := getattr(s, field)) is not None]


def _class(worse: float, p: float, threshold: float, config: CanaryJudgeConfig) -> str:
    """fail: significantly worse by more than the threshold; marginal: worse by more, not
    significantly; pass otherwise."""
    significant = p < config.significance and worse > 0
    return ("fail" if significant and worse > threshold else
            "marginal" if worse > threshold else "pass")


def latency_header(name: str, baseline_n: int, canary_n: int,
                   config: CanaryJudgeConfig) -> dict[str, Any]:
    return {"metric": name, "baseline_n": baseline_n, "canary_n": canary_n,
            "threshold": getattr(config.thresholds, name), "critical": name in config.critical}


def classify_change(out: dict[str, Any], change: float, p: float,
                    config: CanaryJudgeConfig) -> str:
    """A latency or throughput metric's class from its relative change of the median."""
    return _class(LATENCY_METRICS[out["metric"]][1] * change, p, out["threshold"], config)


def judge_latency(name: str, baseline: Sequence[Sample], canary: Sequence[Sample],
                  config: CanaryJudgeConfig) -> dict[str, Any]:
    field = LATENCY_METRICS[name][0]
    a, b = _values(baseline, field), _values(canary, field)
    out = latency_header(name, len(a), len(b), config)
    if len(a) < config.min_samples or len(b) < config.min_samples:
        return {**out, "class": "insufficient data"}
    change, low, high = median_change(a, b, 1 - config.significance)
    _, p = mann_whitney(a, b)
    return {**out, "baseline_median": statistics.median(a), "canary_median": statistics.median(b),
            "change": change, "change_ci": [low, high], "p_value": p,
            "class": classify_change(out, change, p, config)}


def judge_error_counts(e_a: int, n_a: int, e_b: int, n_b: int,
                       config: CanaryJudgeConfig) -> dict[str, Any]:
    """The error rate from counts: errors and requests (served + failed) per side."""
    threshold = config.thresholds.error_rate_points
    out: dict[str, Any] = {"metric": "error_rate", "baseline_n": n_a, "canary_n": n_b,
                           "threshold": threshold, "critical": "error_rate" in config.critical}
    if n_a < config.min_samples or n_b < config.min_samples:
        return {**out, "class": "insufficient data"}
    rate_a, rate_b = e_a / n_a, e_b / n_b
    points = 100 * (rate_b - rate_a)
    p = two_proportions(e_a, n_a, e_b, n_b)
    return {**out, "baseline_rate": rate_a, "canary_rate": rate_b, "change_points": points,
            "p_value": p, "class": _class(points, p, threshold, config)}


def judge_errors(baseline: Sequence[Sample], canary: Sequence[Sample],
                 config: CanaryJudgeConfig) -> dict[str, Any]:
    return judge_error_counts(sum(s.error for s in baseline), len(baseline),
                              sum(s.error for s in canary), len(canary), config)


def score(metrics: list[dict[str, Any]], requests: dict[str, int],
          config: CanaryJudgeConfig) -> dict[str, Any]:
    """The score and the overall verdict from the metrics' classes (Kayenta's scoring)."""
    if min(requests.values()) < config.min_samples:
        return {"verdict": "insufficient data", "score": None, "requests": requests,
                "min_samples": config.min_samples, "metrics": metrics}
    judged = [m for m in metrics if m["class"] != "insufficient data"]
    points = sum(1.0 if m["class"] == "pass" else 0.5 if m["class"] == "marginal" else 0.0
                 for m in judged)
    total = round(100 * points / len(judged), 1) if judged else 0.0
    if any(m["critical"] and m["class"] == "fail" for m in judged):
        overall = "fail"
    elif total >= config.pass_score:
        overall = "pass"
    elif total < config.marginal_score:
        overall = "fail"
    else:
        overall = "marginal"
    return {"verdict": overall, "score": total, "requests": requests,
            "min_samples": config.min_samples, "metrics": metrics}


def verdict(baseline: Sequence[Sample], canary: Sequence[Sample], config: CanaryJudgeConfig,
            pairs: Sequence[PairSample] | None = None,
            reference_pairs: Sequence[PairSample] | None = None,
            reference: str | None = None) -> dict[str, Any]:
    """Every metric's judgment, the score and the overall verdict. ``pairs``: a shadow
    canary's pairs (agreement judged; None for a weighted canary); ``reference_pairs``: the
    reference pool's (the drop judged instead of the floors)."""
    metrics = [judge_latency(name, baseline, canary, config) for name in LATENCY_METRICS]
    metrics.append(judge_errors(baseline, canary, config))
    if pairs is not None:
        counts = pair_counts(pairs)
        ref_counts = pair_counts(reference_pairs) if reference_pairs is not None else None
        metrics += [judge_agreement(name, counts, config, ref_counts, reference)
                    for name in AGREEMENT_METRICS]
    return score(metrics, {"baseline": len(baseline), "canary": len(canary)}, config)
