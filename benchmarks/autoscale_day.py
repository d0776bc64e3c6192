"""Autoscaling over a day-shaped load, in virtual time: the gateway's desired-replicas signal
against KEDA's common practice (queue length) and a static fleet sized for the peak.

    python -m benchmarks.autoscale_day [--seeds 1 2 3 4 5] [--hour-seconds 900]
        [--trough 3.0] [--start-seconds 60] [--out FILE.json]

The day: a trough, a quiet hour near zero (2 per cent of the trough), a ramp to a peak at
3x the trough, a burst at 2x the peak for a quarter hour, a decline and the trough again. Its
24 "hours" last ``--hour-seconds`` each (900: the day in 6 virtual hours, so a replica's
``--start-seconds`` is 4 times longer against the load's changes than in a real day).
Requests arrive as a Poisson process at that rate (the same arrivals for every scaler of a
seed): 70 per cent interactive (TTFT objective 1 s, served first when queued), the rest batch
(no objective); prompts and outputs drawn lognormally (means 1,000 and 300 tokens).

A replica (one engine on one GPU) is a timing model: TTFT = 40 ms + 0.15 ms per prompt token
+ 4 ms per request running beside it, TPOT = 20 ms + 1.5 ms per request running; it runs at
most 64 requests (the gateway's in-flight limit; more wait at the gateway, up to 30 s, then
are refused; with no replica up at all, up to scale_from_zero's 120 s). A replica costs
GPU-seconds from the moment it is asked for (its ``--start-seconds`` of start included) until
it is gone, after its in-flight requests finished (removal drains: nothing is lost).

Each scaler is an HPA as KEDA drives it, deciding every 15 s: up at once (at most doubling,
or +4, per decision), down after a stabilisation window, to the ceiling of its metric,
between its minimum and twice the static fleet (its ``maxReplicaCount``):
- ``gateway``: ``sum(llm_gateway_desired_replicas)``, computed by the gateway's own
  ``Autoscaler`` (deploy/kubernetes/autoscaling: threshold 1, activation 0, min 0; the
  gateway smooths, so HPA's scale-down window is 0), fed exactly what the gateway would be:
  each arrival, each completion, the ledger, the queue, and the latency model fitted online
  from the completions; the pod removed is the signal's scale-down candidate;
- ``queue``: KEDA on the waiting requests (``vllm:num_requests_waiting`` in most
  deployments; here the gateway's queue, where they wait), threshold 5 per replica, min 1,
  HPA's default 300 s scale-down window: the common practice;
- ``concurrency``: the same on requests running and waiting, 80 per cent of 20 per replica
  (what an operator who measured the engine would set): a stronger baseline;
- ``static``: a fixed fleet sized for the peak (Little's law at the engine's true operating
  point, 20 requests a replica for the TPOT objective of 50 ms, and 20 per cent headroom).

Per scaler: GPU-seconds, the share of interactive requests whose TTFT met 1 s, and requests
refused, as means over seeds with 95 per cent intervals (``benchmarks.stats``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from benchmarks.stats import mean_half_width
from gateway.autoscale.autoscaler import Autoscaler
from gateway.autoscale.candidate import scale_down_candidates
from gateway.autoscale.config import AutoscaleConfig
from gateway.balance.ledger import InProcessLedger
from gateway.config import BackpressureConfig, ObjectiveConfig
from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.replica import Replica
from gateway.flow.latency_model import LatencyModels, features

MODEL, POOL = "m", "default"
TTFT_OBJECTIVE = 1.0  # seconds, interactive requests
TPOT_OBJECTIVE = 0.050
MAX_IN_FLIGHT = 64
QUEUE_TIMEOUT = 30.0
HOLD_TIMEOUT = 120.0
DECIDE_EVERY = 15.0
INTERACTIVE_SHARE = 0.7


@dataclass(frozen=True)
class Engine:
    """One replica's timing (seconds)."""

    ttft_base: float = 0.040
    prefill_per_token: float = 0.00015
    ttft_per_request: float = 0.004
    tpot_base: float = 0.020
    tpot_per_request: float = 0.0015

    def ttft(self, running: int, prompt: int) -> float:
        return self.ttft_base + prompt * self.prefill_per_token + running * self.ttft_per_request

    def tpot(self, running: int) -> float:
        return self.tpot_base + running * self.tpot_per_request


ENGINE = Engine()


