"""Disaggregated prefill/decode against an aggregated fleet of as many GPUs, in virtual time.

    python -m benchmarks.disaggregation [--workloads long-prompt long-output] [--rows ...]
        [--replicas 4] [--requests N] [--seeds 1 2 3 4 5] [--loads 0.8 ...] [--warmup S]
        [--transfer-ms-per-block 0.084] [--compare ROW] [--saturation] [--out F.json]

The question: at equal GPU count, does splitting the fleet into prefill and decode replicas
(``role: prefill`` / ``decode``) beat every replica doing both, on TTFT p99 and on ITL p99,
and for which workload and split? Rows are ``FLEET:POLICY``: ``4xboth`` (aggregated) or
``1P+3D`` (1 prefill, 3 decode replicas), and a balancing policy; by default the aggregated
fleet under least_outstanding_tokens and least_expected_work, and every P/D split under
least_expected_work (the default policy), and ``4xboth@2048``: the aggregated fleet whose
engines run with ``max_num_batched_tokens`` 2,048 instead of the profile's 8,192, the
aggregated fleet's own way to shorten the steps a long prompt's chunk stretches.

Every replica is vLLM V1's timing model (``gateway.sim.vllm_v1``, profile
``llama3-8b-h100-vllm-v1``: chunked prefill sharing one 8,192-token budget with decodes,
KV in blocks, preemption by recompute). Each arrival goes through the real policy object and
the real ledger as ``gateway.dataplane.placement`` places it:

- aggregated: the policy picks among the ``both`` replicas; the lease reserves the prompt and
  the expected output, releases the prompt at the first token and each output token as it
  streams, and closes at the end (as ``benchmarks.scheduling_virtual``);
- P/D: the policy first picks the decode replica (``role != "prefill"``), whose lease
  reserves the whole cost; then, for it, a prefill replica on ``prefill_cost(cost)`` (the
  prompt and 1 output token; a lease of (prompt, 1)). The prefill engine runs the prompt
  with ``max_tokens`` 1; when it answers, its lease closes and the decode lease releases its
  prompt part (``lease.first_token()``), as ``gateway.dataplane.prefill`` does. The KV then
  crosses to the decode replica, after which the decode engine gets the request with the
  prompt's KV loaded (``Sequence.external_tokens``): it computes only the last prompt token
  and streams every token the client sees. TTFT is the decode engine's first token.

KV transfer: ``--transfer-ms-per-block`` per 16-token block, default 0.084 ms. Llama-3-8B
holds 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token, so 2 MiB
(2.1 MB) per block; over a ~25 GB/s link (a 200 Gb/s RDMA NIC, NIXL's usual path between
nodes) that is 0.084 ms, or 42 ms for an 8k-token prompt. Each replica has one link; a
transfer holds the sending prefill's and the receiving decode's links for its duration,
first come first served (the one prefill of 1P+3D sends every prompt's KV).

Workloads (no shared prefixes: every prompt is its own), Poisson arrivals at ``--loads``
times the aggregated fleet's saturation (least_outstanding_tokens on ``N`` ``both`` replicas
with the whole mix arriving at once: ``--saturation`` measures it):

- **long-prompt**: 2,000-8,000 prompt tokens, 20-100 output tokens (RAG, summarization);
- **long-output**: 100-500 prompt tokens, 300-1,000 output tokens (chat, generation).

Measured from ``--warmup`` simulated seconds (default 20: longer than a long-output request
lives at these loads, so the fleet has filled up) to the last arrival (the drain after it is
left out). Reported per row, each a mean over seeds with its 95% t interval (seeds are
independent schedules), and the paired difference from the ``--compare`` row (default the
aggregated fleet under least_expected_work: same schedule per seed, a t interval over the
seeds' differences; an interval that holds 0 cannot tell the rows apart): TTFT p50 and p99 of
the requests arriving in the window; ITL p99, the 99th percentile of every gap between two
consecutive tokens of one request ending in the window, all requests pooled (what vLLM's
``vllm:inter_token_latency_seconds`` histogram holds); TPOT p99, the 99th percentile of each
request's mean gap; output tokens/s in the window (the offered rate, printed above each table,
unless a fleet falls behind: then its TTFTs grow with the schedule's length, and mean only
"overloaded").

What it leaves out: the HTTP path and the gateway's CPU; the gateway's in-flight limit and
queue (``backpressure``, default 1,024 per replica: never reached at these loads unless a
fleet is overloaded); the prefill engine keeping a prompt's blocks until the decode engine has
read them (freed at its answer here: prefill engines' KV is never the bottleneck at these
loads), and the decode engine allocating its blocks before the transfer (here after it, at
admission: a decode engine short of KV would start the transfer later in vLLM); link
sharing other than first come first served; transfer overlapping prefill (layer by layer);
the prefill fallback to the decode engine (a prefill pool that fails or is missing); shared
prefixes. Speeds are the profile's (fitted shape on a CPU vLLM, scaled to an H100): ratios
between rows mean more than absolute seconds.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from benchmarks.stats import mean_half_width, top_percentile
from gateway.balance.ledger import InProcessLedger, Lease
from gateway.balance.output_estimate import OutputEstimate
from gateway.balance.policy import RequestCost, make_policy
from gateway.bench.report import percentile
from gateway.config import SchedulingConfig
from gateway.dataplane.placement import prefill_cost
from gateway.fleet.engine_signals import EngineSignals
from gateway.fleet.replica import Replica
from gateway.sim.engine import make_scheduler
from gateway.sim.metrics import make_meter
from gateway.sim.profiles import PROFILES, Profile
from gateway.sim.scheduler import BatchScheduler, Sequence

MODEL = "m"
PROFILE = "llama3-8b-h100-vllm-v1"
REPLICAS = 4
# 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes x 16 tokens over 25 GB/s, in ms
TRANSFER_MS_PER_BLOCK = round(2 * 32 * 8 * 128 * 2 * 16 / 25e9 * 1e3, 3)
POLICIES = ("least_outstanding_tokens", "least_expected_work")
WARMUP = 20.0  # simulated seconds before the measured window
DEFAULT_POLICY = "least_expected_work"


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    prompt: tuple[int, int]  # uniform, inclusive
    output: tuple[int, int]
    # Requests/s the aggregated fleet of REPLICAS replicas completes with the whole mix
    # arriving at once (least_outstanding_tokens; `--saturation` measures it).
    saturation: float


WORKLOADS = {
    "long-prompt": Workload("long-prompt", "prompts 2k-8k, outputs 20-100", (2000, 8000),
                            (20, 100), 19.7),
    "long-output": Workload("long-output", "prompts 100-500, outputs 300-1000", (100, 500),
                            (300, 1000), 29.1),
}


@dataclass(frozen=True)
class Fleet:
    """``prefill`` prefill-only and ``decode`` decode replicas; none prefill-only: ``decode``
    replicas that do both (the aggregated fleet). ``budget``: the engines'
    ``max_num_batched_tokens`` when not the profile's (a smaller one cuts prompts into
    smaller chunks: shorter steps beside the decodes, at some cost in TTFT and throughput)."""

    prefill: int
    decode: int
    budget: int | None = None

    @classmethod
    def parse(cls, name: str) -> "Fleet":
        fleet, _, budget = name.partition("@")
        tokens = int(budget) if budget.isdigit() and int(budget) > 0 else None
        if budget and tokens is None:
            raise ValueError(f"fleet {name!r}: @N is a token budget per step (a positive int)")
        if m := re.fullmatch(r"(\d+)xboth", fleet):
            return cls(0, int(m[1]), tokens)
        if m := re.fullmatch(r"(\d+)P\+(\d+)D", fleet):
            return cls(int(m[1]), int(m[2]), tokens)
        raise ValueError(f"fleet {name!r}: N replicas doing both as `4xboth`, P/D as `1P+3D`, "
                         f"optionally @N, the engines' token budget per step (`4xboth@2048`)")

    @property
    def name(self) -> str:
        base = f"{self.decode}xboth" if not self.prefill else f"{self.prefill}P+{self.decode}D"
        return base if self.budget is None else f"{base}@{self.budget}"

    def roles(self) -> list[str]:
        if not self.prefill:
            return ["both"] * self.decode
        return ["prefill"] * self.prefill + ["decode"] * self.decode


def parse_row(row: str) -> tuple[Fleet, str]:
    """``FLEET[:POLICY]`` -> the fleet and the policy (default least_expected_work)."""
    fleet, _, policy = row.partition(":")
    return Fleet.parse(fleet), policy or DEFAULT_POLICY


SMALL_BUDGET = 2048  # the aggregated fleet with shorter steps (vLLM's knob for ITL)


def default_rows(replicas: int) -> list[str]:
    return ([f"{replicas}xboth:{p}" for p in POLICIES]
            + [f"{replicas}xboth@{SMALL_BUDGET}:{DEFAULT_POLICY}"]
            + [f"{k}P+{replicas - k}D:{DEFAULT_POLICY}" for k in range(1, replicas)])


@dataclass(frozen=True, slots=True)
class Request:
    prompt: int
    output: int


def schedule(w: Workload, n: int, seed: int, rate: float) -> tuple[list[Request], list[float]]:
    """``n`` seeded requests of the workload, Poisson at ``rate`` requests/s (None: all at 0)."""
    rng = random.Random(f"{w.name}-{seed}")
    requests, arrivals, t = [], [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate) if rate else 0.0
        arrivals.append(t)
        requests.append(Request(rng.randint(*w.prompt), rng.randint(*w.output)))
    return requests, arrivals


@dataclass(slots=True)
class _Flight:
    """One client request, from its arrival to its last token."""

    index: int
    arrived: float
    req: Request
    lease: Lease  # on the replica that answers
    engine: int  # that replica's engine
    prefill_lease: Lease | None = None  # on the prefill replica, while it prefills
    prefill_engine: int | None = None
    prefilled_at: float = 0.0  # when the prefill answered
    seen: int = 0
    first: float = 0.0
    last: float = 0.0


@dataclass
class _Engine:
    replica: Replica
    sched: BatchScheduler
    busy: bool = False
    requests: int = 0  # placed here (prefills on a prefill replica)
    link_free: float = 0.0  # when its KV link is next free


@dataclass
class _Totals:
    ttft: list[float | None] = field(default_factory=list)  # by request, arrival order
    gaps: list[float] = field(default_factory=list)  # every inter-token gap
    tpot: list[float] = field(default_factory=list)  # each request's mean gap
    transfer: list[float] = field(default_factory=list)  # prefill answer -> KV loaded
    generated: int = 0
    finished: int = 0


ARRIVE, STEP_END, KV_LOADED, SCRAPE = range(4)


def run_row(w: Workload, row: str, requests: list[Request], arrivals: list[float],
            transfer_ms_per_block: float = TRANSFER_MS_PER_BLOCK,
            profile: Profile = PROFILES[PROFILE], warmup: float = 0.0) -> dict[str, Any]:
    """One row on one schedule, to the last token of the last request. Measured from
    ``warmup`` simulated seconds to the last arrival (the fleet filling up and draining are
    left out): TTFT and TPOT of the requests that arrive then, the token gaps and output
    tokens that end then."""
    fleet, policy_name = parse_row(row)
    if fleet.budget is not None:
        profile = profile.with_overrides(max_batched_tokens=fleet.budget)
    weights = SchedulingConfig()
    policy = make_policy(policy_name, weights)
    if hasattr(policy, "rng"):
        policy.rng = random.Random(0)  # ties broken the same way every run
    now = 0.0
    if hasattr(policy, "clock"):
        policy.clock = lambda: now  # type: ignore[attr-defined]
    ledger = InProcessLedger()
    outputs = OutputEstimate()
    engines = [_Engine(Replica(f"{role}{i}", f"http://r{i}", "vllm", MODEL, "default", role=role),
                       make_scheduler(profile, make_meter("vllm", 1 << 20), prefix_cache=True))
               for i, role in enumerate(fleet.roles())]
    at = {id(e.replica): i for i, e in enumerate(engines)}
    answering = [e.replica for e in engines if e.replica.role != "prefill"]
    prefilling = [e.replica for e in engines if e.replica.role == "prefill"]
    flights: dict[int, _Flight] = {}  # id(seq) -> its request
    totals = _Totals(ttft=[None] * len(requests))
    start, end = warmup, arrivals[-1]  # the measured window
    if end <= start and warmup:
        raise ValueError(f"the schedule's arrivals end at {end:.1f} s, within the warm-up")
    events: list[tuple[float, int, int, Any]] = []
    order = 0

    def push(t: float, kind: int, payload: Any) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (t, order, kind, payload))

    def start_step(i: int, t: float) -> None:
        e = engines[i]
        duration, emitting = e.sched.step(t)
        e.busy = bool(emitting or duration)
        if e.busy:
            push(t + duration, STEP_END, (i, emitting))

    def submit(i: int, seq: Sequence, flight: _Flight) -> None:
        flights[id(seq)] = flight
        engines[i].sched.add(seq, now)
        if not engines[i].busy:
            start_step(i, now)

    def arrive(k: int) -> None:
        """Placement as ``Placer._reserve`` does it: the answering replica, then (a decode
        one) its prefill replica on the prompt alone."""
        req = requests[k]
        cost = RequestCost(req.prompt, req.output)  # clients ask for what they get
        chosen = policy.select(answering, cost, ledger)
        lease = ledger.lease(chosen.name, cost.prompt_tokens,
                             outputs.expect(MODEL, cost.output_tokens), cost.output_tokens)
        i = at[id(chosen)]
        engines[i].requests += 1
        flight = _Flight(k, arrivals[k], req, lease, i)
        if chosen.role != "decode":
            submit(i, Sequence(req.prompt, req.output), flight)
            return
        pcost = prefill_cost(cost)
        prefill = policy.select(prefilling, pcost, ledger)
        flight.prefill_lease = ledger.lease(prefill.name, pcost.prompt_tokens,
                                            pcost.output_tokens, pcost.output_tokens)
        flight.prefill_engine = p = at[id(prefill)]
        engines[p].requests += 1
        submit(p, Sequence(req.prompt, 1), flight)

    def prefilled(flight: _Flight) -> None:
        """The prefill answered: its lease closes, the decode lease's prompt part is done,
        and the KV crosses both replicas' links."""
        assert flight.prefill_lease is not None and flight.prefill_engine is not None
        flight.prefill_lease.close()
        flight.lease.first_token()
        flight.prefilled_at = now
        sender, receiver = engines[flight.prefill_engine], engines[flight.engine]
        blocks = -(-flight.req.prompt // profile.block_size)
        start = max(now, sender.link_free, receiver.link_free)
        sender.link_free = receiver.link_free = done = start + blocks * transfer_ms_per_block / 1e3
        push(done, KV_LOADED, flight)

    def streamed(s: Sequence, flight: _Flight) -> None:
        """A token reached the client: the lease releases it, as the relay does."""
        seen, flight.seen = flight.seen, s.generated
        measured = start <= flight.arrived <= end
        if seen == 0:
            flight.lease.first_token()
            flight.first = now
            if measured:
                totals.ttft[flight.index] = now - flight.arrived
        elif start <= now <= end:
            totals.gaps.append(now - flight.last)
        flight.last = now
        flight.lease.generated(s.generated - seen)
        if start <= now <= end:
            totals.generated += s.generated - seen
        if s.finished:
            flight.lease.close()
            outputs.observe(MODEL, flight.req.output, s.generated)
            totals.finished += 1
            if s.generated > 1 and measured:
                totals.tpot.append((now - flight.first) / (s.generated - 1))

    for k, t in enumerate(arrivals):
        push(t, ARRIVE, k)
    if weights.signals_weight:
        push(weights.signals_interval, SCRAPE, None)
    while events and totals.finished < len(requests):
        now, _, kind, payload = heapq.heappop(events)
        if kind == ARRIVE:
            arrive(payload)
        elif kind == STEP_END:
            i, emitting = payload
            prefill_engine = engines[i].replica.role == "prefill"
            for s in emitting:
                flight = flights[id(s)] if not s.finished else flights.pop(id(s))
                if prefill_engine:
                    prefilled(flight)
                else:
                    streamed(s, flight)
            start_step(i, now)
        elif kind == KV_LOADED:
            flight = payload
            totals.transfer.append(now - flight.prefilled_at)
            submit(flight.engine, Sequence(flight.req.prompt, flight.req.output,
                                           external_tokens=flight.req.prompt), flight)
        else:
            for e in engines:
                s = e.sched
                e.replica.signals = EngineSignals(
                    len(s.running), len(s.waiting), s.kv_used / profile.kv_capacity_tokens,
                    scraped_at=now, ledger_in_flight=ledger.load(e.replica.name).in_flight)
            push(now + weights.signals_interval, SCRAPE, None)
    left = {name: (load.outstanding_tokens, load.in_flight, load.prefill_tokens)
            for name, load in ledger.snapshot().items() if any(
                (load.outstanding_tokens, load.in_flight, load.prefill_tokens))}
    return {
        "row": f"{fleet.name}:{policy_name}",
        "requests": len(requests),
        "completed": totals.finished,
        "ttft_p50_s": _percentile([t for t in totals.ttft if t is not None], 50),
        "ttft_p99_s": _percentile([t for t in totals.ttft if t is not None], 99),
        "itl_p50_ms": _ms(_percentile(totals.gaps, 50)),
        "itl_p99_ms": _ms(_percentile(totals.gaps, 99)),
        "tpot_p99_ms": _ms(_percentile(totals.tpot, 99)),
        "measured": sum(t is not None for t in totals.ttft),
        "completed_per_s": totals.finished / (now - arrivals[0]),
        "output_tokens_per_s": totals.generated / (end - start) if end > start else None,
        "transfer_mean_ms": (1e3 * sum(totals.transfer) / len(totals.transfer)
                             if totals.transfer else None),
        "replicas": [{"name": e.replica.name, "role": e.replica.role, "requests": e.requests,
                      "prefill_tokens": e.sched.meter.prefill_tokens,
                      "generated": e.sched.meter.generation_tokens,
                      "preemptions": e.sched.meter.preemptions} for e in engines],
        "ledger_left": left,  # empty: every lease released all it reserved
        "ttft_by_request_s": totals.ttft,
    }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if q >= 90:
        return top_percentile(values, q)
    return percentile(sorted(values), q)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def saturation(w: Workload, replicas: int = REPLICAS, requests: int = 2000) -> float:
    """Requests/s of the aggregated fleet (least_outstanding_tokens) with the whole mix at
    once: the rate the loads are shares of."""
    reqs, arrivals = schedule(w, requests, seed=0, rate=0.0)
    return run_row(w, f"{replicas}xboth:least_outstanding_tokens", reqs,
                   arrivals)["completed_per_s"]


# ---------------------------------------------------------------------------------------------
# Reporting

METRICS = (("ttft_p50_s", "TTFT p50 s", 3), ("ttft_p99_s", "TTFT p99 s", 3),
           ("itl_p99_ms", "ITL p99 ms", 1), ("tpot_p99_ms", "TPOT p99 ms", 1),
           ("output_tokens_per_s", "output tok/s", 0))


def _cell(values: list[float], base: list[float] | None, digits: int) -> str:
    m, half = mean_half_width(values)
    text = f"{m:.{digits}f} ±{half:.{digits}f}"
    if base is not None:
        d, dhalf = mean_half_width([a - b for a, b in zip(values, base, strict=True)])
        text += f" (Δ {d:+.{digits}f} ±{dhalf:.{digits}f})"
    return text


def markdown(runs: dict[str, list[dict[str, Any]]], compare: str | None) -> list[str]:
    """One table: each row's mean over seeds ±95%, and its paired difference from ``compare``."""
    lines = ["| row | " + " | ".join(title for _, title, _ in METRICS) + " |",
             "|---|" + "---:|" * len(METRICS)]
    base = runs.get(compare) if compare else None
    for row, results in runs.items():
        cells = []
        for key, _, digits in METRICS:
            values = [r[key] for r in results]
            paired = [r[key] for r in base] if base is not None and row != compare else None
            cells.append(_cell(values, paired, digits))
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return lines


def notes(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per row, summed over the seeds: requests and context tokens computed per replica."""
    out = []
    for row, results in runs.items():
        parts = []
        for k, replica in enumerate(results[0]["replicas"]):
            requests = sum(r["replicas"][k]["requests"] for r in results)
            computed = sum(r["replicas"][k]["prefill_tokens"] for r in results)
            preempted = sum(r["replicas"][k]["preemptions"] for r in results)
            parts.append(f"{replica['name']} {requests} req, {computed / max(1, requests):.0f} "
                         f"context tok/req" + (f", {preempted} preempted" if preempted else ""))
        transfer = [r["transfer_mean_ms"] for r in results if r["transfer_mean_ms"] is not None]
        tail = f"; KV transfer {sum(transfer) / len(transfer):.1f} ms mean" if transfer else ""
        out.append(f"- {row}: " + "; ".join(parts) + tail)
    return out


def _canonical(row: str) -> str:
    fleet, policy = parse_row(row)
    return f"{fleet.name}:{policy}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.disaggregation",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS),
                        choices=list(WORKLOADS))
    parser.add_argument("--replicas", type=int, default=REPLICAS,
                        help="GPUs in every fleet (default rows: Nxboth and every kP+(N-k)D)")
    parser.add_argument("--rows", nargs="+", default=None,
                        help="FLEET[@BUDGET][:POLICY], FLEET as 4xboth or 1P+3D, BUDGET the "
                             "engines' max_num_batched_tokens (default: the aggregated fleet "
                             f"under both token policies and @{SMALL_BUDGET}, every P/D split "
                             f"under {DEFAULT_POLICY})")
    parser.add_argument("--requests", type=int, default=1500, help="per schedule")
    parser.add_argument("--warmup", type=float, default=WARMUP,
                        help="simulated seconds left out at the start, while the fleet fills "
                             f"up (default {WARMUP:g}: longer than a long-output request "
                             "lives at these loads)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--loads", type=float, nargs="+", default=[0.8],
                        help="arrival rates as shares of the aggregated fleet's saturation")
    parser.add_argument("--transfer-ms-per-block", type=float, default=TRANSFER_MS_PER_BLOCK,
                        help="KV transfer time per 16-token block (default: 2 MiB of "
                             "Llama-3-8B KV over 25 GB/s)")
    parser.add_argument("--compare", metavar="ROW", default=None,
                        help=f"paired differences against this row (default "
                             f"Nxboth:{DEFAULT_POLICY}; `none`: no differences)")
    parser.add_argument("--saturation", action="store_true",
                        help="measure each workload's saturation rate (the aggregated fleet, "
                             "least_outstanding_tokens, the whole mix at once) and exit")
    parser.add_argument("--out", help="write every figure as JSON here")
    args = parser.parse_args(argv)
    if args.saturation:
        for name in args.workloads:
            print(f"{name}: {saturation(WORKLOADS[name], args.replicas):.1f} requests/s "
                  f"({args.replicas} replicas)")
        return 0
    rows = args.rows or default_rows(args.replicas)
    compare = (None if args.compare == "none" else
               args.compare or f"{args.replicas}xboth:{DEFAULT_POLICY}")
    try:
        for row in [*rows, *([compare] if compare else [])]:
            fleet, policy = parse_row(row)
            if fleet.prefill + fleet.decode != args.replicas:
                raise ValueError(f"row {row!r} has {fleet.prefill + fleet.decode} replicas, "
                                 f"not {args.replicas}")
            make_policy(policy, SchedulingConfig())
    except (ValueError, KeyError) as exc:
        parser.error(str(exc))
    rows = [_canonical(row) for row in rows]  # one name per row: `1P+3D` is 1P+3D:<default>
    compare = _canonical(compare) if compare else None
    if compare and compare not in rows:
        rows = [compare, *rows]
    scale = args.replicas / REPLICAS  # saturation grows with the fleet
    print(f"{PROFILE}, {args.replicas} replicas, {args.requests} requests x seeds "
          f"{' '.join(map(str, args.seeds))}, measured from {args.warmup:g} s to the last "
          f"arrival, KV transfer {args.transfer_ms_per_block} ms per block; mean ±95% t "
          f"interval over seeds (Δ: paired difference from {compare})")
    report: list[dict[str, Any]] = []
    for name in args.workloads:
        w = WORKLOADS[name]
        for load in args.loads:
            rate = load * w.saturation * scale
            schedules = [schedule(w, args.requests, seed, rate) for seed in args.seeds]
            if min(arr[-1] for _, arr in schedules) <= args.warmup:
                parser.error(f"{name} at {rate:.1f} requests/s: {args.requests} requests "
                             f"arrive within the {args.warmup:g} s warm-up; ask for more")
            runs = {row: [run_row(w, row, reqs, arr, args.transfer_ms_per_block,
                                  warmup=args.warmup)
                          for reqs, arr in schedules] for row in rows}
            offered = rate * sum(w.output) / 2
            print(f"\n### {name} ({w.title}), {load:.0%} of saturation: {rate:.1f} requests/s, "
                  f"{offered:.0f} output tokens/s offered\n")
            print("\n".join(markdown(runs, compare)))
            print()
            print("\n".join(notes(runs)), flush=True)
            for row, results in runs.items():
                report.append({"workload": name, "load": load, "rate": rate, "row": row,
                               "seeds": args.seeds,
                               "runs": [{k: v for k, v in r.items() if k != "ttft_by_request_s"}
                                        for r in results]})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"profile": PROFILE, "replicas": args.replicas, "requests": args.requests,
                       "warmup": args.warmup,
                       "transfer_ms_per_block": args.transfer_ms_per_block, "rows": report},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
