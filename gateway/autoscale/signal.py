"""How many replicas a pool needs: pure arithmetic, fed by ``gateway.autoscale.autoscaler``.

Little's law: a pool that takes ``arrivals`` requests a second, each staying ``W`` seconds on a
replica, holds ``arrivals x W`` requests at once. The latency model (fitted online from the
pool's completed requests) says how many a replica may run at once and still be predicted to
meet the latency objectives: the operating point. Replicas are sized to run ``headroom``
fewer than that (bursts, a replica lost), and ``W`` is predicted there (TTFT plus the mean
output times TPOT), so the answer is what the pool needs at the objectives, not what it
happens to run at now. Requests already running or waiting count too: a backlog needs room
whatever the arrival rate says.

Without an objective or a fitted model, the operating point is ``target_in_flight`` and ``W``
what requests took lately. The result is not rounded: several gateway instances each publish
their share, and their sum, rounded up (KEDA does), is the fleet's need.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from gateway.balance.ledger import ReplicaLoad
from gateway.flow.latency_model import LatencyModel

MAX_BATCH = 1024  # the operating point is looked for up to here


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    """Requests one replica runs at once, and what each then takes (seconds)."""

    in_flight: int
    ttft: float | None = None  # predicted at that load; None: not predicted
    tpot: float | None = None


def operating_point(model: LatencyModel | None, ttft_ms: float | None, tpot_ms: float | None,
                    prompt_tokens: float, limit: int, target_in_flight: int) -> OperatingPoint:
    """The most requests a replica may run at once while predicted to meet the objectives
    (at least 1: an objective no load meets is served one request at a time, best effort).
    Without an objective, or before the model is fitted, ``target_in_flight``."""
    limit = max(1, min(limit, MAX_BATCH))
    if model is None:
        return OperatingPoint(min(target_in_flight, limit))
    if ttft_ms is None and tpot_ms is None:
        n = min(target_in_flight, limit)
        return _predicted(model, n, prompt_tokens)
    best: OperatingPoint | None = None
    for n in range(1, limit + 1):  # load only adds to both (stop at the first miss)
        point = _predicted(model, n, prompt_tokens)
        if (ttft_ms is not None and point.ttft is None) or (tpot_ms is not None and point.tpot is None):
            return OperatingPoint(min(target_in_flight, limit))  # not fitted yet
        if (ttft_ms is not None and point.ttft * 1000 > ttft_ms) or \
                (tpot_ms is not None and point.tpot * 1000 > tpot_ms):  # type: ignore[operator]
            break
        best = point
    return best if best is not None else _predicted(model, 1, prompt_tokens)


def _predicted(model: LatencyModel, n: int, prompt_tokens: float) -> OperatingPoint:
    """A request placed beside ``n - 1`` others, its own prompt still to prefill."""
    prediction = model.predict(ReplicaLoad(in_flight=n - 1), round(prompt_tokens))
    return OperatingPoint(n, prediction.ttft, prediction.tpot)


@dataclass(frozen=True, slots=True)
class Demand:
    """What one pool (and role) was offered lately and holds now."""

    arrivals: float = 0.0  # requests per second
    prompt_tokens: float = 0.0  # mean per request
    output_tokens: float = 0.0  # mean generated per completed request
    seconds: float = 0.0  # mean time a completed request took on its replica (0: none seen)
    in_flight: int = 0  # running on its replicas now
    waiting: int = 0  # waiting at the gateway now (for a slot, or for a replica to appear)


def request_seconds(demand: Demand, point: OperatingPoint) -> float:
    """How long a request stays on a replica at the operating point: predicted where the
    model predicts it, else as measured."""
    if point.ttft is not None and point.tpot is not None:
        return point.ttft + max(0.0, demand.output_tokens - 1) * point.tpot
    return demand.seconds


def desired_replicas(demand: Demand, sized: OperatingPoint) -> float:
    """Replicas' worth of demand (unrounded) for replicas each running ``sized.in_flight``;
    more than 0 whenever anything is offered."""
    concurrent = max(demand.arrivals * request_seconds(demand, sized),
                     float(demand.in_flight + demand.waiting))
    if concurrent == 0.0 and (demand.arrivals > 0 or demand.waiting > 0):
        return 1.0 / sized.in_flight  # a trickle, or a request held at zero: wake one up
    return concurrent / sized.in_flight


def with_headroom(model: LatencyModel | None, point: OperatingPoint, headroom: float,
                  prompt_tokens: float) -> OperatingPoint:
    """The point replicas are sized to run at: ``headroom`` below the most they may run, and
    what a request takes there (shorter than at the most: each request adds to every step)."""
    target = max(1, math.floor(point.in_flight * (1.0 - headroom)))
    if model is None or point.ttft is None:
        return OperatingPoint(target)
    return _predicted(model, target, prompt_tokens)


class Smoother:
    """Up at once, down only after ``scale_down_after`` seconds: the value published is the
    highest of the last ``scale_down_after`` seconds' evaluations (as Kubernetes' HPA
    stabilises scale-down). A replica started is not stopped by the next quiet minute."""

    def __init__(self, scale_down_after: float, now: float = 0.0, start: float = 0.0) -> None:
        """``start``: the value at ``now``, when nothing has been seen yet (a gateway that just
        started asks for its share of the replicas there are until it has seen
        ``scale_down_after`` seconds: a restart must not look like a quiet spell)."""
        self.scale_down_after = scale_down_after
        self._history: deque[tuple[float, float]] = deque([(now, start)])  # values falling

    def update(self, now: float, value: float) -> float:
        history = self._history
        while history and history[0][0] < now - self.scale_down_after:
            history.popleft()
        # Only a later value that is no lower can ever be the window's highest.
        while history and history[-1][1] <= value:
            history.pop()
        history.append((now, value))
        return history[0][1]


def replicas(value: float) -> int:
    """What an autoscaler makes of the signal: rounded up (KEDA's AverageValue 1)."""
    return math.ceil(value - 1e-9)