def day_rate(hour: float, trough: float) -> float:
    """Requests per second at ``hour`` (0-24) of the day."""
    if 2 <= hour < 3:
        return 0.02 * trough  # the quiet hour
    if 13 <= hour < 13.25:
        return 6 * trough  # the burst: twice the peak
    if 6 <= hour < 10:
        return trough * (1 + 2 * (hour - 6) / 4)  # the ramp
    if 10 <= hour < 16:
        return 3 * trough  # the peak
    if 16 <= hour < 20:
        return trough * (3 - 2 * (hour - 16) / 4)
    return trough


@dataclass(slots=True)
class Request:
    arrival: float
    prompt: int
    output: int
    interactive: bool
    ttft: float | None = None
    refused: bool = False


def arrivals(seed: int, hour_seconds: float, trough: float) -> list[Request]:
    """A Poisson process at ``day_rate`` (by thinning at the day's highest rate)."""
    rng = random.Random(seed)
    top = 6 * trough
    out, t, end = [], 0.0, 24 * hour_seconds
    while True:
        t += rng.expovariate(top)
        if t >= end:
            return out
        if rng.random() * top < day_rate(t / hour_seconds, trough):
            out.append(Request(t, max(16, int(rng.lognormvariate(math.log(1000) - 0.125, 0.5))),
                               max(4, int(rng.lognormvariate(math.log(300) - 0.32, 0.8))),
                               rng.random() < INTERACTIVE_SHARE))


@dataclass(eq=False)
class SimReplica:
    replica: Replica
    asked_at: float
    ready_at: float
    running: int = 0
    draining: bool = False
    gone_at: float | None = None


@dataclass
class Fleet:
    """Replicas, the gateway's queue and what the scaler sees."""

    engine: Engine
    start_seconds: float
    ledger: InProcessLedger = field(default_factory=InProcessLedger)
    replicas: list[SimReplica] = field(default_factory=list)
    pool: Pool = field(default_factory=lambda: Pool(POOL, 100, []))
    # The gateway's queue: interactive requests first (a higher band), then batch ones.
    interactive: deque = field(default_factory=deque)
    batch: deque = field(default_factory=deque)
    count: int = 0

    def waiting(self) -> int:
        return len(self.interactive) + len(self.batch)

    def head(self) -> deque | None:
        return self.interactive or self.batch or None

    def up(self, now: float) -> list[SimReplica]:
        return [r for r in self.replicas if not r.draining and r.ready_at <= now]

    def asked(self) -> list[SimReplica]:
        return [r for r in self.replicas if not r.draining]

    def add(self, now: float) -> SimReplica:
        self.count += 1
        replica = SimReplica(Replica(f"r{self.count}", f"http://r{self.count}", "vllm", MODEL,
                                     POOL), now, now + self.start_seconds)
        self.replicas.append(replica)
        return replica


class Placer:
    """What the gateway's Autoscaler reads of its placer: the latency models, the in-flight
    limit, the queue."""

    def __init__(self, fleet: Fleet) -> None:
        self.latency = LatencyModels()
        self.backpressure = BackpressureConfig(max_in_flight_per_replica=MAX_IN_FLIGHT)
        self.fleet = fleet

    def queued(self, name: str) -> int:
        return self.fleet.waiting() if name == MODEL else 0


class Scaler:
    """An HPA driven by KEDA: the ceiling of a metric, up at once (at most doubling or +4 per
    decision), down after ``stabilise`` seconds, clamped to ``minimum``."""

    def __init__(self, metric: Callable[[float], float], minimum: int, maximum: int,
                 stabilise: float,
                 pick: Callable[[list[SimReplica], int], list[SimReplica]]) -> None:
        self.metric, self.minimum, self.maximum = metric, minimum, maximum
        self.stabilise, self.pick = stabilise, pick
        self.history: deque[tuple[float, int]] = deque()

    def decide(self, now: float, current: int) -> int:
        wanted = max(self.minimum, math.ceil(self.metric(now) - 1e-9))
        if current and abs(wanted / current - 1) <= 0.1:
            wanted = current  # HPA's tolerance
        self.history.append((now, wanted))
        while self.history[0][0] < now - self.stabilise:
            self.history.popleft()
        if wanted < current:
            wanted = max(w for _, w in self.history)
        return min(wanted, max(2 * current, current + 4), self.maximum)


def newest_first(replicas: list[SimReplica], surplus: int) -> list[SimReplica]:
    """A ReplicaSet's choice: pods not ready first, then the newest."""
    return sorted(replicas, key=lambda r: -r.asked_at)[:surplus]


