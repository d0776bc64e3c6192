"""The scheduling benchmark's workloads in virtual time: our policies, no HTTP, no clock.

    python -m benchmarks.scheduling_virtual [--workloads W1 W2 W3 W4] [--rows ...]
        [--requests N] [--seeds 1 2 3] [--profiles P ...] [--direct-share 0.2]
        [--asked 1024 | 256,1024,4096] [--max-in-flight N] [--kv-binding 1.0] [--saturation]
        [--compare ROW] [--kv-event-delay S]

The same seeded schedules as ``benchmarks.scheduling`` and the same timing models of the
simulated replicas (``gateway.sim.engine.make_scheduler``: ours, or vLLM V1's), driven event
by event: each
arrival goes through the real policy object and ledger, each engine step's tokens release the
lease as the relay would. A row takes about a second and the same inputs give the same
figures, so weights can be compared over many seeds without the wall-clock benchmark's noise.

What it leaves out is what the wall-clock benchmark is for: the HTTP path, scrape timing,
gateway CPU, and the peer routers. Engine signals are scraped every ``signals_interval``
simulated seconds from the schedulers' own gauges.

Questions it can answer beyond the weights (docs/performance.md "Scheduling"): what reserving what clients
ask instead of what they get costs (``--asked``; ``@asked`` and ``@exact`` rows), and what
holding requests in the gateway does (late binding: ``--max-in-flight`` as the gateway's
per-replica limit; ``--kv-binding`` with the KV each replica holds for the gateway's
requests, counted in true tokens: an upper bound of what a gateway that knows capacities
could do).

Precise prefix routing (``policy@events`` rows, vLLM V1's timing model only): each engine
publishes its KV-cache events, which reach the replica's ``ReplicaBlocks`` ``--kv-event-delay``
simulated seconds after the step that made them; each request carries its token ids.

A p99 is the worst ~1% of one schedule, so two rows a few hundredths of a second apart may
differ by chance alone. ``--compare ROW`` puts a number on that: each row's mean p99 minus
ROW's, with a 95% interval from a paired block bootstrap (the same requests drawn for both
rows, in blocks of consecutive arrivals, since a request's TTFT depends on its neighbours').
An interval that holds 0 means the schedules cannot tell the two rows apart.
"""

from __future__ import annotations

import argparse
import heapq
from collections import deque
import random
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from gateway.balance.ledger import InProcessLedger, Lease
from gateway.balance.output_estimate import OutputEstimate
from gateway.balance.policy import RequestCost, make_policy
from gateway.balance.prefix_index import prompt_blocks
from gateway.bench.loadgen import Request
from benchmarks.stats import mean_half_width, p99_difference
from gateway.bench.report import percentile
from benchmarks.scheduling import (ABLATIONS, DEFAULT_PROFILE, MODEL, OUR_POLICIES,
                                      REPLICAS, TIMING_MODELS, WORKLOADS, Workload,
                                      _row_settings, schedule)
from gateway.config import SchedulingConfig
from gateway.fleet.engine_signals import EngineSignals
from gateway.fleet.replica import Replica
from gateway.kvcache.events import EventBatch
from gateway.kvcache.index import PromptKeys, ReplicaBlocks
from gateway.sim.engine import make_scheduler
from gateway.sim.scheduler import BatchScheduler, Sequence, block_hashes
from gateway.sim.vllm_v1 import V1Scheduler
from gateway.sim.metrics import make_meter
from gateway.sim.profiles import PROFILES
from gateway.dataplane.admission import ESTIMATED_BYTES_PER_TOKEN


@dataclass
class _Flight:
    """One request inside an engine, as the gateway sees it."""

    lease: Lease | None  # None: a direct client's, unseen by the gateway
    index: int  # its place in the schedule
    arrived: float  # when the client sent it (TTFT counts any wait in the gateway's queue)
    prompt: int  # true prompt tokens (the KV it holds, for --kv-binding)
    ask: int  # the client's max_tokens
    long: bool  # a long-prompt request (its TTFT p99 is reported apart)
    seen: int = 0  # output tokens already released


@dataclass
class _Engine:
    replica: Replica
    sched: BatchScheduler
    busy: bool = False


def _tokens(text: str) -> list[int]:
    """Token ids as the simulated replicas count them: the synthetic prompts are whole words,
    one token each (``workload.synthetic_prompt``); ids only need to be equal for equal words."""
    return [hash(word) for word in text.split(" ")[1:]]


