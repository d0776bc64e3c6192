"""One generation request, whatever protocol it came in, and the field checks shared by all.

Parsing keeps the client's JSON as it is (it is forwarded to an engine of the same dialect
untouched unless the gateway must add something), and pulls out only what routing needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from gateway.flow.objective import DEFAULT_OBJECTIVE, Objective
from gateway.protocol.errors import Api, InvalidRequest

MAX_JSON_DEPTH = 64


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: an API key's name (the only part of a key that may become a metric
    label) and its weight in fair sharing. Known once the key is authenticated (keys on),
    carried in the edge's ``Context``."""

    name: str
    weight: float = 1.0


class GenerationRequest(NamedTuple):
    """The client's request as parsed: what it asked, never what a stage decided about it.

    Immutable (assigning a field raises): each stage returns what it decided as its own
    result (the edge's ``Context``, admission's ``Admission``, the translation plan), so
    nothing downstream has to guess which stage changed what. A canary shadow copy is
    another request (``_replace``). A named tuple, not a frozen dataclass: a frozen
    dataclass's ``__init__`` costs about 1.5 µs more per request.
    """

    api: Api
    path: str  # the engine route it maps to, e.g. "/v1/chat/completions", "/generate"
    body: dict[str, Any]
    raw: bytes
    model: str | None
    stream: bool
    max_tokens: int | None  # requested output tokens (None: engine default)
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    messages: list[dict[str, Any]] | None = None
    wants_usage: bool = False  # the client asked for the usage chunk of a stream
    choices: int = 1  # OpenAI ``n``: output is generated this many times
    shadow: bool = False  # a canary shadow copy: its answer goes nowhere, its failures count nowhere
    pooling: bool = False  # generates nothing (embeddings, score, tokenize ...): no output cost
    previous_response_id: str | None = None  # Responses API: continues a stored response
    # The same request as an OpenAI chat body, when it came in a protocol that converts to
    # one (Anthropic's Messages API): what the chat template renders, what a chat engine gets.
    as_chat: dict[str, Any] | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


class Context(NamedTuple):
    """What the edge knows of a request beside its body: the client's session
    (``x-session-id``, for stickiness), a pool it forces (``x-gateway-pool``, for testers;
    a shadow copy's pool), the API key that sent it (None: keys are off), its priority
    and latency objectives (``gateway.flow.objective``) and the flow it shares the queue
    fairly in: its key's, else the client's fairness id (llm-d's
    ``x-llm-d-inference-fairness-id``), else None (one flow)."""

    session: str | None = None
    pool: str | None = None
    caller: Caller | None = None
    objective: Objective = DEFAULT_OBJECTIVE
    flow: str | None = None


NO_CONTEXT = Context()  # shared by every request that brings none (no allocation)


SESSION_HEADER = b"x-session-id"
MAX_SESSION_CHARS = 256  # longer session ids are ignored (the balancer remembers sessions)


def parse_json_object(raw: bytes, api: Api) -> dict[str, Any]:
    """The request body as a JSON object, or a 4xx naming what is wrong."""
    if not raw:
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, not {type(body).__name__}")
    if _depth(body) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
    return body


def _depth(value: Any, level: int = 1) -> int:
    if level > MAX_JSON_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level)
    return level


_TYPE_NAMES = {str: "a string", bool: "a boolean", int: "an integer", dict: "an object",
               list: "an array", float: "a number"}


def field(body: dict[str, Any], name: str, kind: type, *, required: bool = False,
          minimum: int | None = None, where: str = "") -> Any:
    """``body[name]`` checked against ``kind`` (and ``minimum``); None when absent."""
    value = body.get(name)
    label = f"{where}{name}"
    if value is None:
        if required:
            raise InvalidRequest(f"`{label}` is required", param=label)
        return None
    # bool is an int in Python; JSON true is not a number of tokens.
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise InvalidRequest(f"`{label}` must be {_TYPE_NAMES.get(kind, kind.__name__)}, "
                             f"got {orjson.dumps(value)[:80].decode(errors='replace')}", param=label)
    if minimum is not None and value < minimum:
        raise InvalidRequest(f"`{label}` must be at least {minimum}, got {value}", param=label)
    return value
