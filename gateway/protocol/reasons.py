"""Why a request was answered with an error: one enum, the ``reason`` of every ``GatewayError``.

The metrics' label lists derive from it (``REFUSALS``: the gateway answered itself, counted in
``llm_gateway_rejections_total``), so a new reason cannot be left out of one; the engines' own
failures are counted as upstream errors instead (``llm_gateway_upstream_errors_total``).
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # The request itself.
    BAD_REQUEST = "bad_request"
    BODY_TOO_LARGE = "body_too_large"
    SLOW_CLIENT = "slow_client"
    HEADERS_TOO_LARGE = "headers_too_large"
    UNSUPPORTED_API = "unsupported_api"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    CONTEXT_LENGTH = "context_length"
    UNKNOWN_MODEL = "unknown_model"
    # Its key.
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    RATE_LIMITED = "rate_limited"
    PRIORITY_NOT_ALLOWED = "priority_not_allowed"
    # Room for it.
    NO_REPLICA = "no_replica"
    SCALED_TO_ZERO = "scaled_to_zero"
    OVERLOADED = "overloaded"
    QUEUE_FULL = "queue_full"
    SHED = "shed"
    OBJECTIVE_UNATTAINABLE = "objective_unattainable"
    DRAINING = "draining"
    # Not refusals: an engine failed it (or the gateway did).
    UPSTREAM = "upstream"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    INTERNAL = "internal"


FAILURES = frozenset({Reason.UPSTREAM, Reason.UPSTREAM_UNAVAILABLE, Reason.UPSTREAM_TIMEOUT,
                      Reason.INTERNAL})
# The gateway answered the request itself (the label values of llm_gateway_rejections_total).
REFUSALS = tuple(reason for reason in Reason if reason not in FAILURES)
# Refusals that can come after admission, while placing the request: no replica had room.
PLACEMENT_REFUSALS = frozenset({Reason.NO_REPLICA, Reason.OVERLOADED, Reason.QUEUE_FULL,
                                Reason.SHED, Reason.OBJECTIVE_UNATTAINABLE})
# Refusals of a known key's request (started at zero per key: what its owner watches).
KEY_REFUSALS = (Reason.FORBIDDEN, Reason.RATE_LIMITED, Reason.PRIORITY_NOT_ALLOWED,
                Reason.QUEUE_FULL, Reason.OVERLOADED, Reason.SHED)
