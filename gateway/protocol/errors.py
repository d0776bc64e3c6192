"""Typed errors raised inside the gateway, and their bodies in each client protocol.

Errors are raised where they are found and rendered once, at the HTTP edge, in the shape the
client's library parses: OpenAI ``{"error": {"message", "type", "param", "code"}}``, TGI
``{"error": "...", "error_type": "..."}`` and Anthropic
``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import orjson

from gateway.protocol.reasons import Reason
from gateway.upstream.failure import FailureKind


class Api(str, Enum):
    """The protocol a client speaks to the gateway."""

    OPENAI = "openai"
    TGI = "tgi"
    ANTHROPIC = "anthropic"


# Anthropic's error types by HTTP status (its API reference, "Errors"); others: api_error.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


class GatewayError(Exception):
    """An error a client sees. Subclasses fix status, type and metric reason."""

    status: int = 500
    openai_type: str = "server_error"
    tgi_type: str = "generation"
    code: str | None = None
    reason: Reason = Reason.INTERNAL  # fixed label value for the rejection/error metrics
    failure: FailureKind | None = None  # why a replica failed it, if one did (retryable?)
    api: "Api | None" = None  # the client's protocol, where its body told it (TGI's /tokenize)

    def __init__(self, message: str, *, param: str | None = None, status: int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        if status is not None:
            self.status = status

    def tgi_status(self) -> int:
        return self.status

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.openai_type,
                          "param": self.param, "code": self.code}}

    def tgi_body(self) -> dict[str, Any]:
        return {"error": self.message, "error_type": self.tgi_type}

    def anthropic_body(self) -> dict[str, Any]:
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500
                                   else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body(self, api: Api) -> bytes:
        if api is Api.OPENAI:
            return orjson.dumps(self.openai_body())
        if api is Api.ANTHROPIC:
            return orjson.dumps(self.anthropic_body())
        return orjson.dumps(self.tgi_body())

    def status_for(self, api: Api) -> int:
        return self.tgi_status() if api is Api.TGI else self.status

    def sse_event(self, api: Api) -> bytes:
        """The error as a stream event: OpenAI clients then expect ``[DONE]``; TGI's do not;
        Anthropic's read a named ``error`` event."""
        if api is Api.ANTHROPIC:
            return b"event: error\ndata: " + self.body(api) + b"\n\n"
        event = b"data: " + self.body(api) + b"\n\n"
        return event + b"data: [DONE]\n\n" if api is Api.OPENAI else event


class InvalidRequest(GatewayError):
    """Malformed JSON, wrong types, missing fields. TGI answers these with 422; subclasses with
    a more precise status (413, 408, 431) keep it on both protocols."""

    status = 400
    openai_type = "invalid_request_error"
    tgi_type = "validation"
    reason = Reason.BAD_REQUEST

    def tgi_status(self) -> int:
        return 422 if self.status == 400 else self.status


class ContextLengthExceeded(GatewayError):
    """The prompt plus requested output cannot fit any replica's context window."""

    status = 400
    openai_type = "invalid_request_error"
    tgi_type = "validation"
    code = "context_length_exceeded"
    reason = Reason.CONTEXT_LENGTH

    def __init__(self, limit: int, prompt_tokens: int, max_tokens: int | None,
                 api: Api = Api.OPENAI, chat: bool = True) -> None:
        self.limit, self.prompt_tokens, self.max_tokens = limit, prompt_tokens, max_tokens
        part = "messages" if chat else "prompt"  # the field OpenAI names, per route
        if api is Api.TGI:
            message = (f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= "
                       f"{limit}. Given: {prompt_tokens} `inputs` tokens and {max_tokens or 0} "
                       f"`max_new_tokens`")
        elif max_tokens == 0:  # embeddings, score ...: the input alone
            part = "input"
            message = (f"This model's maximum context length is {limit} tokens. However, your "
                       f"input resulted in {prompt_tokens} tokens. Please reduce the length "
                       f"of the input.")
        elif max_tokens is None:
            message = (f"This model's maximum context length is {limit} tokens. However, your "
                       f"{part} resulted in {prompt_tokens} tokens. Please reduce the length "
                       f"of the {part}.")
        else:
            message = (f"This model's maximum context length is {limit} tokens. However, you "
                       f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                       f"{part}, {max_tokens} in the completion). Please reduce the length of "
                       f"the {part} or completion.")
        super().__init__(message, param=part)

    @classmethod
    def output_too_large(cls, limit: int, max_tokens: int, api: Api) -> "ContextLengthExceeded":
        """``max_tokens`` alone exceeds the window (no prompt count needed to know it)."""
        error = cls(limit, 0, max_tokens, api)
        field = "`max_new_tokens`" if api is Api.TGI else "max_tokens"
        error.message = (f"{'Input validation error: ' if api is Api.TGI else ''}{field} "
                         f"({max_tokens}) is larger than the model's maximum context length "
                         f"({limit} tokens)")
        error.param = "max_tokens"
        return error


class ModelNotFound(GatewayError):
    status = 404
    openai_type = "invalid_request_error"
    tgi_type = "validation"
    code = "model_not_found"
    reason = Reason.UNKNOWN_MODEL

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


class ApiNotServed(GatewayError):
    """No replica of the model can serve the client's protocol (an OpenAI chat on a TGI that
    predates its Messages API)."""

    status = 400
    openai_type = "invalid_request_error"
    tgi_type = "validation"
    code = "unsupported_api"
    reason = Reason.UNSUPPORTED_API


