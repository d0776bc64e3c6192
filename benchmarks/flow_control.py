"""Goodput under mixed traffic, in virtual time: priorities, saturation-aware flow control and
latency objectives, against today's gateway and two peer routers' rules.

    python -m benchmarks.flow_control [--loads 0.5 1 1.5 2] [--seeds 1 2 3 4 5]
        [--requests 1500] [--rows ROW ...] [--signals-interval 1.0] [--json FILE]

Four simulated GPUs on vLLM V1's timing model (``gateway.sim.vllm_v1``, the
``llama3-8b-h100-vllm-v1`` profile) take a mix of three kinds of traffic (``KINDS``):
interactive chat at priority 1 with a 500 ms TTFT objective, batch at priority 0, and
evaluation traffic at -1 (sheddable). Arrivals are Poisson at a share of the fleet's
saturation (its requests/s with the whole mix arriving at once, sent to the replica with the
fewest requests), from half to twice it. Each arrival goes through the real parts: the policy object and ledger, and in the flow
rows the ``Placer``'s own slot check (saturation from scraped engine signals, kept current by
the ledger) and objective filter, the fair queue's bands, the online latency model. Nothing
times out: what waits at the gateway waits until served.

Rows:
- ``today``: least_expected_work, every request sent at once (flow control off);
- ``priority``: flow control on, bands and shedding, no latency objectives;
- ``priority+objectives``: the same, and interactive requests carry ``x-slo-ttft-ms: 500``;
- ``power_of_two (vllm-router's rule)`` and ``shortest_queue (sglang-router's balance
  rule)``: the peers' routing rules as written in their sources (two random replicas, the
  one with fewer requests in flight; the fewest requests in flight), sending at once, with no
  priority. These are models of the rules, not the peer binaries: the binaries cannot run in
  virtual time (``benchmarks.scheduling`` runs them on the wall clock).

Figures per load, mean over seeds with a 95% t interval: interactive goodput (interactive
requests whose TTFT met 500 ms, per second of arrivals), interactive TTFT p50 and p99, the
share of batch requests completed, the share of all requests shed; for the objectives row,
the latency model's TTFT error (|predicted - measured| / measured, median and p90). Then, per
load, each row's goodput against today's (a ratio per seed) and the objectives row's against
each peer's (a difference per seed; an interval that holds 0 cannot tell them apart).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from dataclasses import dataclass
from typing import Any

from benchmarks.stats import mean_half_width
from gateway.balance.fair_queue import FairQueue, Ticket
from gateway.balance.ledger import InProcessLedger, Lease
from gateway.balance.policy import RequestCost, make_policy
from gateway.bench.report import percentile
from gateway.config import BackpressureConfig, FlowControlConfig, SchedulingConfig
from gateway.dataplane.placement import Placer
from gateway.fleet.engine_signals import EngineSignals
from gateway.fleet.replica import Replica
from gateway.flow.latency_model import Prediction
from gateway.flow.objective import Objective
from gateway.sim.engine import make_scheduler
from gateway.sim.metrics import make_meter
from gateway.sim.profiles import PROFILES
from gateway.sim.scheduler import BatchScheduler, Sequence

PROFILE = "llama3-8b-h100-vllm-v1"
REPLICAS = 4
TTFT_OBJECTIVE_MS = 500.0


@dataclass(frozen=True)
class Kind:
    share: float
    priority: int
    prompt: tuple[int, int]  # tokens, uniform
    output: tuple[int, int]


KINDS = {
    "interactive": Kind(0.4, 1, (100, 1000), (50, 300)),
    "batch": Kind(0.3, 0, (1000, 4000), (100, 500)),
    "eval": Kind(0.3, -1, (500, 3000), (1, 100)),
}
FLOW_ROWS = ("priority", "priority+objectives")
PEER_ROWS = ("power_of_two (vllm-router's rule)", "shortest_queue (sglang-router's balance rule)")
ROWS = ("today", *FLOW_ROWS, *PEER_ROWS)


@dataclass
class _Request:
    kind: str
    prompt: int
    output: int


@dataclass
class _Flight:
    request: int
    lease: Lease
    replica: Replica
    placed: float
    prediction: Prediction | None
    seen: int = 0
    first: float | None = None


class _Waiter:
    """The fair queue's waiter, in virtual time: being woken puts its ticket on a list."""

    def __init__(self, ticket: Ticket, woken: list[Ticket]) -> None:
        self.ticket, self.woken, self._done = ticket, woken, False

    def done(self) -> bool:
        return self._done

    def set_result(self, _: None) -> None:
        self._done = True
        self.woken.append(self.ticket)


