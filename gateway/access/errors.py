"""The errors access control raises, in each client protocol's shape (see
gateway/protocol/errors.py): the ``openai`` client maps 401/403/429 to AuthenticationError,
PermissionDeniedError and RateLimitError; TGI's ``error_type`` ``overloaded`` is what the
``text-generation`` client maps to OverloadedError."""

from __future__ import annotations

from typing import Any

from gateway.protocol.errors import GatewayError
from gateway.protocol.reasons import Reason


class InvalidApiKey(GatewayError):
    status = 401
    openai_type = "invalid_request_error"
    tgi_type = "unauthorized"
    code = "invalid_api_key"
    reason = Reason.UNAUTHORIZED

    def __init__(self, given: bool) -> None:
        # Never echo what was sent: it may be a real secret with a typo.
        message = ("Incorrect API key provided." if given else
                   "You didn't provide an API key. Send it as `Authorization: Bearer KEY`.")
        super().__init__(message, headers={"www-authenticate": "Bearer"})


class ModelNotAllowed(GatewayError):
    status = 403
    openai_type = "invalid_request_error"
    tgi_type = "forbidden"
    code = "model_not_allowed"
    reason = Reason.FORBIDDEN

    def __init__(self, key: str, model: str) -> None:
        super().__init__(f"The API key `{key}` may not use the model `{model}`.", param="model")


class RateLimited(GatewayError):
    """Over one of the key's limits: 429 with ``Retry-After`` (and ``retry-after-ms``, which
    the openai client prefers) and the ``x-ratelimit-*`` headers."""

    status = 429
    openai_type = "requests"  # OpenAI's own type for rate limits
    tgi_type = "overloaded"
    code = "rate_limit_exceeded"
    reason = Reason.RATE_LIMITED

    def __init__(self, message: str, retry_after: float, headers: dict[str, str]) -> None:
        retry_after = max(retry_after, 0.001)
        super().__init__(message, headers={**headers, "retry-after": str(int(-(-retry_after // 1))),
                                           "retry-after-ms": str(int(retry_after * 1000))})

    def tgi_body(self) -> dict[str, Any]:
        return {"error": f"Rate limit reached: {self.message}", "error_type": "overloaded"}


class LimitsUnavailable(GatewayError):
    """``auth.fail_closed`` and Redis unreachable: a limited key's request is refused."""

    status = 503
    openai_type = "server_error"
    tgi_type = "overloaded"
    code = "limits_unavailable"
    reason = Reason.RATE_LIMITED

    def __init__(self) -> None:
        super().__init__("rate limits cannot be checked right now; retry shortly",
                         headers={"retry-after": "1"})
