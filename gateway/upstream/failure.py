"""Why an attempt on a replica failed: one vocabulary for the retry loop, metrics, traces
and the access log.

The kind is fixed where the failure is made (the error carries it, as httpx's exception
classes carry theirs) and never worked out later from a string. Each kind says whether it
may be retried on another replica (only while nothing has reached the client: the retry
loop's own rule) and whether it is the replica's fault (outlier detection); its ``label``
is the value of the ``kind`` label in ``gateway_upstream_errors_total``, of ``error.type``
in traces and of ``error`` in the access log, and ``retry_label`` its value in
``gateway_retries_total``.
"""

from __future__ import annotations

from enum import Enum


class FailureKind(Enum):
    # (label, retryable, replica's fault, retry label when it differs)
    CONNECT = ("connect", True, True)              # no connection: nothing reached the replica
    TRANSPORT = ("transport", True, True)          # the connection broke before an answer
    TIMEOUT = ("timeout", False, True)             # no answer (no first token) in time
    HTTP_4XX = ("http_4xx", False, False)          # the engine refused the request
    HTTP_429 = ("http_4xx", True, False, "http_429")  # the engine is busy, not broken
    HTTP_5XX = ("http_5xx", True, True)
    STREAM_TIMEOUT = ("stream_timeout", False, True)  # too long between tokens, or past the total
    # The stream ended early or broke; retried (as a transport failure) before its first token.
    STREAM_BROKEN = ("stream_broken", True, True, "transport")
    BAD_RESPONSE = ("bad_response", False, True)   # an answer that could not be translated

    def __init__(self, label: str, retryable: bool, replica_fault: bool,
                 retry_label: str | None = None) -> None:
        self.label = label
        self.retryable = retryable
        self.replica_fault = replica_fault
        self.retry_label = retry_label or label

    @classmethod
    def of_status(cls, status: int) -> "FailureKind":
        """An engine's error answer (4xx/5xx) by its status."""
        if status >= 500:
            return cls.HTTP_5XX
        return cls.HTTP_429 if status == 429 else cls.HTTP_4XX


# Label values, in a fixed order, for the series started at zero.
UPSTREAM_ERROR_KINDS = tuple(dict.fromkeys(kind.label for kind in FailureKind))
RETRY_KINDS = tuple(dict.fromkeys(kind.retry_label for kind in FailureKind if kind.retryable))
