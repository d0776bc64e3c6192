"""create_app(settings) -> the ASGI app; its lifespan starts and stops everything the gateway runs."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import threading
from types import FrameType
from typing import Any, AsyncIterator, Callable

import aiohttp
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from gateway import observe
from gateway.access.control import AccessControl
from gateway.api import (admin, admin_keys, openai_models, ops, stored_responses, tgi_info,
                         unknown_route)
from gateway.api.admin_view import AdminView
from gateway.api.generation import GenerationEndpoint
from gateway.api.intake import Admitted
from gateway.balance.ledger import InProcessLedger, LoadLedger
from gateway.autoscale.autoscaler import Autoscaler
from gateway.autoscale.hold import ScaleFromZero
from gateway.autoscale.metrics import AutoscaleMetrics
from gateway.balance.output_estimate import OutputEstimate
from gateway.balance.policy import make_policy
from gateway.canary.agreement import Agreement
from gateway.canary.fleet_samples import FleetSamples
from gateway.canary.guard import CanaryGuard
from gateway.canary.sample_source import SampleSource
from gateway.canary.samples import SampleBook
from gateway.canary.shadow import NotSent, Shadows
from gateway.balance.pool_split import PoolSplit
from gateway.canary.weights import PoolWeights
from gateway.config import Settings, load_settings
from gateway.dataplane import listeners
from gateway.dataplane.admission import Admitter, Prepared
from gateway.dataplane.attempts import Attempts
from gateway.dataplane.outcome import Outcomes, RequestRecord
from gateway.dataplane.placement import PlacementRequest, Placer
from gateway.dataplane.prefill import Prefiller
from gateway.dataplane.prefill_metrics import PrefillMetrics
from gateway.flow.metrics import ObjectiveMetrics
from gateway.dataplane.relay import Relay
from gateway.dataplane.reply import Reply
from gateway.fleet.response_homes import ResponseHomes
from gateway.dataplane.retry_budget import RetryBudget
from gateway.fleet.discovery import discover_window
from gateway.fleet.dns_discovery import DnsDiscovery
from gateway.fleet.engine_signals import SignalScraper
from gateway.kvcache.feeds import KvEventFeeds
from gateway.kvcache.metrics import KvEventMetrics
from gateway.fleet.health import HealthChecker
from gateway.fleet.membership import Fleet
from gateway.fleet.model import build_models
from gateway.fleet.outlier import OutlierDetector
from gateway.fleet.adapter_loader import AdapterLoader
from gateway.fleet.replica import Replica
from gateway.fleet.served_names import NameRefresher
from gateway.canary.metrics import CanaryMetrics
from gateway.metrics import make_metrics
from gateway.migrate.metrics import MigrationMetrics
from gateway.migrate.migrator import Migrator
from gateway.protocol import openai as openai_protocol
from gateway.protocol import anthropic, pooling, responses
from gateway.protocol import tgi as tgi_protocol
from gateway.protocol.errors import Api, GatewayError
from gateway.protocol.request import Context, GenerationRequest
from gateway.shared.redis_keys import SharedKeys
from gateway.shared.sync import SharedStateSync
from gateway.token_cache_metrics import TokenCacheMetrics
from gateway.upstream import UpstreamPool

log = logging.getLogger("gateway")

CONFIG_ENV = "LLM_GATEWAY_CONFIG"  # config file path handed to uvicorn worker processes


class Gateway:
    """Everything one gateway process holds, wired: fleet, ledger, admission, placement, the
    retry loop and relay, the listeners of their outcomes, canaries, keys, metrics."""

    def __init__(self, settings: Settings, ledger: LoadLedger | None = None) -> None:
        self.settings = settings
        self.fleet = Fleet(build_models(settings))
        self.models, self.replicas = self.fleet.models, self.fleet.replicas
        # redis_url: balance on the fleet-wide load, synced in the background (gateway/shared).
        self.shared = (SharedStateSync.from_settings(settings, self.replicas)
                       if settings.redis_url and ledger is None else None)
        self.ledger = ledger or (self.shared.ledger if self.shared else InProcessLedger())
        split = PoolSplit(settings.canary.allow_pool_header)
        scheduling = settings.scheduling
        outputs = OutputEstimate() if scheduling.learn_output_lengths else None
        # LoRA adapters loaded at run time (load_adapters), on the least-loaded replica.
        self.adapters = AdapterLoader(lambda: self.probe_session,
                                      lambda name: self.ledger.load(name).outstanding_tokens,
                                      settings.timeouts.first_token)
        # Where stored Responses live (shared through Redis with redis_url).
        self.response_homes = ResponseHomes(
            settings.responses.remembered, settings.responses.ttl,
            self.shared.redis if self.shared else None, SharedKeys(settings.redis_key_prefix),
            settings.redis_timeout)
        self.admitter = Admitter(self.models, settings.default_model, split, self.adapters,
                                 self.response_homes)
        self.placer = Placer(make_policy(settings.balancer, scheduling), self.ledger,
                             settings.backpressure, split=split, outputs=outputs,
                             signals_max_age=scheduling.signals_interval
                             * scheduling.signals_max_age, flow=settings.flow_control)
        self.metrics = make_metrics(settings.metrics)
        # What the autoscaler should do (desired replicas), and scale from zero.
        self.objectives = settings.objectives  # named: x-llm-d-inference-objective
        self.scale_from_zero = ScaleFromZero(settings.autoscale.scale_from_zero)
        self.autoscaler = Autoscaler(
            settings.autoscale, self.models, self.ledger, self.placer, self.scale_from_zero.held,
            lambda: 1 + (len(self.shared.ledger.peers) if self.shared is not None else 0))
        self.metrics.read_on_scrape(AutoscaleMetrics(self.metrics.registry, self.autoscaler,
                                                     self.scale_from_zero.held_by_model).read)
        self.metrics.read_on_scrape(TokenCacheMetrics(self.metrics.registry, self.models).read)
        # Canary: runtime pool weights (admin API, guard), shared through Redis when set.
        self.canary_metrics = CanaryMetrics(self.metrics.registry)
        self.weights = PoolWeights(self.models, on_change=self.canary_metrics.weight)
        canary = settings.canary
        self.samples = SampleBook(canary.judge.samples_per_pool)  # for the canary verdict
        # redis_url: the verdict judges the fleet's samples, sent in the background.
        self.fleet_samples = (FleetSamples(self.shared.redis,
                                           SharedKeys(settings.redis_key_prefix),
                                           canary.judge.fleet_samples_per_pool,
                                           canary.samples_sync_interval, settings.redis_timeout,
                                           self.shared.name)
                              if self.shared is not None else None)
        self.canary_samples = SampleSource(self.samples, self.fleet_samples)
        self.guard = CanaryGuard(self.models, self.canary_samples, self.weights,
                                 self.canary_metrics, canary.judge, canary.check_every,
                                 canary.auto_rollback)
        self.agreement = Agreement(self.canary_metrics, canary.agreement_max_chars,
                                   canary.disagreements_kept, self.samples,
                                   canary.judge.agreement.prefix_chars)
        self.shadows = Shadows(self._serve_copy, self.models, self.canary_metrics,
                               self.agreement, canary.max_shadow_in_flight)
        self.metrics.watch_replicas(lambda: self.replicas, self.ledger,
                                    scheduling.signals_interval * scheduling.signals_max_age)
        self.metrics.start_at_zero(self.models)
        # API keys and limits (off without `auth`; shared through Redis with redis_url).
        self.access = AccessControl.from_settings(settings)
        self.metrics.keys_at_zero([k.name for k in self.access.keys.all()], self.models)
        self.outlier = OutlierDetector(settings.outlier, lambda r: self.models[r.model].replicas)
        self.fleet.on_leave += [self.outlier.forget,
                                lambda replica: self.placer.policy.forget(replica.name)]
        # Who hears how each attempt and each client request went (gateway.dataplane.outcome):
        # and, when configured, tracing and the access log (gateway.observe).
        self.observers = observe.listeners(settings)
        self.outcomes = Outcomes([listeners.RequestMetrics(self.metrics),
                                  listeners.OutlierRecord(self.outlier),
                                  listeners.CanarySamples(self.samples),
                                  listeners.OutputLengths(),
                                  listeners.ResponseHomesRecord(self.response_homes),
                                  PrefillMetrics(self.metrics),
                                  ObjectiveMetrics(self.metrics, self.placer.latency,
                                                   self.placer.queued_by_priority),
                                  MigrationMetrics(self.metrics, self.models),
                                  self.autoscaler,
                                  *self.observers])
        self.retry_budget = RetryBudget(settings.retries.budget_ratio,
                                        settings.retries.min_retries_per_second)
        self.kv_feeds: KvEventFeeds | None = None  # kv_events: subscribed at start
        self.draining = False
        self.active_requests = 0  # generation requests inside the gateway now
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        # The data path's own HTTP/1.1 client (gateway/upstream): streams are relayed from
        # its read callbacks. (aiohttp's per-read coroutine switches and buffering were about
        # a third of the gateway's CPU per relayed event.)
        self.upstream = UpstreamPool(self.settings.upstream_keepalive,
                                     self.settings.max_connections_per_replica)
        # Probes, discovery and scrapes use their own connections: a replica whose data-plane
        # pool is full must still answer its health check. A few requests a second per
        # replica need no keep-alive.
        self.probe_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True))
        self.relay = Relay(self.upstream, self.settings.timeouts, self.outcomes)
        # A stream that breaks after its first token goes on on another replica (migrate/).
        self.relay.migrator = Migrator(self.settings.migration, self.placer, self.relay.send,
                                       self.upstream, self.settings.timeouts, self.outcomes,
                                       self.retry_budget)
        prefiller = Prefiller(self.placer, self.upstream, self.settings.timeouts, self.outcomes,
                              self.retry_budget, self.settings.retries.max_attempts)
        self.attempts = Attempts(self.placer, self.relay, self.retry_budget,
                                 self.settings.retries.max_attempts, self.outcomes, self.shadows,
                                 prefiller)
        self.health = HealthChecker(self.replicas, self.probe_session, self.settings.health)
        self.fleet.probe = self._probe_new
        await asyncio.gather(*(discover_window(self.probe_session, r, self.settings.health.timeout)
                               for r in self.replicas))
        await self.health.probe_all()
        self._tasks.append(asyncio.create_task(self.health.run(), name="health-checks"))
        # The names each engine serves (aliases, adapters loaded at run time), read again.
        self.names = NameRefresher(lambda: self.replicas, self.probe_session,
                                   self.settings.health.names_interval,
                                   self.settings.health.timeout)
        self._tasks.append(asyncio.create_task(self.names.run(), name="served-names"))
        # `dns:` replica entries: one replica per resolved address, kept up to date.
        self.dns = DnsDiscovery.from_settings(self.settings, self.fleet,
                                              lambda name: self.ledger.own_load(name).in_flight)
        if self.dns is not None:
            await self.dns.refresh()
            self._tasks.append(asyncio.create_task(self.dns.run(), name="dns-discovery"))
        scheduling = self.settings.scheduling
        self.signals = SignalScraper(lambda: self.replicas, self.probe_session,
                                     lambda name: self.ledger.load(name).in_flight,
                                     scheduling.signals_interval, scheduling.signals_timeout)
        self._tasks.append(asyncio.create_task(self.signals.run(), name="engine-signals"))
        # kv_events: what each vLLM engine holds, from its KV-cache events (gateway/kvcache).
        if self.settings.kv_events.enabled:
            self.kv_feeds = KvEventFeeds(lambda: self.replicas, self.settings.kv_events,
                                         KvEventMetrics(self.metrics.registry)
                                         if self.settings.metrics else None)
            self.kv_feeds.reconcile()
            self._tasks.append(asyncio.create_task(self.kv_feeds.run(), name="kv-events"))
        if self.shared is not None:
            await self.shared.start(self.metrics)
            self._tasks.append(asyncio.create_task(self.shared.run(), name="shared-state"))
            self.weights.share(self.shared.redis, SharedKeys(self.settings.redis_key_prefix),
                               self.settings.canary.weights_sync_interval)
            self._tasks.append(asyncio.create_task(self.weights.run(), name="pool-weights"))
        if self.fleet_samples is not None:
            self._tasks.append(asyncio.create_task(self.fleet_samples.run(),
                                                   name="canary-samples"))
        await self.access.start(self.metrics)
        if self.guard.needed:  # judges every canary; rolls back only with auto_rollback
            self._tasks.append(asyncio.create_task(self.guard.run(), name="canary-guard"))
        if self.metrics.multiprocess:  # --workers N: per-replica gauges go to shared files
            self._tasks.append(asyncio.create_task(self.metrics.publish_forever(),
                                                   name="metrics-publish"))
        for replica in self.replicas:
            log.info("replica %s (%s, pool %s, model %s): window %s, %s", replica.name,
                     replica.engine, replica.pool, replica.model, replica.max_model_len,
                     "healthy" if replica.healthy else "UNHEALTHY")

    async def _serve_copy(self, request: GenerationRequest, pool: str,
                          prompt_counts: list[int] | None, record: RequestRecord) -> Reply:
        """A shadow copy's way (the Shadows' one callable): admitted to ``pool`` and placed
        as any request (no key: the primary's settled), then relayed (by the relay the
        gateway started)."""
        try:
            model, admission = self.admitter.admit(request, Context(pool=pool),
                                                   Prepared(prompt_counts=prompt_counts))
            # No session: the balancer would remember the shadow replica as the session's
            # last one, and the session's next request would lose its replica affinity.
            admission.cost.session = None
            # Never queued: a copy waiting for a slot would take a client's place.
            placement = await self.placer.place(PlacementRequest(model, admission, wait=False))
        except GatewayError as error:
            raise NotSent(error) from error
        return await self.relay.forward(request, placement, record)

    def activity(self) -> dict[str, Any]:
        """What is inside now (requests, shadow copies, queues): /admin/runtime's leak checks."""
        return {"active_requests": self.active_requests, "draining": self.draining,
                "shadow_in_flight": self.shadows.in_flight,
                "queued": {name: self.placer.queued(name) for name in self.models}}

    def admin_view(self) -> AdminView:
        """The part of the gateway the admin routes see."""
        settings = self.settings
        return AdminView(settings.admin_token, settings.canary.gate_token, settings.canary,
                         settings.redis_timeout, self.fleet, self.ledger.load, self.weights,
                         self.canary_samples, self.guard.rollbacks, self.agreement, self.access,
                         self.activity)

    async def _probe_new(self, replica: Replica) -> bool:
        await discover_window(self.probe_session, replica, self.settings.health.timeout)
        return await self.health.check(replica)

    async def drain(self, timeout: float) -> int:
        """Refuse new requests and wait (up to ``timeout``) for in-flight ones to finish;
        returns how many were still running at the deadline."""
        self.draining = True
        deadline = asyncio.get_running_loop().time() + timeout
        while self.active_requests and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return self.active_requests

    async def stop(self) -> None:
        await self.shadows.close()
        await self.scale_from_zero.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.kv_feeds is not None:
            await self.kv_feeds.close()
        if self.fleet_samples is not None:
            await self.fleet_samples.close()
        if self.shared is not None:
            await self.shared.close()
        await self.access.close()
        await self.upstream.close()
        await self.probe_session.close()
        await observe.close(self.observers)
        self.metrics.close()


