"""The Endpoint Picker protocol's messages on Envoy's ext_proc stream (the Gateway API
Inference Extension's ``docs/proposals/004-endpoint-picker-protocol``): what Envoy sends
(headers, body chunks, the subset hint, the endpoint that served) read, and what the EPP
answers (the pick as a header and ``envoy.lb`` dynamic metadata, the body, an immediate
error reply, a mode override) built. No decisions here: ``gateway.epp.exchange`` makes them.
"""

from __future__ import annotations

from typing import Any, Iterator

from gateway.epp import messages as ext_proc
from gateway.epp.messages import BUFFERED_PARTIAL, FULL_DUPLEX, OVERWRITE_IF_EXISTS_OR_ADD

DESTINATION = "x-gateway-destination-endpoint"  # header and metadata key: "ip:port[,ip:port]"
NAMESPACE = "envoy.lb"  # the dynamic metadata namespace of the pick and of the served report
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
# Without the served report (plain Envoy does not write it), the attribute Envoy can send
# with the response headers (the ext_proc filter's ``response_attributes``).
UPSTREAM_ADDRESS = "upstream.address"
ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
CHUNK_BYTES = 64 * 1024  # the largest body piece sent back (ext_proc's recommendation)

ProcessingRequest = ext_proc.ProcessingRequest
ProcessingResponse = ext_proc.ProcessingResponse


def header_list(headers: ext_proc.HeaderMap) -> list[tuple[bytes, bytes]]:
    """Envoy's headers as the (lower-cased name, value) byte pairs of an ASGI scope: the
    edge's own header reader (``gateway.api.intake.read_headers``) reads them."""
    return [(h.key.encode("latin-1"), h.raw_value or h.value.encode("latin-1"))
            for h in headers.headers]


def _endpoints(value: Any) -> Iterator[str]:
    """Endpoints in a metadata value: "a,b" or a list of such strings."""
    kind = value.WhichOneof("kind")
    items = ([value.string_value] if kind == "string_value"
             else [v.string_value for v in value.list_value.values] if kind == "list_value"
             else [])
    for item in items:
        for endpoint in item.split(","):
            if endpoint.strip():
                yield endpoint.strip()


