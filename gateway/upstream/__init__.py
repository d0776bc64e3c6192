"""The data path's HTTP/1.1 client to the replicas: keep-alive connections on asyncio
protocols with llhttp (httptools) parsing, and a response body that can be delivered by
callbacks, so the relay forwards each upstream read to the client with no coroutine switch
(``UpstreamPool.request`` -> ``UpstreamResponse``: ``read()`` a whole body, or ``stream(to)``
it into a ``BodyHandler``).

Health checks, discovery and signal scrapes keep aiohttp: they are off the data path.
"""

from gateway.upstream.errors import UpstreamConnectError, UpstreamError, UpstreamTransportError
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.response import BodyHandler, UpstreamResponse

__all__ = ["BodyHandler", "UpstreamConnectError", "UpstreamError", "UpstreamPool",
           "UpstreamResponse", "UpstreamTransportError"]
