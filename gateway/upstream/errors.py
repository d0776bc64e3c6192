"""What can go wrong between the gateway and a replica, in the two kinds retries tell apart."""

from __future__ import annotations

from gateway.upstream.failure import FailureKind


class UpstreamError(Exception):
    """The exchange with the replica failed."""

    failure = FailureKind.TRANSPORT


class UpstreamConnectError(UpstreamError):
    """No connection could be made: nothing reached the replica."""

    failure = FailureKind.CONNECT


class UpstreamTransportError(UpstreamError):
    """The connection broke or the replica sent something that is not HTTP."""
