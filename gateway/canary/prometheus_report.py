"""A canary verdict from Prometheus alone, for fleets where only Prometheus is reachable.

  llm-gateway canary report --prometheus URL --model M --baseline B --canary C [--window 30m]

The same metrics, classes and score as the sample-based verdict (gateway/canary/verdict.py),
computed from what the gateways export: for each pool, how much each histogram bucket and
counter grew over the window (per series, the value at the window's end less the value at its
start; a series that reset or began inside the window counts from 0), summed over instances.

- TTFT, inter-token latency, e2e and tokens/s: the rank test on bucket counts (a bucket's
  requests are ties: the test sees the buckets' order and nothing inside a bucket) and the
  medians' relative change, their order statistics interpolated inside their buckets as
  ``histogram_quantile`` does. What this gives up: a difference inside one bucket is
  invisible (two medians in the same bucket may differ by up to the bucket's width:
  e.g. 50-75 ms for TTFT, a factor 1.5), and the change is known only to the buckets that
  hold the two medians: each metric's ``resolution`` is the range of changes those buckets
  allow.
- Error rate and output agreement are counts: nothing is lost (requests served and failed
  from ``llm_gateway_requests_total``; pairs from ``llm_gateway_shadow_pairs_total`` and
  ``..._prefix_agreed_total``, dropped and skipped ones from ``..._pairs_dropped_total`` and
  ``llm_gateway_shadow_skipped_total``).
- The window's edges fall on scrapes: requests that ended in the last scrape interval may
  be missing.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gateway.canary.agreement_metric import AGREEMENT_METRICS, judge_agreement
from gateway.canary.verdict import (EXIT_CODES, LATENCY_METRICS, classify_change,
                                  judge_error_counts, latency_header, score)
from gateway.canary.stats import bucket_of, median_change_grouped, mann_whitney_grouped
from gateway.canary.config import CanaryJudgeConfig

HISTOGRAMS = {"ttft": "llm_gateway_time_to_first_token_seconds",
              "itl": "llm_gateway_inter_token_latency_seconds",
              "e2e": "llm_gateway_e2e_request_latency_seconds",
              "tokens_per_s": "llm_gateway_request_output_tokens_per_second"}
NOTE = ("Prometheus alone: bucket counts (medians interpolated inside buckets; differences "
        "inside a bucket unseen: see each metric's resolution)")


class PrometheusError(RuntimeError):
    """Prometheus did not answer, or answered an error."""


class Prometheus:
    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def vector(self, expr: str, at: float) -> list[tuple[dict[str, str], float]]:
        query = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{query}",
                                        timeout=self.timeout) as reply:
                answer = json.loads(reply.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PrometheusError(f"cannot query {self.url}: {exc}") from None
        if answer.get("status") != "success":
            raise PrometheusError(f"{expr}: {answer.get('error', answer)}")
        return [(r["metric"], float(r["value"][1])) for r in answer["data"]["result"]]

    def growth(self, selector: str, start: float, end: float) -> list[tuple[dict[str, str], float]]:
        """How much each series of ``selector`` grew from ``start`` to ``end``."""
        def key(labels: dict[str, str]) -> tuple:
            return tuple(sorted(labels.items()))

        before = {key(labels): value for labels, value in self.vector(selector, start)}
        out = []
        for labels, value in self.vector(selector, end):
            earlier = before.get(key(labels), 0.0)
            out.append((labels, value - earlier if value >= earlier else value))  # a reset
        return out


def _selector(name: str, model: str, pool: str, extra: str = "") -> str:
    quote = lambda v: json.dumps(v)  # noqa: E731 - PromQL strings take JSON's escapes
    return f"{name}{{model={quote(model)},pool={quote(pool)}{extra}}}"


def buckets(prom: Prometheus, metric: str, model: str, pool: str, start: float,
            end: float) -> tuple[list[float], list[float]]:
    """(upper bounds, requests per bucket) of a pool's histogram over the window."""
    cumulative: dict[float, float] = {}
    for labels, grew in prom.growth(_selector(f"{HISTOGRAMS[metric]}_bucket", model, pool),
                                    start, end):
        bound = float(labels["le"])
        cumulative[bound] = cumulative.get(bound, 0.0) + grew
    bounds = sorted(cumulative)
    counts, below = [], 0.0
    for bound in bounds:
        counts.append(max(0.0, round(cumulative[bound]) - below))
        below = max(below, round(cumulative[bound]))
    return bounds, counts