class GatewayApp:
    """The ASGI app served: generation requests go straight to their endpoint, everything
    else to FastAPI.

    Generation routes carry every token. FastAPI's stack in front of them (exception,
    body-limit, exit-stack and telemetry middlewares, routing) measured about a fifth of the
    gateway's CPU per request, a quarter of that in FastAPI's telemetry check reading
    os.environ on every call; the endpoints handle their own errors, so they skip it.
    """

    def __init__(self, api: FastAPI, endpoints: dict[str, GenerationEndpoint]) -> None:
        self.api = api
        self.state = api.state
        self.endpoints = endpoints

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.endpoints.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.api(scope, receive, send)


# The routes that reach an engine, each with its protocol and body parser (the HTTP
# endpoints serve them; the endpoint picker admits them).
GENERATION_ROUTES: dict[str, tuple[Api, Callable[[bytes], GenerationRequest]]] = {
    "/v1/completions": (Api.OPENAI, openai_protocol.parse_completion),
    "/v1/chat/completions": (Api.OPENAI, openai_protocol.parse_chat),
    "/generate": (Api.TGI, lambda raw: tgi_protocol.parse_generate(raw, stream=False)),
    "/generate_stream": (Api.TGI, lambda raw: tgi_protocol.parse_generate(raw, stream=True)),
    "/": (Api.TGI, lambda raw: tgi_protocol.parse_generate(raw, stream=None)),
    responses.PATH: (Api.OPENAI, responses.parse_responses),
    anthropic.PATH: (Api.ANTHROPIC, anthropic.parse_messages),
    anthropic.COUNT_TOKENS_PATH: (Api.ANTHROPIC, anthropic.parse_count_tokens),
    # vLLM's routes that generate nothing (embeddings, score, rerank, tokenize ...).
    **{path: (Api.OPENAI, parse) for path, parse in pooling.PARSERS.items()},
}


