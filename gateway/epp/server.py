"""The EPP's gRPC server: Envoy's ``ExternalProcessor`` service (one ``Exchange`` per
stream) and the gRPC health services the protocol names (``liveness``, ``readiness``, the
ext_proc service itself), run inside a gateway process beside its HTTP port (metrics,
health, admin API)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.epp import messages, wire
from gateway.epp.exchange import Exchange

from gateway.app import GENERATION_ROUTES

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("gateway.epp")

SERVICE = messages.SERVICE

class ExternalProcessor:
    """Envoy's ``ExternalProcessor.Process``: one stream per HTTP request."""

    def __init__(self, gateway: "Gateway", fallbacks: int) -> None:
        self.gateway = gateway
        self.fallbacks = fallbacks

    async def process(self, messages_in: AsyncIterator[wire.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> None:
        # The context's read and write, not an async generator over ``messages_in``: fewer
        # layers of grpc's per message (about 5% of the picker's CPU per stream).
        exchange = Exchange(self.gateway, GENERATION_ROUTES, self.fallbacks)
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                for answer in await exchange.on(message):
                    await context.write(answer)
        finally:
            exchange.close()  # however the stream ended: Envoy done, reset, or cancelled

    def handler(self) -> grpc.GenericRpcHandler:
        return ext_proc_handler(self.process)


Process = Callable[[AsyncIterator[wire.ProcessingRequest], grpc.aio.ServicerContext],
                   Awaitable[None]]


def ext_proc_handler(process: Process) -> grpc.GenericRpcHandler:
    """Envoy's ``ExternalProcessor`` service, each stream served by ``process``."""
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Process": grpc.stream_stream_rpc_method_handler(
            process, request_deserializer=messages.ProcessingRequest.FromString,
            response_serializer=messages.ProcessingResponse.SerializeToString)})


@dataclass(frozen=True)
class Listen:
    """Where and how the picker serves."""

    host: str
    port: int
    fallbacks: int = 2  # endpoints named after the pick, for Envoy's retries
    tls: tuple[bytes, bytes] | None = None  # (certificate chain, private key), PEM
    health_port: int | None = None  # plaintext gRPC health alone (kubelet's probes, with TLS)


class EppServer:
    """``start`` listens; ``stop`` drains the streams (up to ``grace``)."""

    def __init__(self, gateway: "Gateway", listen: Listen) -> None:
        self.gateway = gateway
        self.address = f"{listen.host}:{listen.port}"
        self.health = health.aio.HealthServicer()
        self.server = grpc_server()
        self.server.add_generic_rpc_handlers(
            (ExternalProcessor(gateway, listen.fallbacks).handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if listen.tls is None:
            self.server.add_insecure_port(self.address)
        else:  # Envoy AI Gateway dials its picker with TLS (GIE's reference serves it)
            self.server.add_secure_port(self.address, grpc.ssl_server_credentials(
                [(listen.tls[1], listen.tls[0])]))
        self.health_server: grpc.aio.Server | None = None
        if listen.health_port is not None:
            self.health_server = grpc_server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_server.add_insecure_port(f"{listen.host}:{listen.health_port}")
        self.tls = listen.tls is not None

    async def start(self) -> None:
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        await self.serving(True)
        log.info("endpoint picker (ext_proc) listening on %s%s", self.address,
                 " (TLS)" if self.tls else "")

    async def serving(self, ready: bool) -> None:
        """Liveness is always SERVING; readiness and the ext_proc service follow ``ready``
        (a draining picker stops being picked)."""
        status = health_pb2.HealthCheckResponse
        await self.health.set("liveness", status.SERVING)
        for name in ("", "readiness", SERVICE):
            await self.health.set(name, status.SERVING if ready else status.NOT_SERVING)

    async def stop(self, grace: float) -> None:
        await self.serving(False)
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)


def grpc_server() -> grpc.aio.Server:
    # No SO_REUSEPORT (gRPC's default): a second picker on the same port must fail to
    # start, not share the streams of the first.
    return grpc.aio.server(options=[("grpc.so_reuseport", 0)])


def beside(listen: Listen, grace: float
           ) -> Callable[["Gateway"], contextlib.AbstractAsyncContextManager]:
    """The picker's server as ``create_app``'s ``beside``: serving while the gateway runs."""
    @contextlib.asynccontextmanager
    async def serving(gateway: "Gateway") -> AsyncIterator[None]:
        server = EppServer(gateway, listen)
        await server.start()
        try:
            yield
        finally:
            await server.stop(grace)

    return serving
