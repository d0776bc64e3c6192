"""The gateway's Prometheus metrics (prefix ``llm_gateway_``): the request path's, the
replicas', the keys' and shared state's. A package with metrics of its own keeps them beside
it on the same registry (``gateway/canary/metrics.py``, ``gateway/migrate/metrics.py``,
``gateway/dataplane/prefill_metrics.py``, ``gateway/access/metrics.py``).

Label values come only from configuration (model, pool, replica, engine), the API and fixed
sets (status class, reasons, error kinds, replica states), never from client input, so a
client cannot grow the series count. The hot path uses label children bound once.

Series whose labels all come from configuration and fixed lists (rejections by reason,
upstream errors and retries by kind, queue time) start at 0, so a healthy system's boards
show 0 rather than "No data": per model at start, per replica at the first scrape that sees
it (replicas added later, by the admin API or DNS discovery, included). Other label values
appear when they first happen.

Per-replica gauges (load, state and the engines' own scraped signals) are read from the
ledger and the fleet, not updated per request. One process: read at scrape time. Many worker
processes (``--workers N``): prometheus_client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``) sums counters and histograms over the workers' files; each
worker publishes its own share of each replica's load (``livesum``: summed over live
workers) and its view of the replica's state and of the engines' signals
(``livemostrecent``) every ``PUBLISH_INTERVAL`` seconds and at each scrape it serves.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.balance.ledger import LoadLedger
from gateway.fleet.replica import REPLICA_STATES, Replica
from gateway.protocol.errors import Api
from gateway.protocol.reasons import KEY_REFUSALS, REFUSALS, Reason
from gateway.protocol.usage import Usage
from gateway.upstream.failure import RETRY_KINDS, UPSTREAM_ERROR_KINDS, FailureKind

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PUBLISH_INTERVAL = 1.0  # seconds; how stale a per-replica gauge may be under --workers N

# Request latencies: 1 ms .. 10 min. Inter-token: 1 ms .. 5 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                   300.0, 600.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
TOKENS_PER_SECOND_BUCKETS = (1, 5, 10, 20, 30, 40, 50, 60, 75, 100, 150, 200, 300, 500, 1000,
                             2000, 5000, 10000)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.0025, 0.005, 0.01, 0.025,
                    0.05, 0.1, 0.25, 0.5, 1.0)

# role: "primary", or "shadow" for a canary's copy of a request (gateway/canary/shadow.py).
# model: the name the client asked for (an alias or a LoRA adapter included: only configured
# or engine-listed names, never free client input); base: the model entry of the replica it
# ran on (one engine serves many names); route: the gateway route it came in on (a fixed
# set: /v1/completions, /v1/embeddings, /generate ...).
REPLICA_LABELS = ("model", "pool", "replica", "engine", "api", "role", "base", "route")
STATUS_CLASSES = ("2xx", "4xx", "5xx")


def status_class(status: int) -> str:
    return f"{min(max(status // 100, 2), 5)}xx"


@dataclass(slots=True)
class ReplicaMeters:
    """The metric children of one (replica, api), bound once."""

    ttft: object
    itl: object
    e2e: object
    tokens_per_second: object
    overhead: object
    prompt_tokens: object
    generation_tokens: object
    requests: dict[str, object]


# --- per-replica gauges: (name, help, extra label, multiprocess mode) ---

@dataclass(frozen=True, slots=True)
class _GaugeSpec:
    name: str
    help: str
    multiprocess_mode: str
    extra_label: str | None = None


OUTSTANDING = _GaugeSpec("llm_gateway_replica_outstanding_tokens",
                         "Prompt tokens not yet prefilled + output tokens still expected, over "
                         "this gateway's in-flight requests on the replica.", "livesum")
IN_FLIGHT = _GaugeSpec("llm_gateway_replica_in_flight_requests",
                       "This gateway's requests in flight on the replica.", "livesum")
HEALTHY = _GaugeSpec("llm_gateway_replica_healthy",
                     "1 if the replica passes its health checks.", "livemostrecent")
ROLE = _GaugeSpec("llm_gateway_replica_role",
                  "1 for the replica's role in disaggregated serving (both, prefill, decode): "
                  "join on it to sum load by role.", "livemostrecent", extra_label="role")
STATE = _GaugeSpec("llm_gateway_replica_state",
                   "1 for the replica's current state (healthy, unhealthy, ejected, draining), "
                   "0 for the others.", "livemostrecent", extra_label="state")
WINDOW = _GaugeSpec("llm_gateway_replica_max_model_len",
                    "Context window of the replica (configured or discovered).", "livemax")
# The engine's own view (gateway/fleet/engine_signals.py), while its last scrape is fresh;
# it counts every client's requests, not only this gateway's.
ENGINE_RUNNING = _GaugeSpec("llm_gateway_engine_running_requests",
                            "Requests in the engine's running batch (its /metrics, last scrape).",
                            "livemostrecent")
ENGINE_WAITING = _GaugeSpec("llm_gateway_engine_waiting_requests",
                            "Requests queued inside the engine (its /metrics, last scrape).",
                            "livemostrecent")
ENGINE_KV_USAGE = _GaugeSpec("llm_gateway_engine_kv_cache_usage_ratio",
                             "Fraction of the engine's KV cache in use, 0-1 (its /metrics, last "
                             "scrape).", "livemostrecent")
REPLICA_GAUGES = (OUTSTANDING, IN_FLIGHT, HEALTHY, ROLE, STATE, WINDOW, ENGINE_RUNNING, ENGINE_WAITING,
                  ENGINE_KV_USAGE)
REPLICA_GAUGE_LABELS = ("model", "pool", "replica", "engine")

Sample = tuple[_GaugeSpec, tuple[str, ...], float]


def replica_samples(replicas: Iterable[Replica], ledger: LoadLedger,
                    signals_max_age: float = math.inf) -> Iterator[Sample]:
    """Every per-replica gauge value. Load is this process's own share (``own_load``): a
    shared ledger's ``load`` includes other gateways, which would be counted twice. Engine
    signals older than ``signals_max_age`` seconds (failing scrapes) are left out."""
    now = time.monotonic()
    for replica in replicas:
        labels = (replica.model, replica.pool, replica.name, replica.engine)
        load = ledger.own_load(replica.name)
        yield OUTSTANDING, labels, load.outstanding_tokens
        yield IN_FLIGHT, labels, load.in_flight
        yield HEALTHY, labels, 1.0 if replica.healthy else 0.0
        yield ROLE, (*labels, replica.role), 1.0
        current = replica.state
        for state in REPLICA_STATES:
            yield STATE, (*labels, state), 1.0 if state == current else 0.0
        if replica.max_model_len is not None:
            yield WINDOW, labels, replica.max_model_len
        signals = replica.signals
        if signals is not None and signals.fresh(now, signals_max_age):
            for spec, value in ((ENGINE_RUNNING, signals.running),
                                (ENGINE_WAITING, signals.waiting),
                                (ENGINE_KV_USAGE, signals.kv_usage)):
                if value is not None:  # e.g. llama.cpp reports no KV use
                    yield spec, labels, value


def multiprocess_mode() -> bool:
    """prometheus_client picks its value store at import from this variable."""
    return bool(os.environ.get(MULTIPROC_ENV))


def prepare_multiprocess_dir() -> Callable[[], None]:
    """Point worker processes at an empty multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``
    if set, else a new temporary one): files left by an earlier run would be summed in.
    Returns the cleanup to run when the workers are gone."""
    given = os.environ.get(MULTIPROC_ENV)
    path = Path(given or tempfile.mkdtemp(prefix="llm-gateway-metrics-"))
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    os.environ[MULTIPROC_ENV] = str(path)
    if given:
        return lambda: None
    return lambda: shutil.rmtree(path, ignore_errors=True)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.multiprocess = multiprocess_mode()
        r = self.registry
        self.ttft = Histogram("llm_gateway_time_to_first_token_seconds",
                              "Request arrival at the gateway to first token sent to the client.",
                              REPLICA_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("llm_gateway_inter_token_latency_seconds",
                             "Mean gap between output tokens of each streamed request.",
                             REPLICA_LABELS, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("llm_gateway_e2e_request_latency_seconds",
                             "Request arrival to the last byte sent to the client.",
                             REPLICA_LABELS, buckets=LATENCY_BUCKETS, registry=r)
        self.tokens_per_second = Histogram(
            "llm_gateway_request_output_tokens_per_second",
            "Generated tokens / decode time (first to last token) of each request.",
            REPLICA_LABELS, buckets=TOKENS_PER_SECOND_BUCKETS, registry=r)
        self.overhead = Histogram("llm_gateway_added_latency_seconds",
                                  "Time the gateway adds: request arrival to upstream request sent.",
                                  REPLICA_LABELS, buckets=OVERHEAD_BUCKETS, registry=r)
        self.queue_time = Histogram("llm_gateway_queue_time_seconds",
                                    "Time a request waited in the gateway's queue for a free "
                                    "replica slot.", ("model", "api"), buckets=LATENCY_BUCKETS,
                                    registry=r)
        self.prompt_tokens = Counter("llm_gateway_prompt_tokens",
                                     "Prompt tokens of served requests (engine usage).",
                                     REPLICA_LABELS, registry=r)
        self.generation_tokens = Counter("llm_gateway_generation_tokens",
                                         "Generated tokens sent to clients (engine usage, else "
                                         "streamed tokens counted).", REPLICA_LABELS, registry=r)
        self.requests = Counter("llm_gateway_requests",
                                "Requests forwarded to a replica, by final status class.",
                                (*REPLICA_LABELS, "status"), registry=r)
        self.rejections = Counter("llm_gateway_rejections",
                                  "Requests the gateway answered itself with an error, by reason.",
                                  ("model", "api", "reason"), registry=r)
        self.upstream_errors = Counter("llm_gateway_upstream_errors",
                                       "Failures talking to a replica, by kind.",
                                       ("model", "pool", "replica", "engine", "kind"), registry=r)
        self.retries = Counter("llm_gateway_retries",
                               "Requests sent again to another replica, by the failed replica "
                               "and the kind of failure.",
                               ("model", "pool", "replica", "engine", "kind"), registry=r)
        # Per API key: labelled by the key's name only (never its secret).
        self.key_requests = Counter("llm_gateway_key_requests",
                                    "Requests of an API key that were admitted and ended "
                                    "(served or not).", ("key", "model"), registry=r)
        self.key_prompt_tokens = Counter("llm_gateway_key_prompt_tokens",
                                         "Prompt tokens of an API key's served requests.",
                                         ("key", "model"), registry=r)
        self.key_generation_tokens = Counter("llm_gateway_key_generation_tokens",
                                             "Generated tokens of an API key's requests.",
                                             ("key", "model"), registry=r)
        self.key_rejections = Counter("llm_gateway_key_rejections",
                                      "An API key's requests the gateway refused, by reason "
                                      "(requests without a valid key: key=\"\", reason "
                                      "unauthorized).", ("key", "model", "reason"), registry=r)
        self.key_queue_time = Histogram("llm_gateway_key_queue_time_seconds",
                                        "Time an API key's requests waited in the gateway's "
                                        "queue for a free replica slot.", ("key", "model"),
                                        buckets=LATENCY_BUCKETS, registry=r)
        self._bound: dict[tuple[str, Api, str, str, str], ReplicaMeters] = {}
        self._queued: dict[tuple[str, Api], object] = {}
        self._replica_source: Callable[[], Iterable[Sample]] | None = None
        self._replica_snapshot: list[Sample] = []  # taken on the event loop for each scrape
        self._replicas: Callable[[], Iterable[Replica]] = lambda: ()
        self._zeroed: set[str] = set()  # replicas whose error/retry series exist
        self._gauges: dict[str, Gauge] = {}
        self._readers: list[Callable[[], None]] = []  # set gauges from the gateway's objects
        if self.multiprocess:
            self._exposed = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._exposed)
        else:
            self._exposed = self.registry

    def for_replica(self, replica: Replica, api: Api, role: str = "primary",
                    name: str = "", route: str = "") -> ReplicaMeters:
        """``name``: the model name the request asked for (default: the replica's base);
        ``route``: the route it came in on."""
        key = (replica.name, api, role, name, route)
        bound = self._bound.get(key)
        if bound is None:
            labels = (name or replica.model, replica.pool, replica.name, replica.engine,
                      api.value, role, replica.model, route)
            bound = self._bound[key] = ReplicaMeters(
                ttft=self.ttft.labels(*labels), itl=self.itl.labels(*labels),
                e2e=self.e2e.labels(*labels),
                tokens_per_second=self.tokens_per_second.labels(*labels),
                overhead=self.overhead.labels(*labels),
                prompt_tokens=self.prompt_tokens.labels(*labels),
                generation_tokens=self.generation_tokens.labels(*labels),
                requests={c: self.requests.labels(*labels, c) for c in STATUS_CLASSES})
        return bound

    def reject(self, model: str, api: Api, reason: Reason) -> None:
        self.rejections.labels(model, api.value, reason).inc()

    def upstream_error(self, replica: Replica, kind: FailureKind) -> None:
        self.upstream_errors.labels(replica.model, replica.pool, replica.name, replica.engine,
                                    kind.label).inc()

    def retry(self, replica: Replica, kind: FailureKind) -> None:
        """A request failed on ``replica`` (a ``retryable`` kind) and is sent again elsewhere."""
        self.retries.labels(replica.model, replica.pool, replica.name, replica.engine,
                            kind.retry_label).inc()

    def queued(self, model: str, api: Api, seconds: float) -> None:
        """A request waited ``seconds`` in the gateway's queue for a free replica slot."""
        child = self._queued.get((model, api))
        if child is None:
            child = self._queued[(model, api)] = self.queue_time.labels(model, api.value)
        child.observe(seconds)

    def key_done(self, key: str, model: str, usage: Usage | None) -> None:
        """An admitted request of API key ``key`` ended; ``usage``: None if it got no answer."""
        self.key_requests.labels(key, model).inc()
        if usage is not None:
            if usage.prompt_tokens:
                self.key_prompt_tokens.labels(key, model).inc(usage.prompt_tokens)
            if usage.completion_tokens:
                self.key_generation_tokens.labels(key, model).inc(usage.completion_tokens)

    def key_rejected(self, key: str, model: str, reason: Reason) -> None:
        self.key_rejections.labels(key, model, reason).inc()

    def key_queued(self, key: str, model: str, seconds: float) -> None:
        self.key_queue_time.labels(key, model).observe(seconds)

    def keys_at_zero(self, keys: Iterable[str], models: Iterable[str]) -> None:
        """Series of the configured keys that a healthy system may never increment."""
        models = list(models)
        for key in keys:
            for model in models:
                self.key_requests.labels(key, model)
                self.key_queue_time.labels(key, model)
                for reason in KEY_REFUSALS:
                    self.key_rejections.labels(key, model, reason)

    def start_at_zero(self, models: Iterable[str]) -> None:
        """Series of each configured model that a healthy system never increments."""
        for model in models:
            for api in Api:
                self._queued[(model, api)] = self.queue_time.labels(model, api.value)
                for reason in REFUSALS:
                    self.rejections.labels(model, api.value, reason)

    def _replica_series_at_zero(self) -> None:
        for replica in self._replicas():
            if replica.name in self._zeroed:
                continue
            self._zeroed.add(replica.name)
            labels = (replica.model, replica.pool, replica.name, replica.engine)
            for kind in UPSTREAM_ERROR_KINDS:
                self.upstream_errors.labels(*labels, kind)
            for kind in RETRY_KINDS:
                self.retries.labels(*labels, kind)

    def watch_replicas(self, replicas: Callable[[], Iterable[Replica]], ledger: LoadLedger,
                       signals_max_age: float = math.inf) -> None:
        """Export per-replica load, state and engine signals: read at scrape time (one
        process) or published to the workers' shared files (multiprocess mode)."""
        self._replicas = replicas
        self._replica_source = lambda: replica_samples(replicas(), ledger, signals_max_age)
        if self.multiprocess:
            self._gauges = {spec.name: Gauge(spec.name, spec.help,
                                             REPLICA_GAUGE_LABELS + ((spec.extra_label,)
                                                                     if spec.extra_label else ()),
                                             multiprocess_mode=spec.multiprocess_mode,
                                             registry=self.registry)
                            for spec in REPLICA_GAUGES}
        else:
            self.registry.register(_ReplicaGaugeCollector(lambda: self._replica_snapshot))

    def read_on_scrape(self, reader: Callable[[], None]) -> None:
        """``reader`` sets gauges from the gateway's own objects, on the event loop, before
        each scrape (and, with workers, each publication of this worker's values)."""
        self._readers.append(reader)

    def publish_replica_gauges(self) -> None:
        """Multiprocess mode: write this worker's per-replica values to its files."""
        for reader in self._readers:
            reader()
        if self._replica_source is None or not self._gauges:
            return
        self._replica_series_at_zero()
        for spec, labels, value in self._replica_source():
            self._gauges[spec.name].labels(*labels).set(value)

    async def publish_forever(self, interval: float = PUBLISH_INTERVAL) -> None:
        """Multiprocess mode: keep this worker's per-replica gauges fresh between scrapes."""
        while True:
            self.publish_replica_gauges()
            await asyncio.sleep(interval)

    def exposition(self) -> bytes:
        """The text of one scrape: this process's metrics, or all workers' in multiprocess mode."""
        self._read_gateway_state()
        return generate_latest(self._exposed)

    async def scrape(self) -> bytes:
        """``exposition()`` with the text rendered in a worker thread. prometheus-client
        takes 25-40 µs a line, and a fleet's /metrics has thousands (eight replicas that
        served five routes: 750 kB, 110 ms); on the event loop no stream would move
        meanwhile (benchmarks/loop_stall.py). What the gateway's own objects say is read
        first, on the loop; the metrics themselves are thread-safe (prometheus-client locks
        them)."""
        self._read_gateway_state()
        return await asyncio.to_thread(generate_latest, self._exposed)

    def _read_gateway_state(self) -> None:
        if self.multiprocess:
            self.publish_replica_gauges()
        else:
            for reader in self._readers:
                reader()
            self._replica_series_at_zero()
            if self._replica_source is not None:
                self._replica_snapshot = list(self._replica_source())

    def close(self) -> None:
        """Multiprocess mode: this worker is stopping; its live gauges leave the sums."""
        if self.multiprocess:
            multiprocess.mark_process_dead(os.getpid())


class _Null:
    """Stands in for a metric child when metrics are off."""

    __slots__ = ()

    def observe(self, value: float) -> None:
        pass

    def inc(self, amount: float = 1) -> None:
        pass


_NULL = _Null()


class NullMetrics:
    """Metrics off (``metrics: false``): every call of ``GatewayMetrics`` does nothing, and
    /metrics is empty; no registry, so nothing else registers metrics either."""

    registry = None
    multiprocess = False

    def __init__(self) -> None:
        self._null = ReplicaMeters(_NULL, _NULL, _NULL, _NULL, _NULL, _NULL, _NULL,
                                   {c: _NULL for c in STATUS_CLASSES})

    def for_replica(self, replica: Replica, api: Api, role: str = "primary",
                    name: str = "", route: str = "") -> ReplicaMeters:
        return self._null

    def exposition(self) -> bytes:
        return b""

    async def scrape(self) -> bytes:
        return b""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return _nothing


def _nothing(*args: object, **kwargs: object) -> None:
    pass


def make_metrics(enabled: bool = True) -> GatewayMetrics:
    return GatewayMetrics() if enabled else NullMetrics()  # type: ignore[return-value]


class _ReplicaGaugeCollector(Collector):
    """One process: per-replica gauges computed at scrape time (nothing on the request path)."""

    def __init__(self, samples: Callable[[], Iterable[Sample]]) -> None:
        self.samples = samples

    def collect(self) -> Iterable[Metric]:
        families = {spec.name: GaugeMetricFamily(
            spec.name, spec.help,
            labels=[*REPLICA_GAUGE_LABELS, *((spec.extra_label,) if spec.extra_label else ())])
            for spec in REPLICA_GAUGES}
        for spec, labels, value in self.samples():
            families[spec.name].add_metric(list(labels), value)
        return list(families.values())


class SharedStateMetrics:
    """The state shared through Redis (``redis_url`` set): is it in sync, and what this
    instance's balancer sees. Set by the sync task once per round, never per request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge("llm_gateway_shared_state_up",
                        "1 while this instance syncs load and replica state with Redis; 0 while "
                        "it balances on its own load only (fail-open).",
                        multiprocess_mode="livemin", registry=registry)
        self.sync_failures = Counter("llm_gateway_shared_state_sync_failures",
                                     "Sync rounds with Redis that failed or timed out.",
                                     registry=registry)
        self.peers = Gauge("llm_gateway_shared_state_peers",
                           "Other live gateway instances whose load this instance counts.",
                           multiprocess_mode="livemax", registry=registry)
        self.view_outstanding = Gauge(
            "llm_gateway_shared_view_outstanding_tokens",
            "Fleet-wide outstanding tokens of the replica as this instance's balancer sees them "
            "(own exact + peers' last sync). A view: do not sum over instances.", ("replica",),
            multiprocess_mode="livemostrecent", registry=registry)
        self.view_in_flight = Gauge(
            "llm_gateway_shared_view_in_flight_requests",
            "Fleet-wide in-flight requests of the replica as this instance's balancer sees them.",
            ("replica",), multiprocess_mode="livemostrecent", registry=registry)