def _count_tokens(admitted: Admitted) -> bytes | None:
    """Anthropic's count_tokens, counted by the gateway when it has the model's tokenizer
    (exact, and no engine's time); else an engine that serves it counts."""
    tokenizer = admitted.model.tokenizer
    return None if tokenizer is None else anthropic.count_tokens(admitted.request, tokenizer)


# Routes the gateway answers itself where it can (the HTTP edge only: the endpoint picker
# sends every request to an engine).
LOCAL_ANSWERS: dict[str, Callable[[Admitted], bytes | None]] = {
    anthropic.COUNT_TOKENS_PATH: _count_tokens}


def create_app(settings: Settings,
               beside: Callable[[Gateway], contextlib.AbstractAsyncContextManager] | None = None
               ) -> GatewayApp:
    """``beside``: another edge run on the same gateway while it serves (the endpoint
    picker's gRPC server, ``gateway.epp``), entered once the gateway has started."""
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        _drain_on_sigterm(gateway)
        try:
            async with beside(gateway) if beside is not None else contextlib.nullcontext():
                _freeze_startup_heap()
                yield
        finally:
            gateway.draining = True
            await gateway.stop()

    app = FastAPI(title="llm-gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    app.state.admin = gateway.admin_view()
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, unknown_route.routing_error)
    endpoints = {path: GenerationEndpoint(gateway, api, path, parse, LOCAL_ANSWERS.get(path))
                 for path, (api, parse) in GENERATION_ROUTES.items()}
    for path, endpoint in endpoints.items():  # for FastAPI's 405 on other methods
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))
    app.include_router(openai_models.router)
    app.include_router(tgi_info.router)
    app.include_router(stored_responses.router)
    app.include_router(ops.router)
    app.include_router(admin.router)
    app.include_router(admin_keys.router)
    return GatewayApp(app, endpoints)