EVENTS_PROFILE_KIND = "vllm-v1"  # the one timing model whose engines publish KV events
KV_EVENT_DELAY = 0.005  # simulated seconds from a step's end to its events reaching the index


def _events_scheduler(profile: Any, meter: Any) -> BatchScheduler:
    return V1Scheduler(profile, meter, prefix_cache=True, kv_events=True)


def _sequence(ids: list[int], max_new: int, finish: str, block_size: int) -> Sequence:
    return Sequence(len(ids), max_new, finish, block_hashes=block_hashes(ids, block_size),
                    prompt_ids=tuple(ids))


def _flags(row: str) -> tuple[str, set[str]]:
    """``policy[:weights][@flag...]`` -> the policy part and its flags: ``asked``/``exact``
    (what the ledger reserves), ``events`` (precise routing on the engines' KV events; prompts
    priced as without them), ``tokens`` (every prompt's tokens counted exactly)."""
    base, *flags = row.split("@")
    unknown = set(flags) - {"asked", "exact", "events", "tokens"}
    if unknown or {"asked", "exact"} <= set(flags):
        raise ValueError(f"row {row!r}: flags are @asked or @exact, @events, @tokens")
    return base, set(flags)


def check_events_profile(row: str, profile: str) -> None:
    """An ``@events`` row needs engines that publish KV events: the vLLM V1 timing model."""
    if "events" in _flags(row)[1] and PROFILES[profile].kind != EVENTS_PROFILE_KIND:
        v1 = [name for name, p in PROFILES.items() if p.kind == EVENTS_PROFILE_KIND]
        raise ValueError(f"row {row!r} routes on the engines' KV-cache events, which only the "
                         f"vLLM V1 timing model publishes: use --profiles {' '.join(v1)} "
                         f"(not {profile})")


