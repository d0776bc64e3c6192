"""The canary guard: judge every canary now and then, and (``auto_rollback``, off by
default) roll a failing one back, never forward.

Every ``check_every`` seconds it judges each model that has a baseline and a canary pool
(gateway/canary/judge.py, default pools and window) and exports the classes for the dashboards: ``llm_gateway_canary_verdict``
{model, baseline, canary, metric} (-1 insufficient data, 0 pass, 1 marginal, 2 fail; metric
"verdict" is the overall one) and ``llm_gateway_canary_score``. With ``auto_rollback`` a
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

from gateway.canary.judge import GAUGE_CODES
from gateway.canary.report import CanaryError, choose_pools, judge_model
from gateway.canary.samples import SampleBook
from gateway.canary.weights import PoolWeights
from gateway.config import CanaryJudgeConfig
from gateway.fleet.model import ServedModel
from gateway.metrics import CanaryMetrics

log = logging.getLogger(__name__)


class CanaryGuard:
    def __init__(self, models: dict[str, ServedModel], samples: SampleBook,
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

    def judge_all(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        """(model, baseline, canary, judgment) of every model with a canary. Only reads:
        safe in a worker thread."""
        out = []
        for model in self.models.values():
            if len(model.pools) < 2:
                continue
            try:
                baseline, canary = choose_pools(model, None, None)
            except CanaryError:
                continue
            out.append((model.name, baseline, canary,
                        judge_model(self.samples, model, self.config, baseline, canary)))
        return out

    def apply(self, judged: list[tuple[str, str, str, dict[str, Any]]]) -> None:
        """Export the classes; roll back failing weighted canaries if asked to (event loop)."""
        for model, baseline, canary, result in judged:
            labels = (model, baseline, canary)
            for m in result["metrics"]:
                self.metrics.verdict.labels(*labels, m["metric"]).set(GAUGE_CODES[m["class"]])
            self.metrics.verdict.labels(*labels, "verdict").set(GAUGE_CODES[result["verdict"]])
            self.metrics.score.labels(*labels).set(
                result["score"] if result["score"] is not None else float("nan"))
            pool = self.weights.pool(model, canary)
            if (self.auto_rollback and result["verdict"] == "fail" and pool.shadow_of is None
                    and pool.weight > 0):
                self.roll_back(model, baseline, canary, result)

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
                self.apply(await asyncio.to_thread(self.judge_all))
            except Exception:  # a round that fails must not stop the guard
                log.exception("canary guard: check failed")
