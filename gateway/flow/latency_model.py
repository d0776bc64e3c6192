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
    """Recursive least squares over the three features, with forgetting factor
    ``forgetting`` (recent samples weigh more: the engine's speed drifts with its batch mix).
    Written out for three: it runs once per completed request, on the event loop."""

    __slots__ = ("w", "p", "forgetting", "scale")

    def __init__(self, forgetting: float, scale: float = 1000.0) -> None:
        self.w = (0.0, 0.0, 0.0)
        self.scale = scale
        self.p = [scale, 0.0, 0.0, 0.0, scale, 0.0, 0.0, 0.0, scale]  # row-major, symmetric
        self.forgetting = forgetting

    def predict(self, x: Features) -> float:
        w = self.w
        return w[0] * x[0] + w[1] * x[1] + w[2] * x[2]

    def update(self, x: Features, y: float) -> None:
        p, (x0, x1, x2), lam = self.p, x, self.forgetting
        q0 = p[0] * x0 + p[1] * x1 + p[2] * x2  # P x
        q1 = p[3] * x0 + p[4] * x1 + p[5] * x2
        q2 = p[6] * x0 + p[7] * x1 + p[8] * x2
        d = lam + x0 * q0 + x1 * q1 + x2 * q2
        g0, g1, g2 = q0 / d, q1 / d, q2 / d  # the gain
        error = y - self.predict(x)
        w0, w1, w2 = self.w
        self.w = (w0 + g0 * error, w1 + g1 * error, w2 + g2 * error)
        p = [(p[0] - g0 * q0) / lam, (p[1] - g0 * q1) / lam, (p[2] - g0 * q2) / lam,
             (p[3] - g1 * q0) / lam, (p[4] - g1 * q1) / lam, (p[5] - g1 * q2) / lam,
             (p[6] - g2 * q0) / lam, (p[7] - g2 * q1) / lam, (p[8] - g2 * q2) / lam]
        # Forgetting inflates P along directions the samples do not vary in (a steady load
        # repeats one x): its trace is kept at most the start's, so it never overflows.
        trace = p[0] + p[4] + p[8]
        if trace > 3 * self.scale:
            p = [v * 3 * self.scale / trace for v in p]
        self.p = p


@dataclass(frozen=True, slots=True)
class Prediction:
    """What was predicted for one placement, and from what (to learn from the outcome)."""

    features: Features
    ttft: float | None  # seconds from placement to the first token; None: not fitted yet
    tpot: float | None  # seconds per output token after the first


class LatencyModel:
    def __init__(self, forgetting: float = 0.995, min_samples: int = 20) -> None:
        self._ttft = _LeastSquares(forgetting)
        self._tpot = _LeastSquares(forgetting)
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

    def find(self, model: str, pool: str, role: str) -> LatencyModel | None:
        """The model of that pool and role, if any of its requests taught one yet."""
        return self._models.get((model, pool, role))

    def of(self, replica: Replica) -> LatencyModel:
        key = (replica.model, replica.pool, replica.role)
        found = self._models.get(key)
        if found is None:
            found = self._models[key] = LatencyModel()
        return found