def run(scaler_name: str, requests: list[Request], hour_seconds: float, trough: float,
        start_seconds: float) -> dict[str, float]:
    fleet = Fleet(ENGINE, start_seconds)
    placer = Placer(fleet)
    served = ServedModel(MODEL, [fleet.pool], None, 8192, 256,
                         objective=ObjectiveConfig(ttft_ms=TTFT_OBJECTIVE * 1000,
                                                   tpot_ms=TPOT_OBJECTIVE * 1000))
    clock = [0.0]
    autoscaler = Autoscaler(AutoscaleConfig(), {MODEL: served}, fleet.ledger, placer,  # type: ignore[arg-type]
                            clock=lambda: clock[0])

    def gateway_metric(now: float) -> float:
        return sum(s.desired for s in autoscaler.evaluate())

    def by_candidate(replicas: list[SimReplica], surplus: int) -> list[SimReplica]:
        starting = [r for r in replicas if r.ready_at > clock[0]]
        ready = {r.replica.name: r for r in replicas if r.ready_at <= clock[0]}
        chosen = starting[:surplus]
        keep = len(ready) - (surplus - len(chosen))
        return chosen + [ready[c.name] for c in scale_down_candidates(
            [r.replica for r in ready.values()], fleet.ledger, keep)]

    running_now = lambda: sum(r.running for r in fleet.replicas)  # noqa: E731
    static = math.ceil(3 * trough * _seconds_at(20) / (20 * 0.8))
    scalers = {
        "gateway": Scaler(gateway_metric, 0, 2 * static, 0.0, by_candidate),
        "queue": Scaler(lambda now: fleet.waiting() / 5, 1, 2 * static, 300.0, newest_first),
        "concurrency": Scaler(lambda now: (running_now() + fleet.waiting()) / 16, 1,
                              2 * static, 300.0, newest_first),
        "static": None}
    scaler = scalers[scaler_name]
    # Every fleet starts the day up, paid from before it: the static one at its size, the
    # others at what the trough needs (the same sizing).
    warm = static if scaler is None else math.ceil(trough * _seconds_at(20) / (20 * 0.8))
    for _ in range(warm):
        warmed = fleet.add(-start_seconds)
        fleet.pool.replicas.append(warmed.replica)
    end = 24 * hour_seconds
    events: list[tuple[float, int, int, object]] = []  # (time, kind, seq, payload)
    seq = 0

    def push(t: float, kind: int, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, kind, seq, payload))

    DONE, ARRIVE, READY, DECIDE, WAKE = 0, 1, 2, 3, 4
    for request in requests:
        push(request.arrival, ARRIVE, request)
    if scaler is not None:
        push(0.0, DECIDE, None)

    def place(now: float) -> None:
        """Serve the queue, best first, on the least-loaded replica with room."""
        while (queue := fleet.head()) is not None:
            up = [r for r in fleet.up(now) if r.running < MAX_IN_FLIGHT]
            request = queue[0]
            if now >= deadline(request, now):
                queue.popleft()
                request.refused = True
                continue
            if not up:
                return
            queue.popleft()
            replica = min(up, key=lambda r: r.running)
            x = features(fleet.ledger.load(replica.replica.name).copy(), request.prompt)
            ttft = ENGINE.ttft(replica.running, request.prompt)
            tpot = ENGINE.tpot(replica.running)
            request.ttft = now - request.arrival + ttft
            replica.running += 1
            lease = fleet.ledger.lease(replica.replica.name, request.prompt, request.output,
                                       streamed=False)
            push(now + ttft + (request.output - 1) * tpot, DONE,
                 (replica, request, lease, x, ttft, tpot, now))

    up_since = [0.0]  # when a replica last came up in a fleet with none up

    def deadline(request: Request, now: float) -> float:
        """Held while no replica is up (scale from zero); then queued for a slot, its queue
        time counted from when it could first be placed (as the gateway's placement does)."""
        if not fleet.up(now):
            return request.arrival + HOLD_TIMEOUT
        return max(request.arrival, up_since[0]) + QUEUE_TIMEOUT

    def enqueue(request: Request) -> None:
        (fleet.interactive if request.interactive else fleet.batch).append(request)

    def retire(now: float) -> None:
        for replica in fleet.replicas:
            if replica.draining and replica.running == 0 and replica.gone_at is None:
                replica.gone_at = now

    while events:
        now, kind, _, payload = heapq.heappop(events)
        if now > end and kind == DECIDE:
            continue
        clock[0] = now
        if kind == ARRIVE:
            request = payload  # type: ignore[assignment]
            autoscaler.arrived(MODEL, request.prompt)
            enqueue(request)
            # Its deadline, should nothing else happen before it (both queues are in arrival
            # order, so one wake per request is enough).
            push(now + QUEUE_TIMEOUT, WAKE, None)
            push(now + HOLD_TIMEOUT, WAKE, None)
        elif kind == DONE:
            replica, request, lease, x, ttft, tpot, sent = payload  # type: ignore[misc]
            replica.running -= 1
            lease.close()
            placer.latency.of(replica.replica).observe(x, ttft, tpot)
            autoscaler.demand.completed((MODEL, POOL, replica.replica.role), request.output,
                                        now - sent, now)
            retire(now)
        elif kind == READY:
            replica = payload  # type: ignore[assignment]
            if not any(r is not replica for r in fleet.up(now)):
                up_since[0] = now  # the first up: held requests may queue from now
                push(now + QUEUE_TIMEOUT, WAKE, None)
            if not replica.draining:
                fleet.pool.replicas.append(replica.replica)
        elif kind == DECIDE:
            assert scaler is not None
            asked = fleet.asked()
            wanted = scaler.decide(now, len(asked))
            for _ in range(wanted - len(asked)):
                added = fleet.add(now)
                push(added.ready_at, READY, added)
            if wanted < len(asked):
                for replica in scaler.pick(asked, len(asked) - wanted):
                    replica.draining = True
                    if replica.replica in fleet.pool.replicas:
                        fleet.pool.replicas.remove(replica.replica)
                retire(now)
            push(now + DECIDE_EVERY, DECIDE, None)
        place(now)
    gpu_seconds = sum((r.gone_at if r.gone_at is not None else end) - r.asked_at
                      for r in fleet.replicas)
    interactive = [r for r in requests if r.interactive]
    met = sum(1 for r in interactive if r.ttft is not None and r.ttft <= TTFT_OBJECTIVE)
    return {"gpu_seconds": gpu_seconds, "interactive_met": met / len(interactive),
            "refused": sum(r.refused for r in requests), "requests": len(requests),
            "served": sum(r.ttft is not None for r in requests),
            "replicas_asked": fleet.count, "replicas_left": len(fleet.asked()),
            "in_flight_left": sum(fleet.ledger.load(r.replica.name).in_flight
                                  for r in fleet.replicas)}