def subset_of(message: ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the proxy allows for this request (the subset hint), or None: all."""
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET not in namespace.fields:
        return None
    return frozenset(_endpoints(namespace.fields[SUBSET]))


def served_of(message: ProcessingRequest) -> str | None:
    """The endpoint that answered, as the proxy reports it (served metadata, else the
    upstream address attribute)."""
    namespace = message.metadata_context.filter_metadata.get(NAMESPACE)
    if namespace is not None and SERVED in namespace.fields:
        return next(_endpoints(namespace.fields[SERVED]), None)
    attributes = message.attributes.get(ATTRIBUTES_KEY)
    if attributes is not None and UPSTREAM_ADDRESS in attributes.fields:
        return attributes.fields[UPSTREAM_ADDRESS].string_value or None
    return None


def status_of(headers: ext_proc.HeaderMap) -> int:
    """A response's ``:status`` (0 when absent or not a number)."""
    for h in headers.headers:
        if h.key == ":status":
            value = h.raw_value or h.value.encode()
            return int(value) if value.isdigit() else 0
    return 0


def _pick_common(endpoints: list[str]) -> tuple[ext_proc.CommonResponse, ext_proc.Struct]:
    value = ",".join(endpoints)
    metadata = ext_proc.Struct()
    metadata.fields[NAMESPACE].struct_value.fields[DESTINATION].string_value = value
    common = ext_proc.CommonResponse(clear_route_cache=True)
    common.header_mutation.set_headers.extend(_header_options([(DESTINATION, value)]))
    return common, metadata


def pick(endpoints: list[str], body_follows: bool) -> ProcessingResponse:
    """The answer to the request headers (full-duplex streamed bodies): the endpoints Envoy
    is to try, in order, as the header and the ``envoy.lb`` metadata (the protocol asks for
    both, with one value). With ``body_follows`` the body is sent back next."""
    common, metadata = _pick_common(endpoints)
    if body_follows:  # a body sent back has no length known to Envoy: it goes chunked
        common.header_mutation.remove_headers.append("content-length")
    return ProcessingResponse(request_headers=ext_proc.HeadersResponse(response=common),
                              dynamic_metadata=metadata)


def pick_with_body(endpoints: list[str], body: bytes | None) -> ProcessingResponse:
    """The same pick as the answer to a buffered request body (Envoy held the headers for
    it): the body goes on unchanged, or replaced by ``body``."""
    common, metadata = _pick_common(endpoints)
    if body is not None:
        common.body_mutation.body = body
        common.header_mutation.set_headers.extend(_header_options([("content-length",
                                                                    str(len(body)))]))
    return ProcessingResponse(request_body=ext_proc.BodyResponse(response=common),
                              dynamic_metadata=metadata)


def go_on() -> ProcessingResponse:
    """The request headers answered with no change (the pick comes with the body)."""
    return ProcessingResponse(request_headers=ext_proc.HeadersResponse())


def request_body(body: bytes) -> list[ProcessingResponse]:
    """The request body sent back to Envoy (to go upstream), in pieces (full-duplex)."""
    pieces = [body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    return [_streamed(piece, i == len(pieces) - 1, request=True) for i, piece in enumerate(pieces)]


def request_body_piece(piece: bytes, end: bool, buffered: bool) -> ProcessingResponse:
    """A request body piece that goes on as it came."""
    if buffered:
        return ProcessingResponse(request_body=ext_proc.BodyResponse())
    return _streamed(piece, end, request=True)


def _streamed(piece: bytes, end: bool, request: bool) -> ProcessingResponse:
    body = ext_proc.BodyResponse(response=ext_proc.CommonResponse(
        body_mutation=ext_proc.BodyMutation(streamed_response=ext_proc.StreamedBodyResponse(
            body=piece, end_of_stream=end))))
    return (ProcessingResponse(request_body=body) if request
            else ProcessingResponse(response_body=body))


def response_headers(add: list[tuple[str, str]] = [],  # noqa: B006 - not mutated
                     read_body_after: ext_proc.ProtocolConfiguration | None = None,
                     replacing: bool = False) -> ProcessingResponse:
    """The answer to the response headers: ``add`` headers set (a key's x-ratelimit-*).
    With ``read_body_after`` (the filter's modes) Envoy is asked for the answer's body
    (buffered, up to its buffer limit: a larger answer is not read for usage); else nothing
    more of the response comes, unless the filter sends it anyway. ``replacing``: the body
    will be replaced (``response_body``), so its length goes (Envoy checks a new body
    against the length the headers had, and writes the new one when they have none)."""
    common = ext_proc.CommonResponse()
    if add:
        common.header_mutation.set_headers.extend(_header_options(add))
    if replacing:
        common.header_mutation.remove_headers.append("content-length")
    response = ProcessingResponse(response_headers=ext_proc.HeadersResponse(response=common))
    if read_body_after is not None:
        # The whole mode is overridden: its request side restates the filter's (header and
        # trailer modes left DEFAULT: unchanged).
        mode = response.mode_override
        mode.request_body_mode = read_body_after.request_body_mode
        mode.response_body_mode = BUFFERED_PARTIAL
    return response


def response_body(replaced: tuple[int, bytes] | None = None) -> ProcessingResponse:
    """The answer read whole: it goes on to the client unchanged, or ``replaced`` by
    (status, JSON body)."""
    if replaced is None:
        return ProcessingResponse(response_body=ext_proc.BodyResponse())
    status, body = replaced
    common = ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(body=body))
    common.header_mutation.set_headers.extend(_header_options([
        (":status", str(status)), ("content-type", "application/json")]))
    return ProcessingResponse(response_body=ext_proc.BodyResponse(response=common))


def response_body_piece(piece: bytes, end: bool, mode: int) -> ProcessingResponse:
    """A response body piece the filter sent (streamed modes): it goes on as it came."""
    if mode == FULL_DUPLEX:
        return _streamed(piece, end, request=False)
    return ProcessingResponse(response_body=ext_proc.BodyResponse())


def immediate(status: int, headers: list[tuple[str, str]], body: bytes) -> ProcessingResponse:
    """A reply Envoy sends the client itself (the request goes nowhere)."""
    return ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
        status={"code": status}, body=body,
        headers=ext_proc.HeaderMutation(set_headers=_header_options(headers))))


def _header_options(headers: list[tuple[str, str]]) -> list[ext_proc.HeaderValueOption]:
    return [ext_proc.HeaderValueOption(header=ext_proc.HeaderValue(key=k, raw_value=v.encode()),
                                   append_action=OVERWRITE_IF_EXISTS_OR_ADD)
            for k, v in headers]