def run_row(w: Workload, row: str, requests: list[Request], arrivals: list[float],
            direct_share: float = 0.0, asked: tuple[int, ...] = (),
            max_in_flight: int | None = None, kv_binding: float | None = None,
            kv_event_delay: float = KV_EVENT_DELAY) -> dict[str, Any]:
    """One row; ``direct_share`` of the requests (seeded) are sent by another client straight to
    the first replica, past the gateway and its ledger (their TTFTs are not reported).
    ``asked``: every client asks for one of these many output tokens (``max_tokens``; seeded,
    independent of the length) and the engine stops at the workload's length (EOS). The ledger
    reserves what the gateway does: the learned expectation (``OutputEstimate``); a row ending
    in ``@asked`` reserves the whole ask (``learn_output_lengths: false``), one ending in
    ``@exact`` the true length (the oracle). ``max_in_flight``: the gateway's per-replica limit
    (``backpressure.max_in_flight_per_replica``); past it requests wait in its FIFO queue and
    go to the first replica that frees a slot (late binding).

    A row with ``@events`` routes as the gateway does where engines publish KV-cache events:
    each engine (vLLM V1's model only) announces the blocks it caches and evicts, each step's
    events reach the replica's ``ReplicaBlocks`` ``kv_event_delay`` simulated seconds after
    the step ends, and each request carries its token ids (``RequestCost.prompt_keys``)."""
    name = row
    check_events_profile(row, w.profile)
    row, flags = _flags(row)
    reserve = "asked" if "asked" in flags else "exact" if "exact" in flags else ""
    events_on = "events" in flags
    # @tokens: every prompt counted exactly; elsewhere estimated from bytes. The gateway
    # prices a prompt the same with or without events (it keys on token ids, and scales what
    # is cached to the prompt's cost), so @events rows estimate as the default does.
    tokenized = "tokens" in flags
    outputs = OutputEstimate() if not reserve else None
    policy_name, overrides = _row_settings(row)
    pending = weights_pending(overrides)  # the index's, not a scheduling weight
    weights = SchedulingConfig(**overrides)
    policy = make_policy(policy_name, weights)
    if hasattr(policy, "rng"):
        policy.rng = random.Random(0)  # ties broken the same way every run
    now = 0.0
    if hasattr(policy, "clock"):
        policy.clock = lambda: now  # type: ignore[attr-defined]
    profile = PROFILES[w.profile]
    if w.kv_capacity_tokens and w.kv_capacity_tokens < profile.kv_capacity_tokens:
        profile = profile.with_overrides(kv_capacity_tokens=w.kv_capacity_tokens)
    ledger = InProcessLedger()
    engines = [_Engine(Replica(f"r{i}", f"http://r{i}", "vllm", "m", "default"),
                       _events_scheduler(profile, make_meter("vllm", 1 << 20)) if events_on
                       else make_scheduler(profile, make_meter("vllm", 1 << 20),
                                           prefix_cache=True))
               for i in range(REPLICAS)]
    replicas = [e.replica for e in engines]
    if events_on:
        for e in engines:
            e.replica.kv_cache = ReplicaBlocks(  # the engine's block count, as vLLM reports it
                pending_seconds=pending, clock=lambda: now,
                capacity=max(1, profile.kv_capacity_tokens // profile.block_size))
            e.replica.kv_cache.connected = True
    flights: dict[int, _Flight] = {}  # id(seq) -> the request on its way
    direct = random.Random(7)
    per_replica = [0] * REPLICAS
    ttft: list[float] = []
    ttft_long: list[float] = []
    ttft_by_request: list[float | None] = [None] * len(requests)  # None: a direct client's
    generated = 0
    events: list[tuple[float, int, int, Any]] = []  # (time, order, kind, payload)
    ARRIVE, STEP_END, SCRAPE, KV_EVENTS = 0, 1, 2, 3
    order = 0

    def push(at: float, kind: int, payload: Any) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (at, order, kind, payload))

    def start_step(i: int, at: float) -> None:
        e = engines[i]
        duration, emitting = e.sched.step(at)
        e.busy = bool(emitting or duration)
        if e.busy:
            push(at + duration, STEP_END, (i, emitting))
        if events_on:
            kv = e.sched.take_kv_events()
            if kv:  # published when the step ends, read after the delay
                push(at + duration + kv_event_delay, KV_EVENTS, (i, at + duration, tuple(kv)))

    for k, at in enumerate(arrivals):
        push(at, ARRIVE, k)
    if weights.signals_weight:
        push(weights.signals_interval, SCRAPE, None)
    finished = 0
    held: deque[int] = deque()  # requests waiting in the gateway for a free slot (FIFO)
    context = {r.name: 0 for r in replicas}  # tokens of KV the gateway's requests hold there

    def has_slot(r: Replica, prompt: int) -> bool:
        if max_in_flight is not None and ledger.load(r.name).in_flight >= max_in_flight:
            return False
        return (kv_binding is None or not context[r.name]
                or context[r.name] + prompt <= kv_binding * profile.kv_capacity_tokens)

    def dispatch(k: int, direct_client: bool = False) -> bool:
        """Send request ``k`` to a replica with a free slot; False: none has one. A direct
        client's request goes to the first replica, past the gateway (no lease, no queue)."""
        req = requests[k]
        text = req.prompt
        ids = _tokens(text)
        ask = max(random.Random(k).choice(asked), req.max_tokens) if asked else req.max_tokens
        counted = len(ids) if tokenized else -(-len(text.encode()) // ESTIMATED_BYTES_PER_TOKEN)
        cost = RequestCost(counted, ask,
                           prompt_blocks(text),
                           prompt_keys=PromptKeys(tuple(ids)) if events_on else None)
        expected = (req.max_tokens if reserve == "exact" else
                    outputs.expect(MODEL, ask) if outputs is not None else ask)
        if direct_client:
            i, lease = 0, None
        else:
            free = [r for r in replicas if has_slot(r, len(ids))]
            if not free:
                return False
            chosen = policy.select(free, cost, ledger)
            i = replicas.index(chosen)
            per_replica[i] += 1
            lease = ledger.lease(chosen.name, cost.prompt_tokens, expected, ask)
            context[chosen.name] += len(ids)
        seq = _sequence(ids, req.max_tokens, "length" if ask == req.max_tokens else "stop",
                        profile.block_size)
        flights[id(seq)] = _Flight(lease, k, arrivals[k], len(ids), ask, req.tag == "long")
        engines[i].sched.add(seq, now)
        if not engines[i].busy:
            start_step(i, now)
        return True

    while events and finished < len(requests):
        now, _, kind, payload = heapq.heappop(events)
        if kind == ARRIVE:
            if direct_share and direct.random() < direct_share:
                dispatch(payload, direct_client=True)
            elif held or not dispatch(payload):
                held.append(payload)
        elif kind == STEP_END:
            i, emitting = payload
            for s in emitting:
                flight = flights[id(s)]
                seen, flight.seen = flight.seen, s.generated
                if s.finished:
                    del flights[id(s)]
                    finished += 1
                lease = flight.lease
                if lease is None:
                    continue
                if seen == 0:
                    lease.first_token()
                    ttft.append(s.first_token_at - flight.arrived)
                    ttft_by_request[flight.index] = ttft[-1]
                    if flight.long:
                        ttft_long.append(s.first_token_at - flight.arrived)
                lease.generated(s.generated - seen)
                generated += s.generated - seen
                context[lease.replica] += s.generated - seen
                if s.finished:
                    context[lease.replica] -= s.generated + flight.prompt
                    lease.close()
                    if outputs is not None:
                        outputs.observe(MODEL, flight.ask, s.generated)
            while held and dispatch(held[0]):
                held.popleft()
            start_step(i, now)
        elif kind == KV_EVENTS:
            i, published, kv = payload
            engines[i].replica.kv_cache.apply(EventBatch(published, kv))  # type: ignore[union-attr]
        else:
            for e in engines:
                s = e.sched
                e.replica.signals = EngineSignals(
                    len(s.running), len(s.waiting), s.kv_used / profile.kv_capacity_tokens,
                    scraped_at=now, ledger_in_flight=ledger.load(e.replica.name).in_flight)
            push(now + weights.signals_interval, SCRAPE, None)
    meters = [e.sched.meter for e in engines]
    queries = sum(m.prefix_queries for m in meters)
    return {
        "row": name if events_on or tokenized else row,
        "completed_per_s": round(finished / (now - arrivals[0]), 2),
        "ttft_p50_s": _seconds(ttft, 50), "ttft_p90_s": _seconds(ttft, 90),
        "ttft_p99_s": _seconds(ttft, 99),
        "ttft_p99_long_s": _seconds(ttft_long, 99),
        "output_tokens_per_s": round(generated / (now - arrivals[0]), 1),
        "requests_per_replica": per_replica,
        "prefix_cache_hit_rate": round(sum(m.prefix_hits for m in meters) / queries, 3),
        "preemptions": sum(m.preemptions for m in meters),
        "kv_index": [_index_state(e.replica.kv_cache, now) for e in engines] if events_on else None,
        "ttft_by_request_s": ttft_by_request,
    }


def weights_pending(overrides: dict[str, float]) -> float:
    """The index's ``pending_seconds`` (``kv_events.pending_seconds``; a row may set it)."""
    from gateway.config import KvEventsConfig
    return overrides.pop("pending_seconds", KvEventsConfig().pending_seconds)


def _index_state(index: ReplicaBlocks | None, now: float) -> dict[str, Any]:
    assert index is not None
    return {"live": index.live(now), "blocks": index.size(), "orphans": index.orphans,
            "predicted_hit": round(index.predicted_tokens / index.queried_tokens, 3)
            if index.queried_tokens else None}


def _seconds(values: list[float], q: float) -> float | None:
    """A percentile as the wall-clock benchmark computes it (``report.percentile``)."""
    value = percentile(sorted(values), q)
    return None if value is None else round(value, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scheduling_virtual",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rows", nargs="+", default=[*OUR_POLICIES, *ABLATIONS],
                        help="policies, optionally `policy:key=value,...` with scheduling weights")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--asked", type=lambda v: tuple(map(int, v.split(","))), default=(),
                        help="clients ask for this many output tokens (max_tokens; a comma "
                             "list: each request one of them at random) and the engines stop "
                             "at the workload's lengths; default: they ask for exactly what "
                             "they get. The ledger reserves the learned expectation; a row "
                             "ending in @asked reserves the ask, @exact the true length")
    parser.add_argument("--direct-share", type=float, default=0.0,
                        help="share of the requests another client sends straight to the "
                             "first replica, unseen by the gateway's ledger (what engine "
                             "signals are for)")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="the gateway's per-replica in-flight limit (default: none); "
                             "past it requests wait in the gateway's queue")
    parser.add_argument("--kv-binding", type=float, default=None,
                        help="hold a request in the gateway while every replica's KV (the "
                             "prompts + tokens generated of what the gateway sent it) would "
                             "pass this share of its capacity; send it to the first with room")
    parser.add_argument("--kv-event-delay", type=float, default=KV_EVENT_DELAY,
                        help="@events rows: simulated seconds from an engine step's end to "
                             "its KV events reaching the gateway's index (default "
                             f"{KV_EVENT_DELAY})")
    parser.add_argument("--profiles", nargs="+", default=[DEFAULT_PROFILE],
                        choices=list(TIMING_MODELS), help="the replicas' timing models")
    parser.add_argument("--compare", metavar="ROW",
                        help="also print each row's mean p99 minus this row's, with a 95%% "
                             "paired block-bootstrap interval (ROW runs even if not in --rows)")
    parser.add_argument("--saturation", action="store_true",
                        help="print round robin's saturation per workload and profile (the "
                             "rates the schedules are built from) and exit")
    args = parser.parse_args(argv)
    for profile in args.profiles:
        for row in [*args.rows, *([args.compare] if args.compare else [])]:
            try:
                check_events_profile(row, profile)
            except ValueError as exc:
                parser.error(str(exc))
    if args.saturation:
        for profile in args.profiles:
            rates = {name: saturation(WORKLOADS[name].on(profile)) for name in args.workloads}
            print(profile, " ".join(f"{k} {v:.1f}" for k, v in rates.items()))
        return 0
    for profile in args.profiles:
        for name in args.workloads:
            w = WORKLOADS[name].on(profile)
            print(f"{name} {w.title} on {profile}: TTFT p99 s per seed (mean) | p50 (mean) | "
                  "tok/s | per replica (first seed)")
            schedules = [schedule(w, args.requests, seed) for seed in args.seeds]

            runs: dict[str, list[dict[str, Any]]] = {}

            def run(row: str) -> list[dict[str, Any]]:
                if row not in runs:
                    runs[row] = [run_row(w, row, reqs, arr, args.direct_share, args.asked,
                                         args.max_in_flight, args.kv_binding,
                                         args.kv_event_delay)
                                 for reqs, arr in schedules]
                return runs[row]

            baseline = run(args.compare) if args.compare else None
            for row in args.rows:
                results = run(row)
                p99 = [r["ttft_p99_s"] for r in results]
                print(f"  {row:<60} {' '.join(f'{v:6.2f}' for v in p99)}"
                      f"  ({statistics.mean(p99):.2f})"
                      f" | {statistics.mean(r['ttft_p50_s'] for r in results):.3f}"
                      f" | {statistics.mean(r['output_tokens_per_s'] for r in results):.0f}"
                      f" | {results[0]['requests_per_replica']}", flush=True)
                print(f"  {'':<60} {_summary(results)}", flush=True)
                if baseline is not None and row != args.compare:
                    diff, low, high = p99_difference(
                        [r["ttft_by_request_s"] for r in results],
                        [r["ttft_by_request_s"] for r in baseline])
                    print(f"  {'':<60} p99 minus {args.compare}'s: {diff:+.3f} s "
                          f"(95% interval {low:+.3f} .. {high:+.3f})", flush=True)
    return 0


