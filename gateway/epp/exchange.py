"""One request's conversation with Envoy on one ext_proc stream, in the Endpoint Picker's
role: the gateway's own admission and placement pick the replica, Envoy moves the bytes.

- Request headers, then the body (gathered whole): the edge's checks
  (``gateway.api.intake.admit``: key, window, limits, objective), then the placement
  (``Placer.place``: policy, ledger, fair queue, flow control). The pick goes back as the
  destination header and ``envoy.lb`` metadata, with fallbacks. A refusal is an immediate
  reply in the client's error shape, exactly the HTTP gateway's.
- Response headers: the endpoint that served (Envoy may have retried on a fallback: the
  reservation moves there, and the endpoints it tried first count a failure towards outlier
  ejection), the status, the key's x-ratelimit-* headers added.
- The end of the ext_proc stream (Envoy closes it when the HTTP request ends, however it
  ends): the reservation is released and the key's grant settled (``close``).

Envoy's body modes, as its filter is configured (the first message says which):
- request body buffered (deploy/envoy): the headers go on at once, the pick answers the
  body, which goes on unchanged unless capped. Then a whole answer or an engine's error is
  asked for at its response headers (a mode override): a whole answer settles the key's
  limits on its usage, an engine's error is answered in the gateway's shape. A stream's
  events never reach the picker.
- request body full-duplex streamed (GIE's mode, what kgateway, Istio and Envoy AI Gateway
  configure): the pick answers the headers once the body is in, and the body is sent back.
  Envoy allows no mode override then: the response comes only if the filter sends it (each
  piece is passed back as it came), and a stream is charged its reservation.

Requests that are not generation requests (``GET /v1/models`` ...) go to any available
replica, reserving nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import orjson

from gateway.api.client_connection import MAX_BODY_BYTES, BodyTooLarge
from gateway.api.intake import (Admitted, Headers, HeadersTooLarge, admit, model_label_of,
                                new_request_id, read_headers)
from gateway.dataplane.outcome import Refusal, RequestRecord
from gateway.dataplane.placement import PlacementRequest
from gateway.epp import messages, wire
from gateway.epp.messages import BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX, NONE, STREAMED
from gateway.fleet.role import Role
from gateway.protocol.errors import Api, GatewayError, NoReplicaAvailable, error_from_engine
from gateway.protocol.request import GenerationRequest
from gateway.protocol.translate import passes_through
from gateway.protocol.translate.passthrough import capped_body, usage_of
from gateway.protocol.usage import Usage

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.dataplane.placement import Placement
    from gateway.fleet.replica import Replica

Routes = dict[str, tuple[Api, Callable[[bytes], GenerationRequest]]]
MAX_ANSWER_BYTES = 4 * 1024 * 1024  # a whole answer parsed for its usage, at most


def endpoint_of(replica: "Replica") -> str:
    """A replica's ``host:port`` (its URL's), the form Envoy is told."""
    return replica.url.split("://", 1)[-1].rstrip("/")


class Exchange:
    """One HTTP request's ext_proc messages in, the EPP's answers out (``on``); ``close``
    when the stream ends, however it ends."""

    def __init__(self, gateway: "Gateway", routes: Routes, fallbacks: int) -> None:
        self.gateway = gateway
        self.routes = routes
        self.fallbacks = fallbacks
        self.modes = messages.ProtocolConfiguration()  # the filter's body modes
        self.api = Api.OPENAI  # the route's protocol (its error shape)
        self.parse: Callable[[bytes], GenerationRequest] | None = None  # None: no generation
        self.read: Headers | None = None  # what the edge read of the request headers
        self.subset: frozenset[str] | None = None  # the proxy's subset hint
        self.endpoints: list[str] = []  # the pick, then its fallbacks, as Envoy was told
        self.body = bytearray()
        self.record: RequestRecord | None = None
        self.admitted: Admitted | None = None
        self.placement: "Placement | None" = None
        self.status = 0  # the response's
        self.answer = bytearray()  # a whole answer, when its pieces come streamed
        self.usage: Usage | None = None

    @property
    def buffered(self) -> bool:
        return self.modes.request_body_mode in (BUFFERED, BUFFERED_PARTIAL)

    async def on(self, message: wire.ProcessingRequest) -> list[wire.ProcessingResponse]:
        """The answers to one message from Envoy (none while a body is still coming)."""
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(message)
        if kind == "request_body":
            return await self._request_body(message.request_body)
        if kind == "response_headers":
            return self._response_headers(message)
        if kind == "response_body":
            return self._response_body(message.response_body)
        if kind == "request_trailers":
            return [wire.ProcessingResponse(request_trailers=messages.TrailersResponse())]
        if kind == "response_trailers":
            return [wire.ProcessingResponse(response_trailers=messages.TrailersResponse())]
        return []

    async def _request_headers(self, message: wire.ProcessingRequest
                               ) -> list[wire.ProcessingResponse]:
        self.modes = message.protocol_config
        headers = wire.header_list(message.request_headers.headers)
        self.subset = wire.subset_of(message)
        method = path = ""
        for name, value in headers:
            if name == b":method":
                method = value.decode("latin-1")
            elif name == b":path":
                path = value.decode("latin-1").split("?", 1)[0]
        route = self.routes.get(path) if method == "POST" else None
        if route is not None:
            self.api, self.parse = route
        if self.parse is None:  # nothing to admit or reserve: any replica that is up
            available = [endpoint_of(r) for r in self.gateway.replicas
                         if r.available and r.role.answers and self._allowed(r)]
            if not available:
                return [self._refuse(NoReplicaAvailable("no replica is available"), Api.OPENAI)]
            self.endpoints = available[:1 + self.fallbacks]
            return [wire.pick(self.endpoints, body_follows=False)]
        arrival = time.perf_counter()
        try:
            self.read = read_headers({"headers": headers})
            self.record = RequestRecord(self.read.request_id, self.api, path, arrival,
                                        self.read.traceparent, self.read.tracestate)
        except HeadersTooLarge as error:
            self.record = RequestRecord(new_request_id(), self.api, path, arrival)
            return [self._refuse(error, self.api)]
        if self.gateway.outcomes.starts:
            self.gateway.outcomes.request_started(self.record)
        if message.request_headers.end_of_stream:  # no body at all
            return await self._admit_and_pick(b"")
        return [wire.go_on()] if self.buffered else []

    async def _request_body(self, piece: messages.HttpBody) -> list[wire.ProcessingResponse]:
        if self.record is None:  # not a generation request (answered): the body goes on
            return [wire.request_body_piece(piece.body, piece.end_of_stream, self.buffered)]
        if self.record.status:  # refused already: Envoy sends nothing more that counts
            return []
        self.body += piece.body
        if len(self.body) > MAX_BODY_BYTES:
            return [self._refuse(BodyTooLarge(f"the request body is larger than "
                                              f"{MAX_BODY_BYTES} bytes"), self.api)]
        if not piece.end_of_stream:
            return []
        body, self.body = bytes(self.body), bytearray()
        return await self._admit_and_pick(body)

    async def _admit_and_pick(self, body: bytes) -> list[wire.ProcessingResponse]:
        gateway, record = self.gateway, self.record
        assert record is not None and self.parse is not None and self.read is not None

        async def whole_body() -> bytes:
            return body

        try:
            self.admitted = admitted = await admit(gateway, self.read, whole_body, self.parse,
                                                   record)
            request, admission, context = admitted.request, admitted.admission, admitted.context
            # Envoy sends the body as it is to one replica: only replicas that take it so
            # (no translation) and alone (no prefill/decode pair), and of those only the
            # proxy's subset, when it sent one.
            admission.replicas = [r for r in admission.replicas if r.role is Role.BOTH
                                  and self._allowed(r)
                                  and passes_through(request, r.engine, r.version)]
            if not admission.replicas:
                raise NoReplicaAvailable("no replica can take this request as it is (the "
                                         "endpoint picker neither translates nor pairs "
                                         "prefill and decode replicas)"
                                         if self.subset is None else
                                         "no replica of the proxy's subset can serve it")
            self.placement = placement = await gateway.placer.place(
                PlacementRequest.of(request, context, admitted.model, admission))
        except GatewayError as error:
            api = record.request.api if record.request is not None else self.api
            return [self._refuse(error, api)]
        self.endpoints = endpoints = [endpoint_of(placement.replica),
                                      *self._fallbacks(placement)]
        capped = (None if admission.output_cap is None
                  else orjson.dumps(capped_body(request, admission.output_cap)))
        if self.buffered and body:
            return [wire.pick_with_body(endpoints, capped)]
        if not body:
            return [wire.pick(endpoints, body_follows=False)]
        return [wire.pick(endpoints, body_follows=True),
                *wire.request_body(body if capped is None else capped)]

    def _fallbacks(self, placement: "Placement") -> list[str]:
        """Other replicas that can take the request, least loaded first: where Envoy's retry
        goes when the pick fails before answering."""
        if not self.fallbacks:
            return []
        ledger = self.gateway.ledger
        others = [r for r in placement.admission.replicas
                  if r is not placement.replica and r.available]
        others.sort(key=lambda r: ledger.load(r.name).outstanding_tokens)
        return [endpoint_of(r) for r in others[:self.fallbacks]]

    def _allowed(self, replica: "Replica") -> bool:
        return self.subset is None or endpoint_of(replica) in self.subset

    def _response_headers(self, message: wire.ProcessingRequest) -> list[wire.ProcessingResponse]:
        self.status = wire.status_of(message.response_headers.headers)
        served = wire.served_of(message)
        if served is not None:
            self._tried(served)
        placement, admitted = self.placement, self.admitted
        if placement is None or admitted is None:  # not a generation request
            return [wire.response_headers()]
        if served is not None and served != endpoint_of(placement.replica):
            self._move(served)
        limits = [(k.decode(), v.decode()) for k, v in admitted.grant.headers]
        # A whole answer is asked for its usage, an engine's error to answer it in the
        # gateway's shape; never a stream's events. (Only a buffered request allows it.)
        wanted = self.status >= 400 or not admitted.request.stream
        ask = self.buffered and wanted and self.modes.response_body_mode == NONE
        return [wire.response_headers(limits, read_body_after=self.modes if ask else None,
                                      replacing=ask and self.status >= 400)]

    def _tried(self, served: str) -> None:
        """What Envoy's attempts showed of the replicas, told to outlier detection as the
        HTTP gateway tells its own: each endpoint of the list before the one that served
        failed before answering (Envoy retries only then), and one that answered did its
        part. Until its health probe notices, only this keeps a dead replica from being
        picked: every request placed on it moves away at once, so to the ledger it looks
        idle. A 5xx counts neither way: Envoy's own 503s (its limits) look the same."""
        outlier = self.gateway.outlier
        failed = self.endpoints[:self.endpoints.index(served)] if served in self.endpoints else []
        for endpoint in failed:
            if (replica := self._replica_at(endpoint)) is not None:
                outlier.failure(replica)
        if self.status < 400 and (replica := self._replica_at(served)) is not None:
            outlier.success(replica)  # (a 4xx is the request's fault, not the replica's)

    def _replica_at(self, endpoint: str) -> "Replica | None":
        placement = self.placement
        if placement is not None and endpoint_of(placement.replica) == endpoint:
            return placement.replica  # the usual case: served where picked
        return next((r for r in self.gateway.replicas if endpoint_of(r) == endpoint), None)

    def _move(self, served: str) -> None:
        """Envoy's retry went to a fallback: the reservation follows it."""
        placement = self.placement
        assert placement is not None
        replica = next((r for r in placement.admission.replicas if endpoint_of(r) == served),
                       None)
        if replica is None:
            return
        old = placement.lease
        lease = self.gateway.ledger.lease(replica.name, old.prompt_tokens, old.output_tokens,
                                          streamed=old.streamed)
        lease.on_close, old.on_close = old.on_close, None
        old.close()
        placement.replica, placement.lease = replica, lease

    def _response_body(self, piece: messages.HttpBody) -> list[wire.ProcessingResponse]:
        admitted = self.admitted
        streamed = self.modes.response_body_mode in (FULL_DUPLEX, STREAMED)
        if streamed:  # the filter sends every piece: each goes back as it came
            answer = [wire.response_body_piece(piece.body, piece.end_of_stream,
                                               self.modes.response_body_mode)]
            if admitted is None or admitted.request.stream or self.status >= 400:
                return answer
            if len(self.answer) + len(piece.body) <= MAX_ANSWER_BYTES:
                self.answer += piece.body
            if not piece.end_of_stream:
                return answer
            whole = bytes(self.answer)
        else:
            answer, whole = [wire.response_body()], piece.body
            if admitted is None:
                return answer
            if self.status >= 400:  # one shape whatever the engine (context_length_exceeded)
                error = error_from_engine(self.status, whole)
                self.status = error.status_for(admitted.request.api)
                return [wire.response_body((self.status, error.body(admitted.request.api)))]
        if len(whole) <= MAX_ANSWER_BYTES:
            try:
                self.usage = usage_of(orjson.loads(whole), admitted.request.api)
            except orjson.JSONDecodeError:
                self.usage = None
        return answer

    def _refuse(self, error: GatewayError, api: Api) -> wire.ProcessingResponse:
        """The gateway's own error reply, as the HTTP gateway sends it."""
        record = self.record
        status = error.status_for(api)
        headers = [("content-type", "application/json"), *error.headers.items()]
        if self.admitted is not None:  # refused after admission: the key's headers too
            headers += [(k.decode(), v.decode()) for k, v in self.admitted.grant.headers]
        if record is not None:
            headers.append(("x-request-id", record.request_id))
            record.status = status
            model = record.model or (record.request.model if record.request else None)
            record.refusal = Refusal(error.reason,
                                     model_label_of(self.gateway.admitter, model, api), api)
        return wire.immediate(status, headers, error.body(api))

    def close(self) -> None:
        """The stream ended (the request is over, however): release and settle, once."""
        placement, admitted, record = self.placement, self.admitted, self.record
        usage = None
        if placement is not None:
            answered = 0 < self.status < 400
            # An answer whose usage was not read is charged its reservation.
            usage = self.usage if self.usage is not None else (Usage() if answered else None)
            if self.usage is not None:
                placement.served(self.usage.completion_tokens)
            placement.lease.close()
            self.placement = None
        if admitted is not None:
            admitted.grant.settle(usage)
            self.admitted = None
        if record is not None:
            record.usage = usage
            record.status = record.status or self.status or 499
            record.ended_at = time.perf_counter()
            if self.gateway.outcomes.ends:
                self.gateway.outcomes.request_ended(record)
            self.record = None
