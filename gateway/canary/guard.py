"""The canary guard: judge every canary now and then, and (``auto_rollback``, off by
default) roll a failing one back, never forward.

Every ``check_every`` seconds it judges, over the default window, each model's canaries
(gateway/canary/verdict_plan.py: each weighted pool against the baseline, each shadow pool
against the pool it shadows) and exports the classes for the dashboards: ``llm_gateway_canary_verdict``
{model, baseline, canary, metric} (-1 insufficient data, 0 pass, 1 marginal, 2 fail; metric
"verdict" is the overall one), ``llm_gateway_canary_score`` and, for shadow pools, the judged
agreement with its interval and the least it may be (``llm_gateway_canary_agreement_ratio``). With ``auto_rollback`` a
``fail`` sets the canary's weight to 0 through the runtime weights (shared with every
instance through Redis), says so in the log, in ``llm_gateway_canary_rollbacks_total
{model,pool}`` and in ``/admin`` (``GET /admin/canary/{model}`` lists the rollbacks). It
never raises a weight: promotion stays a human's (or a pipeline's) decision. Shadow pools
take no traffic, so they are judged but never rolled back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from gateway.canary.agreement_metric import AGREEMENT_METRICS
from gateway.canary.verdict import GAUGE_CODES
from gateway.canary.verdict_plan import CanaryError, Plan, canaries, judge_records, plan, since
from gateway.canary.sample_source import SampleSource
from gateway.canary.weights import PoolWeights
from gateway.canary.config import CanaryJudgeConfig
from gateway.fleet.model import ServedModel
from gateway.canary.metrics import CanaryMetrics

log = logging.getLogger(__name__)


class CanaryGuard:
    def __init__(self, models: dict[str, ServedModel], samples: SampleSource,
                 weights: PoolWeights, metrics: CanaryMetrics, config: CanaryJudgeConfig,
                 check_every: float, auto_rollback: bool = False) -> None:
        self.models = models
        self.samples = samples
        self.weights = weights
        self.metrics = metrics
        self.config = config
        self.check_every = check_every
        self.auto_rollback = auto_rollback
        self.rollbacks: dict[str, list[dict[str, Any]]] = {}  # per model, newest last
        for model in models.values():  # the series exist from the start (0 = never)
            for pool in model.pools:
                if len(model.pools) > 1 and pool.shadow_of is None:
                    metrics.rollbacks.labels(model.name, pool.name)

    @property
    def needed(self) -> bool:
        """Is there anything to judge (a model with two pools)?"""
        return any(len(m.pools) > 1 for m in self.models.values())

    def plans(self) -> list[Plan]:
        """Every (baseline, canary) the guard judges."""
        out = []
        for model in self.models.values():
            for baseline, canary in canaries(model, self.config.agreement.reference):
                try:
                    out.append(plan(model, self.config, baseline, canary))
                except CanaryError:
                    continue
        return out

    async def judge_all(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        """(model, baseline, canary, judgment) of every canary; the statistics run in a
        worker thread."""
        window = self.config.window
        jobs = []
        for judged in self.plans():
            records, source = await self.samples.read(judged, since(window))
            jobs.append((judged, records, source))

        def judge() -> list[tuple[str, str, str, dict[str, Any]]]:
            return [(j.model, j.baseline, j.canary,
                     {**judge_records(j, records, self.config, window), "samples": source})
                    for j, records, source in jobs]

        return await asyncio.to_thread(judge)

    def apply(self, judged: list[tuple[str, str, str, dict[str, Any]]]) -> None:
        """Export the classes; roll back failing weighted canaries if asked to (event loop)."""
        for model, baseline, canary, result in judged:
            labels = (model, baseline, canary)
            for m in result["metrics"]:
                self.metrics.verdict.labels(*labels, m["metric"]).set(GAUGE_CODES[m["class"]])
            self.metrics.verdict.labels(*labels, "verdict").set(GAUGE_CODES[result["verdict"]])
            self.metrics.score.labels(*labels).set(
                result["score"] if result["score"] is not None else float("nan"))
            for m in result["metrics"]:
                if m["metric"] in AGREEMENT_METRICS:
                    self._agreement(labels, m)
            pool = self.weights.pool(model, canary)
            if (self.auto_rollback and result["verdict"] == "fail" and pool.shadow_of is None
                    and pool.weight > 0 and self._others_serve(model, canary)):
                self.roll_back(model, baseline, canary, result)

    def _others_serve(self, model: str, canary: str) -> bool:
        """Another primary pool takes traffic: a promoted canary (the baseline at weight 0)
        is never set to 0 too, which would leave the model no pool to serve it."""
        return any(p.weight > 0 and p.shadow_of is None and p.name != canary
                   for p in self.models[model].pools)

    def _agreement(self, labels: tuple[str, str, str], m: dict[str, Any]) -> None:
        """The judged agreement, its interval and the least it may be (NaN: no pairs yet)."""
        nan = float("nan")
        low, high = m.get("canary_ci", (nan, nan))
        least = (m["baseline_rate"] - m["threshold"] / 100 if m.get("reference")
                 else m["threshold"]) if "baseline_rate" in m else nan
        gauge = self.metrics.agreement
        for bound, value in (("estimate", m.get("canary_rate", nan)), ("low", low),
                             ("high", high), ("required", least)):
            gauge.labels(*labels, m["metric"], bound).set(value)

    def roll_back(self, model: str, baseline: str, canary: str,
                  result: dict[str, Any]) -> dict[str, Any]:
        """Weight 0 for the canary (on the event loop: weights are shared state)."""
        failed = [m["metric"] for m in result["metrics"] if m["class"] == "fail"]
        self.weights.set_weight(model, canary, 0.0)
        self.metrics.rollbacks.labels(model, canary).inc()
        log.warning("canary guard: model %s pool %s failed against %s (%s, score %s): "
                    "weight set to 0", model, canary, baseline, ", ".join(failed),
                    result["score"])
        entry = {"at": time.time(), "pool": canary, "baseline": baseline, "failed": failed,
                 "score": result["score"]}
        kept = self.rollbacks.setdefault(model, [])
        kept.append(entry)
        del kept[:-20]
        return entry

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.check_every)
            try:
                self.apply(await self.judge_all())
            except Exception:  # a round that fails must not stop the guard
                log.exception("canary guard: check failed")
