"""The EPP's gRPC server: Envoy's ``ExternalProcessor`` service (one ``Exchange`` per
stream) and the gRPC health services the protocol names (``liveness``, ``readiness``, the
ext_proc service itself), run inside a gateway process beside its HTTP port (metrics,
health, admin API)."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, AsyncIterator, Callable

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
                      context: grpc.aio.ServicerContext) -> AsyncIterator[wire.ProcessingResponse]:
        exchange = Exchange(self.gateway, GENERATION_ROUTES, self.fallbacks)
        try:
            async for message in messages_in:
                for answer in await exchange.on(message):
                    yield answer
        finally:
            exchange.close()  # however the stream ended: Envoy done, reset, or cancelled

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Process": grpc.stream_stream_rpc_method_handler(
                self.process, request_deserializer=messages.ProcessingRequest.FromString,
                response_serializer=messages.ProcessingResponse.SerializeToString)})


class EppServer:
    """``start`` listens on ``host:port``; ``stop`` drains the streams (up to ``grace``)."""

    def __init__(self, gateway: "Gateway", host: str, port: int, fallbacks: int = 2) -> None:
        self.gateway = gateway
        self.address = f"{host}:{port}"
        self.health = health.aio.HealthServicer()
        # No SO_REUSEPORT (gRPC's default): a second picker on the same port must fail to
        # start, not share the streams of the first.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self.server.add_generic_rpc_handlers((ExternalProcessor(gateway, fallbacks).handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(self.address)

    async def start(self) -> None:
        await self.server.start()
        await self.serving(True)
        log.info("endpoint picker (ext_proc) listening on %s", self.address)

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


def beside(host: str, port: int, fallbacks: int, grace: float
           ) -> Callable[["Gateway"], contextlib.AbstractAsyncContextManager]:
    """The picker's server as ``create_app``'s ``beside``: serving while the gateway runs."""
    @contextlib.asynccontextmanager
    async def serving(gateway: "Gateway") -> AsyncIterator[None]:
        server = EppServer(gateway, host, port, fallbacks)
        await server.start()
        try:
            yield
        finally:
            await server.stop(grace)

    return serving