class NoReplicaAvailable(GatewayError):
    status = 503
    openai_type = "server_error"
    tgi_type = "overloaded"
    code = "no_replica_available"
    reason = Reason.NO_REPLICA


class Overloaded(GatewayError):
    """Every replica is at its in-flight limit and the gateway's queue is full or timed out.
    429 with ``Retry-After``: the OpenAI client honours it; TGI's own words for TGI clients."""

    status = 429
    openai_type = "rate_limit_error"
    tgi_type = "overloaded"
    code = "overloaded"
    reason = Reason.OVERLOADED

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after)})

    def tgi_body(self) -> dict[str, Any]:
        return {"error": "Model is overloaded", "error_type": "overloaded"}


class QueueFull(Overloaded):
    """The caller (an API key) already has its share of the queue waiting: its own flood
    waits or is refused, not everyone's requests."""

    code = "queue_full"
    reason = Reason.QUEUE_FULL


class Shed(Overloaded):
    """Every replica that could serve the request is saturated and its priority is
    sheddable (negative): refused at once rather than queued (``gateway.flow``)."""

    code = "shed"
    reason = Reason.SHED


class ObjectiveUnattainable(Overloaded):
    """No replica is predicted to meet the request's latency objective and it asked to be
    refused then (``x-slo-strict: true``) rather than served late."""

    code = "objective_unattainable"
    reason = Reason.OBJECTIVE_UNATTAINABLE


class ScaledToZero(GatewayError):
    """The model has no replica (scaled to zero) and none appeared while the request was held
    (``gateway.autoscale.hold``): 503 with ``Retry-After``, as an engine still starting."""

    status = 503
    openai_type = "server_error"
    tgi_type = "overloaded"
    code = "scaled_to_zero"
    reason = Reason.SCALED_TO_ZERO

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after)})


class Draining(GatewayError):
    """The gateway is shutting down: in-flight work finishes, new work goes elsewhere."""

    status = 503
    openai_type = "server_error"
    tgi_type = "overloaded"
    code = "draining"
    reason = Reason.DRAINING

    def __init__(self) -> None:
        super().__init__("the gateway is shutting down; retry on another instance")


class EngineError(GatewayError):
    """An engine's own error (4xx/5xx), carried to the client in the client's shape. Its
    failure kind is the engine's status's (a context refusal the engine sent as 5xx is
    still a 5xx of the replica)."""

    openai_type = "upstream_error"
    reason = Reason.UPSTREAM

    def __init__(self, message: str, status: int, engine_type: str | None = None,
                 code: str | None = None, param: str | None = None,
                 tgi_type: str | None = None, failure: FailureKind | None = None) -> None:
        super().__init__(message, status=status, param=param)
        self.failure = failure or FailureKind.of_status(status)
        if status < 500:
            self.openai_type = "invalid_request_error"
            self.tgi_type = "validation"
        if status == 429:
            self.tgi_type = "overloaded"
        self.tgi_type = tgi_type or self.tgi_type
        self.engine_type = engine_type
        self.code = code
        self.tgi_status_override: int | None = None  # an OpenAI engine's error for a TGI client
        if code == "context_length_exceeded":
            self.reason = Reason.CONTEXT_LENGTH

    def tgi_status(self) -> int:
        return self.tgi_status_override or self.status


class UpstreamUnavailable(GatewayError):
    """The engine could not be reached, broke the exchange, or did not answer in time."""

    status = 502
    openai_type = "server_error"
    tgi_type = "generation"
    reason = Reason.UPSTREAM_UNAVAILABLE

    def __init__(self, message: str, failure: FailureKind = FailureKind.TRANSPORT) -> None:
        super().__init__(message)
        self.failure = failure


class UpstreamTimeout(UpstreamUnavailable):
    status = 504
    reason = Reason.UPSTREAM_TIMEOUT

    def __init__(self, message: str, failure: FailureKind = FailureKind.TIMEOUT) -> None:
        super().__init__(message, failure)


_CONTEXT_MARKERS = ("maximum context length", "context length", "context size",
                    "`inputs` tokens + `max_new_tokens`", "max_model_len")


def error_from_engine(status: int, body: bytes) -> EngineError:
    """Read any engine's error body (vLLM nested or flat, SGLang, llama.cpp, TGI).

    An engine's context-window rejection keeps status 400 and gains OpenAI's
    ``context_length_exceeded`` code, so clients see one shape whichever engine said it.
    """
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    message, engine_type, param, tgi_type = "", None, None, None
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict):  # OpenAI/vLLM nested, vLLM<=0.10.0/SGLang flat, llama.cpp
            message = str(error.get("message", ""))
            engine_type = error.get("type")
            param = error.get("param") if isinstance(error.get("param"), str) else None
        elif isinstance(error, str):  # TGI
            message = error
            tgi_type = parsed.get("error_type") if isinstance(parsed.get("error_type"), str) else None
    if not message:
        message = body[:500].decode("utf-8", errors="replace") or f"engine returned HTTP {status}"
    is_context = engine_type == "exceed_context_size_error" or (
        400 <= status < 500 and any(m in message for m in _CONTEXT_MARKERS))
    if is_context:
        return EngineError(message, 400, engine_type, code="context_length_exceeded",
                           param=param, tgi_type="validation",
                           failure=FailureKind.of_status(status))
    return EngineError(message, status, engine_type, param=param, tgi_type=tgi_type)