def _seconds_at(n: int) -> float:
    """A mean request's time on a replica running ``n``."""
    return ENGINE.ttft(n - 1, 1000) + 299 * ENGINE.tpot(n)


SCALERS = ("gateway", "queue", "concurrency", "static")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--hour-seconds", type=float, default=900.0)
    parser.add_argument("--trough", type=float, default=3.0, help="requests/s at the trough")
    parser.add_argument("--start-seconds", type=float, default=60.0)
    parser.add_argument("--scalers", nargs="+", default=list(SCALERS), choices=SCALERS)
    parser.add_argument("--out", help="write the figures as JSON")
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {s: [] for s in args.scalers}
    for seed in args.seeds:
        requests = arrivals(seed, args.hour_seconds, args.trough)
        for name in args.scalers:
            for r in requests:
                r.ttft, r.refused = None, False
            results[name].append(run(name, requests, args.hour_seconds, args.trough,
                                     args.start_seconds))
    print(f"{len(args.seeds)} seeds, {statistics.mean(r['requests'] for r in results[args.scalers[0]]):.0f} "
          f"requests each; mean ± 95% half-width")
    print(f"{'scaler':<12} {'GPU-hours':>16} {'interactive TTFT met':>22} {'refused':>14}")
    summary = {}
    for name, runs in results.items():
        gpu = mean_half_width([r["gpu_seconds"] / 3600 for r in runs])
        met = mean_half_width([100 * r["interactive_met"] for r in runs])
        refused = mean_half_width([r["refused"] for r in runs])
        summary[name] = {"gpu_hours": gpu, "interactive_met_percent": met, "refused": refused,
                         "runs": runs}
        print(f"{name:<12} {gpu[0]:>9.1f} ± {gpu[1]:<5.1f} {met[0]:>14.2f} ± {met[1]:<5.2f} "
              f"{refused[0]:>7.1f} ± {refused[1]:<5.1f}")
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"args": vars(args), "summary": summary}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