def workload(n: int, rate: float, seed: int) -> tuple[list[_Request], list[float]]:
    rng = random.Random(seed)
    kinds, weights = list(KINDS), [k.share for k in KINDS.values()]
    requests, arrivals, at = [], [], 0.0
    for _ in range(n):
        kind = rng.choices(kinds, weights)[0]
        spec = KINDS[kind]
        requests.append(_Request(kind, rng.randint(*spec.prompt), rng.randint(*spec.output)))
        at += rng.expovariate(rate)
        arrivals.append(at)
    return requests, arrivals


def run_row(row: str, requests: list[_Request], arrivals: list[float],
            signals_interval: float = 1.0, **thresholds: Any) -> dict[str, Any]:
    profile = PROFILES[PROFILE]
    now = 0.0
    ledger = InProcessLedger()
    weights = SchedulingConfig(signals_interval=signals_interval)
    policy = make_policy("least_expected_work", weights)
    policy.rng = random.Random(0)  # type: ignore[attr-defined]
    policy.clock = lambda: now  # type: ignore[attr-defined]
    replicas = [Replica(f"r{i}", f"http://r{i}", "vllm", "m", "default") for i in range(REPLICAS)]
    engines: list[BatchScheduler] = [make_scheduler(profile, make_meter("vllm", 1 << 20))
                                     for _ in replicas]
    busy = [False] * REPLICAS
    flow = row in FLOW_ROWS
    timed = row == "priority+objectives"
    placer = Placer(policy, ledger, BackpressureConfig(max_in_flight_per_replica=1 << 20),
                    signals_max_age=3 * signals_interval,
                    flow=FlowControlConfig(saturation=flow, predict=timed, **thresholds),
                    clock=lambda: now)
    queue = FairQueue(True, placer.flow.ageing_seconds, clock=lambda: now)
    woken: list[Ticket] = []
    waiting: dict[int, int] = {}  # id(ticket) -> request
    peer_rng = random.Random(1)
    flights: dict[int, _Flight] = {}
    ttft: list[float | None] = [None] * len(requests)
    shed = completed = held = engine_queue = 0
    done_by_kind = {k: 0 for k in KINDS}
    shed_by_kind = {k: 0 for k in KINDS}
    errors: list[float] = []
    events: list[tuple[float, int, int, Any]] = []
    ARRIVE, STEP_END, SCRAPE = 0, 1, 2
    order = 0

    def push(at: float, kind: int, payload: Any) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (at, order, kind, payload))

    def start_step(i: int) -> None:
        duration, emitting = engines[i].step(now)
        busy[i] = bool(emitting or duration)
        if busy[i]:
            push(now + duration, STEP_END, (i, emitting))

    def objective(k: int) -> Objective:
        spec = KINDS[requests[k].kind]
        ttft_ms = TTFT_OBJECTIVE_MS if timed and requests[k].kind == "interactive" else None
        return Objective(spec.priority if flow else 0, ttft_ms)

    def send(k: int, replica: Replica, prediction: Prediction | None = None) -> None:
        req = requests[k]
        i = replicas.index(replica)
        lease = ledger.lease(replica.name, req.prompt, req.output)
        seq = Sequence(req.prompt, req.output)
        flights[id(seq)] = _Flight(k, lease, replica, now, prediction)
        engines[i].add(seq, now)
        if not busy[i]:
            start_step(i)

    def place(k: int) -> bool:
        """The Placer's choice for request ``k`` now; False: no replica has a free slot."""
        free = [r for r in replicas if placer.has_slot(r)]
        if not free:
            return False
        goal = objective(k)
        cost = RequestCost(requests[k].prompt, requests[k].output)
        if goal.timed and placer.latency is not None:
            free = placer.meeting(free, cost.prompt_tokens, goal, now - arrivals[k])
        chosen = policy.select(free, cost, ledger)
        prediction = None if placer.latency is None else placer.latency.of(chosen).predict(
            ledger.load(chosen.name), cost.prompt_tokens)
        send(k, chosen, prediction)
        return True

    def arrive(k: int) -> None:
        nonlocal shed, held
        if row == "today":
            send(k, policy.select(replicas, RequestCost(requests[k].prompt,
                                                        requests[k].output), ledger))
        elif row in PEER_ROWS:
            pool = peer_rng.sample(replicas, 2) if row.startswith("power") else replicas
            send(k, min(pool, key=lambda r: ledger.load(r.name).in_flight))
        else:
            goal = objective(k)
            if not queue.outranked(goal.priority) and place(k):
                return
            if goal.sheddable:
                shed += 1
                shed_by_kind[requests[k].kind] += 1
                return
            held += 1
            ticket = queue.enter(None, 1.0, requests[k].prompt + requests[k].output,
                                 goal.priority)
            queue.park(ticket, _Waiter(ticket, woken))
            waiting[id(ticket)] = k

    def drain() -> None:
        """Slots may have freed: the queue's first waiters go, while a replica has room."""
        while waiting and any(placer.has_slot(r) for r in replicas):
            if not queue.wake_one():
                break
            ticket = woken.pop()
            queue.leave(ticket)
            place(waiting.pop(id(ticket)))

    def learn(flight: _Flight, seq: Sequence) -> None:
        """What the gateway's listener does when a stream completes (gateway.flow.metrics)."""
        if placer.latency is None or flight.prediction is None or flight.first is None:
            return
        measured = flight.first - flight.placed
        tpot = (now - flight.first) / (seq.generated - 1) if seq.generated > 1 else None
        if flight.prediction.ttft is not None and measured > 0:
            errors.append(abs(flight.prediction.ttft - measured) / measured)
        placer.latency.of(flight.replica).observe(flight.prediction.features, measured, tpot)

    for k, at in enumerate(arrivals):
        push(at, ARRIVE, k)
    push(signals_interval, SCRAPE, None)
    while events and completed + shed < len(requests):
        now, _, kind, payload = heapq.heappop(events)
        if kind == ARRIVE:
            arrive(payload)
        elif kind == STEP_END:
            i, emitting = payload
            for s in emitting:
                flight = flights[id(s)]
                seen, flight.seen = flight.seen, s.generated
                if seen == 0:
                    flight.lease.first_token()
                    flight.first = s.first_token_at
                    ttft[flight.request] = s.first_token_at - arrivals[flight.request]
                flight.lease.generated(s.generated - seen)
                if s.finished:
                    del flights[id(s)]
                    flight.lease.close()
                    completed += 1
                    done_by_kind[requests[flight.request].kind] += 1
                    learn(flight, s)
            drain()
            start_step(i)
        else:
            engine_queue = max(engine_queue, *(len(sched.waiting) for sched in engines))
            for r, sched in zip(replicas, engines):
                r.signals = EngineSignals(len(sched.running), len(sched.waiting),
                                          sched.kv_used / profile.kv_capacity_tokens,
                                          scraped_at=now,
                                          ledger_in_flight=ledger.load(r.name).in_flight)
            drain()
            push(now + signals_interval, SCRAPE, None)

    span = arrivals[-1] - arrivals[0]
    interactive = [t for k, t in enumerate(ttft)
                   if t is not None and requests[k].kind == "interactive"]
    met = sum(1 for t in interactive if t * 1000 <= TTFT_OBJECTIVE_MS)
    batch_total = sum(1 for r in requests if r.kind == "batch")
    return {
        "row": row, "goodput": met / span, "completed": completed, "finished_at": now,
        "shed_by_kind": shed_by_kind, "held": held, "engine_queue_max": engine_queue,
        "ledger_left": {r.name: ledger.load(r.name) for r in replicas
                        if ledger.load(r.name).in_flight or ledger.load(r.name).outstanding_tokens},
        "ttft_p50": percentile(sorted(interactive), 50),
        "ttft_p99": percentile(sorted(interactive), 99),
        "batch_completed": done_by_kind["batch"] / batch_total,
        "shed": shed / len(requests),
        "error_p50": percentile(sorted(errors), 50) if errors else None,
        "error_p90": percentile(sorted(errors), 90) if errors else None,
    }