def mean_interval(values: list[float]) -> str:
    """The mean over seeds with a 95% t interval (seeds are independent schedules)."""
    if len(values) < 2:
        return f"{statistics.mean(values):.3f}"
    m, half = mean_half_width(values)
    return f"{m:.3f} ({m - half:.3f}..{m + half:.3f})"


def _summary(results: list[dict[str, Any]]) -> str:
    """TTFT p50/p90/p99 and tok/s over the seeds with intervals, the engines' prefix-cache hit
    rate, and requests per replica summed over the seeds with the least one's share of fair."""
    per_replica = [sum(n) for n in zip(*(r["requests_per_replica"] for r in results))]
    fair = sum(per_replica) / len(per_replica)
    parts = [f"{k} {mean_interval([r[f'ttft_{k}_s'] for r in results])}"
             for k in ("p50", "p90", "p99")]
    return (" ".join(parts) + f" tok/s {mean_interval([r['output_tokens_per_s'] for r in results])}"
            f" hit {statistics.mean(r['prefix_cache_hit_rate'] for r in results):.3f}"
            f" per replica {per_replica} (min {min(per_replica) / fair:.0%} of fair)")


def saturation(w: Workload, requests: int = 2000) -> float:
    """Round robin's requests/s (simulated) with the whole mix arriving at once."""
    reqs, _ = schedule(w, requests, seed=0)
    return run_row(w, "round_robin", reqs, [1e-9] * len(reqs))["completed_per_s"]


if __name__ == "__main__":
    sys.exit(main())
