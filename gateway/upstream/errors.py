"""What can go wrong between the gateway and a replica, in the two kinds retries tell apart."""

from __future__ import annotations


class UpstreamError(Exception):
    """The exchange with the replica failed."""


class UpstreamConnectError(UpstreamError):
    """No connection could be made: nothing reached the replica."""


class UpstreamTransportError(UpstreamError):
    """The connection broke or the replica sent something that is not HTTP."""