def _by(prom: Prometheus, name: str, model: str, pool: str, start: float, end: float,
        label: str, extra: str = "") -> dict[str, int]:
    out: dict[str, int] = {}
    for labels, grew in prom.growth(_selector(name, model, pool, extra), start, end):
        out[labels.get(label, "")] = out.get(labels.get(label, ""), 0) + round(grew)
    return out


def judge_histogram(name: str, bounds: list[float], base: list[float], can: list[float],
                    config: CanaryJudgeConfig) -> dict[str, Any]:
    out = latency_header(name, int(sum(base)), int(sum(can)), config)
    if out["baseline_n"] < config.min_samples or out["canary_n"] < config.min_samples:
        return {**out, "class": "insufficient data"}
    change, low, high, m_a, m_b = median_change_grouped(base, can, bounds,
                                                        1 - config.significance)
    _, p = mann_whitney_grouped(base, can)
    bucket_a = bucket_of(base, bounds, (sum(base) - 1) / 2)
    bucket_b = bucket_of(can, bounds, (sum(can) - 1) / 2)
    widest = (bucket_b[1] / bucket_a[0] - 1) if bucket_a[0] > 0 else math.inf
    return {**out, "baseline_median": m_a, "canary_median": m_b, "change": change,
            "change_ci": [low, high], "p_value": p,
            "class": classify_change(out, change, p, config),
            "median_buckets": {"baseline": list(bucket_a), "canary": list(bucket_b)},
            "resolution": [bucket_b[0] / bucket_a[1] - 1, widest]}


def pair_counts(prom: Prometheus, model: str, pool: str, start: float,
                end: float) -> dict[str, int] | None:
    """A shadow pool's pairs over the window (None: the pool has no pair series)."""
    greedy = _by(prom, "llm_gateway_shadow_pairs_total", model, pool, start, end, "result",
                 ',greedy="true"')
    if not greedy:
        return None
    sampled = _by(prom, "llm_gateway_shadow_pairs_total", model, pool, start, end, "greedy",
                  ',greedy="false"')
    prefix = _by(prom, "llm_gateway_shadow_pairs_prefix_agreed_total", model, pool, start, end,
                 "greedy", ',greedy="true"')
    dropped = _by(prom, "llm_gateway_shadow_pairs_dropped_total", model, pool, start, end,
                  "reason")
    skipped = _by(prom, "llm_gateway_shadow_skipped_total", model, pool, start, end, "reason")
    return {"greedy_compared": sum(greedy.values()), "agreed": greedy.get("agreed", 0),
            "prefix_agreed": prefix.get("true", 0), "not_greedy": sum(sampled.values()),
            "dropped": sum(dropped.values()), "skipped": sum(skipped.values())}


def judge_from_prometheus(prom: Prometheus, model: str, baseline: str, canary: str,
                          window: float, config: CanaryJudgeConfig,
                          reference: str | None = None,
                          end: float | None = None) -> dict[str, Any]:
    end = end or time.time()
    start = end - window
    metrics = []
    for name in LATENCY_METRICS:
        bounds, base = buckets(prom, name, model, baseline, start, end)
        bounds_c, can = buckets(prom, name, model, canary, start, end)
        if bounds and bounds_c and bounds != bounds_c:
            raise PrometheusError(f"{HISTOGRAMS[name]}: the pools' buckets differ")
        bounds = bounds or bounds_c
        if not bounds:
            base = can = []
        metrics.append(judge_histogram(name, bounds, base or [0.0] * len(bounds),
                                       can or [0.0] * len(bounds), config))
    statuses = [_by(prom, "llm_gateway_requests_total", model, pool, start, end, "status")
                for pool in (baseline, canary)]
    # As the samples count them: served (2xx) and failed by the replica (5xx).
    (served_a, failed_a), (served_b, failed_b) = [
        (s.get("2xx", 0) + s.get("5xx", 0), s.get("5xx", 0)) for s in statuses]
    metrics.append(judge_error_counts(failed_a, served_a, failed_b, served_b, config))
    counts = pair_counts(prom, model, canary, start, end)
    reference = reference or config.agreement.reference
    ref_counts = (pair_counts(prom, model, reference, start, end)
                  if reference and reference != canary and counts is not None else None)
    if counts is not None:
        metrics += [judge_agreement(name, counts, config, ref_counts,
                                    reference if ref_counts is not None else None)
                    for name in AGREEMENT_METRICS]
    result = score(metrics, {"baseline": served_a, "canary": served_b}, config)
    out = {"model": model, "baseline": baseline, "canary": canary, "window_s": window,
           **result, "exit_code": EXIT_CODES[result["verdict"]],
           "samples": {"scope": "prometheus", "note": NOTE}}
    if counts is not None:
        out["agreement_reference"] = reference if ref_counts is not None else None
    return out