def saturation(seed: int = 0, n: int = 2000) -> float:
    """The fleet's requests/s with the whole mix arriving at once (its capacity)."""
    requests, _ = workload(n, 1.0, seed)
    result = run_row("shortest_queue (sglang-router's balance rule)", requests,
                     [1e-9 * (k + 1) for k in range(n)])
    return result["completed"] / result["finished_at"]


FIGURES = (("goodput", "interactive goodput /s", 2), ("ttft_p50", "TTFT p50 s", 3),
           ("ttft_p99", "TTFT p99 s", 2), ("batch_completed", "batch done", 3),
           ("shed", "shed", 3))


def cell(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    mean, half = mean_half_width(values)
    return f"{mean:.{digits}f} ±{half:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", nargs="+", type=float, default=[0.5, 1.0, 1.5, 2.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--signals-interval", type=float, default=1.0)
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="flow_control settings of the flow rows, e.g. max_waiting=5")
    args = parser.parse_args(argv)
    settings = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    capacity = saturation()
    print(f"# {REPLICAS} x {PROFILE}; saturation {capacity:.1f} requests/s; "
          f"{args.requests} requests x seeds {args.seeds}; scrape every "
          f"{args.signals_interval:g} s; mean ±95% t interval over seeds")
    runs: list[dict[str, Any]] = []
    for load in args.loads:
        print(f"\n## load {load:g}x saturation ({load * capacity:.1f} requests/s)\n")
        print("| row | " + " | ".join(title for _, title, _ in FIGURES)
              + " | TTFT error p50 / p90 |")
        print("|---|" + "---:|" * (len(FIGURES) + 1))
        by_row: dict[str, list[dict[str, Any]]] = {}
        for row in args.rows:
            for seed in args.seeds:
                requests, arrivals = workload(args.requests, load * capacity, seed)
                result = run_row(row, requests, arrivals, args.signals_interval, **settings)
                result.update(load=load, seed=seed)
                by_row.setdefault(row, []).append(result)
                runs.append(result)
            results = by_row[row]
            cells = [cell([r[f] for r in results if r[f] is not None], d) for f, _, d in FIGURES]
            errors = [r for r in results if r["error_p50"] is not None]
            error = (f"{cell([r['error_p50'] for r in errors], 2)} / "
                     f"{cell([r['error_p90'] for r in errors], 2)}") if errors else "-"
            print(f"| {row} | " + " | ".join(cells) + f" | {error} |")
        if "today" in by_row:
            print()
            for row in by_row:
                if row == "today":
                    continue
                ratios = [r["goodput"] / max(t["goodput"], 1e-9)
                          for r, t in zip(by_row[row], by_row["today"])]
                print(f"- {row}: goodput {cell(ratios, 2)} x today's (paired by seed)")
        best = "priority+objectives"
        for peer in (r for r in PEER_ROWS if r in by_row and best in by_row):
            gains = [b["goodput"] - p["goodput"] for b, p in zip(by_row[best], by_row[peer])]
            print(f"- {best} - {peer}: goodput {cell(gains, 2)} /s (paired by seed)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(runs, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
