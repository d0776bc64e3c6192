"""The edge's first steps, shared by every way a generation request comes in (the HTTP
endpoints, ``gateway.api.generation``; Envoy's ext_proc stream, ``gateway.epp``): read the
headers in one pass, then authenticate, parse, admit (model, window, pool), resolve the
objective and take the key's grant, in that order. What comes after (relay, or a pick that
Envoy follows) is each edge's own."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, NamedTuple, Protocol

from gateway.balance.pool_split import MAX_POOL_CHARS, POOL_HEADER
from gateway.flow.objective import (LLMD_TPOT_HEADER, LLMD_TTFT_HEADER, MAX_OBJECTIVE_NAME,
                                    NO_HEADERS, OBJECTIVE_NAME_HEADERS, PRIORITY_HEADER,
                                    STRICT_HEADER, TPOT_HEADER, TTFT_HEADER, ObjectiveHeaders,
                                    resolve)
from gateway.protocol.errors import Api, Draining, InvalidRequest
from gateway.protocol.reasons import Reason
from gateway.protocol.request import (MAX_SESSION_CHARS, NO_CONTEXT, SESSION_HEADER, Context,
                                      GenerationRequest)

if TYPE_CHECKING:
    from gateway.access.control import AccessControl, Grant
    from gateway.autoscale.autoscaler import Autoscaler
    from gateway.autoscale.hold import ScaleFromZero
    from gateway.config import ObjectiveConfig
    from gateway.dataplane.admission import Admission, Admitter
    from gateway.dataplane.outcome import RequestRecord
    from gateway.fleet.model import ServedModel

MAX_HEADER_BYTES = 64 * 1024
# llm-d's fairness id (and the Inference Extension's older name): the flow a request shares
# the queue fairly in, when no API key says it.
FAIRNESS_HEADERS = (b"x-llm-d-inference-fairness-id", b"x-gateway-inference-fairness-id")


def new_request_id() -> str:
    """32 random hex digits (uuid4's shape; a quarter of its cost, paid per request)."""
    return os.urandom(16).hex()


class HeadersTooLarge(InvalidRequest):
    status = 431
    reason = Reason.HEADERS_TOO_LARGE


class Headers(NamedTuple):
    """What the edge reads of a request's headers, in one pass."""

    request_id: str  # the client's ``x-request-id``, or a new one
    session: str | None  # ``x-session-id``
    pool: str | None  # ``x-gateway-pool`` (forced pool)
    authorization: bytes | None
    traceparent: bytes | None  # W3C trace context, for tracing and the access log
    tracestate: bytes | None
    objective: ObjectiveHeaders = NO_HEADERS  # x-gateway-priority, x-slo-*
    objective_name: str | None = None  # x-llm-d-inference-objective (an InferenceObjective)
    fairness: str | None = None  # x-llm-d-inference-fairness-id (the queue's flow, keys off)


# Each objective header's place in ObjectiveHeaders; the objectives' names come 3 places on.
_OBJECTIVE_HEADERS = {PRIORITY_HEADER: 0, TTFT_HEADER: 1, TPOT_HEADER: 2, STRICT_HEADER: 3,
                      LLMD_TTFT_HEADER: 1, LLMD_TPOT_HEADER: 2}


def read_headers(scope: dict) -> Headers:
    """One pass over the headers; raises if the header block is too big.

    uvicorn's httptools parser sets no limit of its own, so the check is made here, where
    the request is refused before anything is read or reserved.
    """
    request_id = session = pool = authorization = traceparent = tracestate = None
    objective_name = fairness = None
    objective: list | None = None
    size = 0
    for key, value in scope["headers"]:
        size += len(key) + len(value)
        if key == b"x-request-id" and 0 < len(value) <= 128:
            # Sent on to the replica as is: printable ASCII only (no header injection).
            text = value.decode("latin-1")
            request_id = text if text.isascii() and text.isprintable() else None
        elif key == SESSION_HEADER and 0 < len(value) <= MAX_SESSION_CHARS:
            session = value.decode("latin-1")
        elif key == POOL_HEADER and value:  # too long names no pool: a 400 then
            pool = value[:MAX_POOL_CHARS + 1].decode("latin-1")
        elif key == b"authorization":
            authorization = value
        elif key == b"x-api-key" and authorization is None:  # Anthropic's clients send it
            authorization = b"Bearer " + value  # (an authorization header after it wins)
        elif key == b"traceparent":
            traceparent = value
        elif key == b"tracestate":
            tracestate = value
        elif key in OBJECTIVE_NAME_HEADERS and 0 < len(value) <= MAX_OBJECTIVE_NAME:
            objective_name = value.decode("latin-1")
        elif key in FAIRNESS_HEADERS and 0 < len(value) <= MAX_SESSION_CHARS:
            fairness = value.decode("latin-1")
        elif key in _OBJECTIVE_HEADERS:
            objective = objective or [*NO_HEADERS]
            place = _OBJECTIVE_HEADERS[key]
            objective[place] = value
            if place in (1, 2):
                objective[place + 3] = key
    if size > MAX_HEADER_BYTES:
        raise HeadersTooLarge(f"request headers are larger than {MAX_HEADER_BYTES} bytes")
    return Headers(request_id or new_request_id(), session, pool, authorization, traceparent,
                   tracestate, NO_HEADERS if objective is None else ObjectiveHeaders(*objective),
                   objective_name, fairness)


class Gate(Protocol):
    """What admission needs of the gateway (``gateway.app.Gateway``)."""

    admitter: "Admitter"
    access: "AccessControl"
    draining: bool
    scale_from_zero: "ScaleFromZero"
    autoscaler: "Autoscaler"
    objectives: "dict[str, ObjectiveConfig]"  # named (InferenceObjectives), from the config


@dataclass(slots=True)
class Admitted:
    """A request past the edge's checks: parsed, admitted, with its key's grant (settle it
    however the request ends)."""

    request: GenerationRequest
    context: Context
    model: "ServedModel"
    admission: "Admission"
    grant: "Grant"


async def admit(gateway: Gate, headers: Headers, read_body: Callable[[], Awaitable[bytes]],
                parse: Callable[[bytes], GenerationRequest], record: "RequestRecord") -> Admitted:
    """Authenticate (before the body: 401 early), read and parse the body, admit it and take
    its key's grant; notes what it learns on ``record``. Raises GatewayError, having reserved
    nothing, when the request is refused."""
    if gateway.draining:
        raise Draining()
    key = gateway.access.authenticate(headers.authorization)
    if key is not None:
        record.key = key.name
    body = await read_body()
    request = record.request = parse(body)
    caller = key.caller if key is not None else None
    # The queue's flow: the key's (a client cannot claim another's share), else the client's
    # fairness id (llm-d's header), else one flow for all.
    flow = caller.name if caller is not None else headers.fairness
    context = (Context(headers.session, headers.pool, caller, flow=flow)
               if headers.session or headers.pool or flow else NO_CONTEXT)
    model = gateway.admitter.model_for(request.model, request.api)
    named = gateway.objectives.get(headers.objective_name) if headers.objective_name else None
    if headers.objective is not NO_HEADERS or model.objective is not None or \
            key is not None or named is not None:  # priority and objectives (gateway.flow)
        context = context._replace(objective=resolve(
            headers.objective, key.objective if key is not None else None,
            key.priority_ceiling if key is not None else None, model.objective, named))
    if gateway.scale_from_zero.holds(model):  # scaled to zero: wait for a replica to appear
        await gateway.scale_from_zero.wait_for_replica(model, context.objective.priority)
    preparing = gateway.admitter.prepare(request)  # an adapter to load, a stored
    if preparing is None:                          # Response's replica, a long count
        model, admission = gateway.admitter.admit(request, context)
    else:
        model, admission = gateway.admitter.admit(request, context, await preparing)
    record.model = model.name
    gateway.autoscaler.arrived(model.name, admission.cost.prompt_tokens)
    # The key's allowlist and limits: the caller settles the grant, however it ends.
    grant = await gateway.access.admit(key, model.name, admission.cost.prompt_tokens,
                                       admission.cost.output_tokens)
    record.admitted_at = time.perf_counter()
    return Admitted(request, context, model, admission, grant)


def model_label_of(admitter: "Admitter", name: str | None, api: Api) -> str:
    """A refused request's model as a metric label: only served names (configured, or
    listed by an engine) become label values (client input never does)."""
    if name is not None and admitter.names.resolve(name) is not None:
        return name
    default = admitter.default_model
    return default if default is not None and (name is None or api is Api.TGI) else "unknown"
