"""How long a replica will take: its TTFT (from placement to the first token) and its TPOT
(time per output token after the first), predicted from its load when the request is placed.

One linear model per pool of a model (a canary pool may run other engines) and role, fitted online by
recursive least squares with exponential forgetting, from what each streamed request that
completes measured (``gateway.flow.metrics``). The features are the ledger's, known exactly
at placement: the prompt tokens the replica still has to prefill, this request's included
(a batched engine prefills them before this one's first token), and the requests it runs
with this one (each adds to every step). No prediction until ``min_samples`` were seen.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.balance.ledger import ReplicaLoad
from gateway.fleet.replica import Replica

Features = tuple[float, float, float]


def features(load: ReplicaLoad, prompt_tokens: int) -> Features:
    """(1, thousands of prompt tokens to prefill first, requests in the batch with it)."""
    return 1.0, (load.prefill_tokens + prompt_tokens) / 1000.0, float(load.in_flight + 1)


class _LeastSquares:
    """Recursive least squares with forgetting factor ``forgetting`` (recent samples weigh
    more: the engine's speed drifts with its batch mix)."""

    def __init__(self, size: int, forgetting: float, scale: float = 1000.0) -> None:
        self.w = [0.0] * size
        self.p = [[scale if i == j else 0.0 for j in range(size)] for i in range(size)]
        self.forgetting = forgetting

    def predict(self, x: Features) -> float:
        return sum(w * v for w, v in zip(self.w, x))

    def update(self, x: Features, y: float) -> None:
        p, n = self.p, len(x)
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        gain_denominator = self.forgetting + sum(x[i] * px[i] for i in range(n))
        gain = [v / gain_denominator for v in px]
        error = y - self.predict(x)
        self.w = [w + g * error for w, g in zip(self.w, gain)]
        self.p = [[(p[i][j] - gain[i] * px[j]) / self.forgetting for j in range(n)]
                  for i in range(n)]


@dataclass(frozen=True, slots=True)
class Prediction:
    """What was predicted for one placement, and from what (to learn from the outcome)."""

    features: Features
    ttft: float | None  # seconds from placement to the first token; None: not fitted yet
    tpot: float | None  # seconds per output token after the first


class LatencyModel:
    def __init__(self, forgetting: float = 0.995, min_samples: int = 20) -> None:
        self._ttft = _LeastSquares(3, forgetting)
        self._tpot = _LeastSquares(3, forgetting)
        self.ttft_samples = self.tpot_samples = 0
        self.min_samples = min_samples

    def predict(self, load: ReplicaLoad, prompt_tokens: int) -> Prediction:
        x = features(load, prompt_tokens)
        ttft = max(0.0, self._ttft.predict(x)) if self.ttft_samples >= self.min_samples else None
        tpot = max(0.0, self._tpot.predict(x)) if self.tpot_samples >= self.min_samples else None
        return Prediction(x, ttft, tpot)

    def observe(self, x: Features, ttft: float | None, tpot: float | None) -> None:
        if ttft is not None:
            self._ttft.update(x, ttft)
            self.ttft_samples += 1
        if tpot is not None:
            self._tpot.update(x, tpot)
            self.tpot_samples += 1


class LatencyModels:
    """One model per model, pool and role of replica, made on first use."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, str, str], LatencyModel] = {}

    def of(self, replica: Replica) -> LatencyModel:
        key = (replica.model, replica.pool, replica.role)
        found = self._models.get(key)
        if found is None:
            found = self._models[key] = LatencyModel()
        return found