def _freeze_startup_heap() -> None:
    """Take what startup built (modules, the app, the fleet: it lives as long as the
    process) out of the garbage collector's walks: a full collection then visits only what
    requests allocated, instead of pausing the event loop over the ~100k objects startup
    built (one full pass over them measured 100-150 ms)."""
    gc.collect()
    gc.freeze()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's own handler echoes the offending input back and fails with a 500 on a body
    that is not UTF-8; name the field and the problem only."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    return JSONResponse({"detail": [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")),
                                     "type": str(e.get("type", ""))} for e in errors]},
                        status_code=422)


def _drain_on_sigterm(gateway: Gateway) -> None:
    """SIGTERM drains before the server stops: /ready turns 503 and new requests are refused
    at once, in-flight streams get ``drain_timeout`` to finish, then the server's own exit
    runs. A second SIGTERM (or SIGINT) exits at once.

    Wraps the handler uvicorn installed for its serve() (restored by uvicorn when it exits),
    so it works the same in one process and in each ``--workers`` process.
    """
    server_exit = signal.getsignal(signal.SIGTERM)
    if not callable(server_exit) or threading.current_thread() is not threading.main_thread():
        return  # not under a server that handles signals (e.g. tests calling the app)
    loop = asyncio.get_running_loop()

    async def drain_then_exit(sig: int) -> None:
        left = await gateway.drain(gateway.settings.drain_timeout)
        if left:
            log.warning("drain timeout: %d requests still in flight are cut", left)
        server_exit(sig, None)

    def on_sigterm(sig: int, frame: FrameType | None) -> None:
        if gateway.draining:
            server_exit(sig, frame)
            return
        log.warning("SIGTERM: draining (up to %gs) before exit", gateway.settings.drain_timeout)
        gateway.draining = True
        loop.call_soon_threadsafe(lambda: loop.create_task(drain_then_exit(sig)))

    signal.signal(signal.SIGTERM, on_sigterm)


def create_app_from_env() -> GatewayApp:
    """uvicorn factory for worker processes: the config path comes from the environment."""
    return create_app(load_settings(os.environ.get(CONFIG_ENV) or None))
