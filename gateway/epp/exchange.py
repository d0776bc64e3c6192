"""One request's conversation with Envoy on one ext_proc stream, in the Endpoint Picker's
role: the gateway's own admission and placement pick the replica, Envoy moves the bytes.

- Request headers, then the body (full-duplex streamed, gathered whole): the edge's checks
  (``gateway.api.intake.admit``: key, window, limits, objective), then the placement
  (``Placer.place``: policy, ledger, fair queue, flow control). The pick goes back as the
  destination header and metadata, with fallbacks, then the body. A refusal is an immediate
  reply in the client's error shape, exactly the HTTP gateway's.
- Response headers: the endpoint that served (Envoy may have retried on a fallback: the
  reservation moves there) and the status. A stream's body is then switched off, so no
  token event passes through Python; a whole answer's body is read for its usage.
- The end of the ext_proc stream (Envoy closes it when the HTTP request ends, however it
  ends): the reservation is released and the key's grant settled (``close``).

Requests that are not generation requests (``GET /v1/models`` ...) go to any available
replica, reserving nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import orjson

from gateway.api.client_connection import MAX_BODY_BYTES, BodyTooLarge
from gateway.api.intake import (Admitted, Headers, HeadersTooLarge, admit, new_request_id,
                                read_headers)
from gateway.balance.pool_split import sticky_key
from gateway.dataplane.outcome import Refusal, RequestRecord
from gateway.epp import wire
from gateway.protocol.errors import Api, GatewayError, NoReplicaAvailable
from gateway.protocol.request import GenerationRequest
from gateway.protocol.translate.passthrough import capped_body, usage_of
from gateway.protocol.usage import Usage

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.dataplane.placement import Placement
    from gateway.fleet.replica import Replica

Parser = Callable[[bytes], GenerationRequest]
MAX_ANSWER_BYTES = 4 * 1024 * 1024  # a whole answer parsed for its usage, at most


def endpoint_of(replica: "Replica") -> str:
    """A replica's ``host:port`` (its URL's), the form Envoy is told."""
    return replica.url.split("://", 1)[-1].rstrip("/")


class Exchange:
    """One HTTP request's ext_proc messages in, the EPP's answers out (``on``); ``close``
    when the stream ends."""

    def __init__(self, gateway: "Gateway", parsers: dict[str, Parser], fallbacks: int) -> None:
        self.gateway = gateway
        self.parsers = parsers
        self.fallbacks = fallbacks
        self.body = bytearray()
        self.headers: list[tuple[bytes, bytes]] = []
        self.read: Headers | None = None  # what the edge read of them
        self.subset: frozenset[str] | None = None
        self.parse: Parser | None = None
        self.record: RequestRecord | None = None
        self.admitted: Admitted | None = None
        self.placement: "Placement | None" = None
        self.status = 0
        self.usage: Usage | None = None

    async def on(self, message: wire.ProcessingRequest) -> list[wire.ProcessingResponse]:
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
            return [wire.ProcessingResponse(request_trailers=wire.ext_proc.TrailersResponse())]
        if kind == "response_trailers":
            return [wire.ProcessingResponse(response_trailers=wire.ext_proc.TrailersResponse())]
        return []

    async def _request_headers(self, message: wire.ProcessingRequest) -> list[wire.ProcessingResponse]:
        self.headers = wire.header_list(message.request_headers.headers)
        self.subset = wire.subset_of(message)
        method = path = ""
        for key, value in self.headers:
            if key == b":method":
                method = value.decode("latin-1")
            elif key == b":path":
                path = value.decode("latin-1").split("?", 1)[0]
        self.parse = self.parsers.get(path) if method == "POST" else None
        if self.parse is None:  # nothing to admit or reserve: any replica that is up
            available = [endpoint_of(r) for r in self.gateway.replicas
                         if r.available and r.role != "prefill" and self._allowed(r)]
            if not available:
                return [self._refuse(NoReplicaAvailable("no replica is available"), Api.OPENAI)]
            return [wire.pick(available[:1 + self.fallbacks], body_follows=False)]
        arrival = time.perf_counter()
        try:
            headers = read_headers({"headers": self.headers})
            self.record = RequestRecord(headers.request_id, Api.OPENAI, path, arrival,
                                        headers.traceparent, headers.tracestate)
        except HeadersTooLarge as error:
            self.record = RequestRecord(new_request_id(), Api.OPENAI, path, arrival)
            return [self._refuse(error, Api.OPENAI)]
        self.read = headers
        if self.gateway.outcomes.starts:
            self.gateway.outcomes.request_started(self.record)
        if message.request_headers.end_of_stream:  # no body at all
            return await self._admit_and_pick()
        return []

    async def _request_body(self, chunk: wire.ext_proc.HttpBody) -> list[wire.ProcessingResponse]:
        if self.parse is None or self.record is None:
            # Headers were answered (a pass-through pick): the body goes on as it came.
            return [wire.ProcessingResponse(request_body=wire.ext_proc.BodyResponse(
                response=wire.ext_proc.CommonResponse(body_mutation=wire.ext_proc.BodyMutation(
                    streamed_response=wire.ext_proc.StreamedBodyResponse(
                        body=chunk.body, end_of_stream=chunk.end_of_stream)))))]
        if self.record.status:  # refused already: the rest is dropped
            return []
        self.body += chunk.body
        if len(self.body) > MAX_BODY_BYTES:
            return [self._refuse(BodyTooLarge(f"the request body is larger than "
                                              f"{MAX_BODY_BYTES} bytes"), Api.OPENAI)]
        if not chunk.end_of_stream:
            return []
        return await self._admit_and_pick()

    async def _admit_and_pick(self) -> list[wire.ProcessingResponse]:
        gateway, record = self.gateway, self.record
        assert record is not None and self.parse is not None and self.read is not None
        body = bytes(self.body)
        self.body = bytearray()

        async def read_body() -> bytes:
            return body

        try:
            self.admitted = admitted = await admit(gateway, self.read, read_body, self.parse,
                                                   record)
            request, admission = admitted.request, admitted.admission
            if self.subset is not None:  # the proxy's subset hint
                admission.replicas = [r for r in admission.replicas if self._allowed(r)]
                if not admission.replicas:
                    raise NoReplicaAvailable("no replica of the proxy's subset can serve "
                                             "this request")
            context = admitted.context
            self.placement = placement = await gateway.placer.place(
                admitted.model, admission, key=sticky_key(request, context),
                caller=context.caller, objective=context.objective, streamed=request.stream)
        except GatewayError as error:
            api = record.request.api if record.request is not None else Api.OPENAI
            return [self._refuse(error, api)]
        if placement.replica.role == "decode":  # P/D needs the HTTP gateway's prefill step
            return [self._refuse(NoReplicaAvailable(
                "disaggregated (prefill/decode) serving is not done by the endpoint picker"),
                request.api)]
        endpoints = [endpoint_of(placement.replica), *self._fallbacks(placement)]
        sent = (body if admission.output_cap is None
                else orjson.dumps(capped_body(request, admission.output_cap)))
        return [wire.pick(endpoints, body_follows=True), *wire.request_body(sent)]

    def _fallbacks(self, placement: "Placement") -> list[str]:
        """Other replicas that can take the request, least loaded first: where Envoy's retry
        goes when the pick fails before answering."""
        if not self.fallbacks:
            return []
        ledger = self.gateway.ledger
        others = [r for r in placement.admission.replicas
                  if r is not placement.replica and r.available and r.role == "both"]
        others.sort(key=lambda r: ledger.load(r.name).outstanding_tokens)
        return [endpoint_of(r) for r in others[:self.fallbacks]]

    def _allowed(self, replica: "Replica") -> bool:
        return self.subset is None or endpoint_of(replica) in self.subset

    def _response_headers(self, message: wire.ProcessingRequest) -> list[wire.ProcessingResponse]:
        self.status = wire.status_of(message.response_headers.headers)
        placement = self.placement
        if placement is None:
            return [wire.response_headers(read_body=False)]
        served = wire.served_of(message)
        if served is not None and served != endpoint_of(placement.replica):
            self._move(served)
        stream = self.admitted is not None and self.admitted.request.stream
        return [wire.response_headers(read_body=not stream and self.status < 400)]

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

    def _response_body(self, whole: wire.ext_proc.HttpBody) -> list[wire.ProcessingResponse]:
        """A whole answer (buffered by Envoy): its usage settles the key's grant."""
        if self.admitted is not None and len(whole.body) <= MAX_ANSWER_BYTES:
            try:
                self.usage = usage_of(orjson.loads(whole.body), self.admitted.request.api)
            except orjson.JSONDecodeError:
                self.usage = None
        return [wire.response_body()]

    def _refuse(self, error: GatewayError, api: Api) -> wire.ProcessingResponse:
        """The gateway's own error reply, as the HTTP gateway sends it."""
        record = self.record
        status = error.status_for(api)
        headers = [("content-type", "application/json"), *error.headers.items()]
        if record is not None:
            headers.append(("x-request-id", record.request_id))
            record.status = status
            model = record.model or (record.request.model if record.request else None)
            record.refusal = Refusal(error.reason, self._model_label(model, api), api)
        return wire.immediate(status, headers, error.body(api))

    def _model_label(self, name: str | None, api: Api) -> str:
        """Only served names become label values (client input never does)."""
        if name is not None and self.gateway.admitter.names.resolve(name) is not None:
            return name
        return "unknown"

    def close(self) -> None:
        """The stream ended (the request is over, however): release and settle, once."""
        placement, admitted, record = self.placement, self.admitted, self.record
        usage = None
        if placement is not None:
            served = 0 < self.status < 400
            usage = self.usage if self.usage is not None else (Usage() if served else None)
            if self.usage is not None:
                placement.served(self.usage.completion_tokens)
            placement.lease.close()
            self.placement = None
        if admitted is not None:
            admitted.grant.settle(usage)  # a stream's: its reservation (its usage is unread)
            self.admitted = None
        if record is not None:
            record.usage = usage
            record.status = record.status or self.status or 499
            record.ended_at = time.perf_counter()
            if self.gateway.outcomes.ends:
                self.gateway.outcomes.request_ended(record)
            self.record = None

