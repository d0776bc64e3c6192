"""Where each stored Response lives. vLLM keeps stored responses in its own process, so a
request that continues one (``previous_response_id``) or reads it (``GET
/v1/responses/{id}``) must reach the replica that stored it; any other replica would answer
404, or worse, a wrong conversation.

The home of each response is recorded when its attempt ends (the ``ResponseHomesRecord``
outcome listener, registered at wiring, reads the id the answer carried) and looked up at
admission, which pins the request to that replica.
One instance keeps them in process (bounded, oldest forgotten first); with ``redis_url``
every instance shares them in Redis (``{prefix}response:{id}``, expiring after
``ttl``): one read per request that names a previous response, one write per stored
response, never on other requests. A home that is unknown, forgotten or gone is a 404.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from gateway.shared.redis_keys import SharedKeys

log = logging.getLogger(__name__)


class ResponseHomes:
    def __init__(self, capacity: int = 100_000, ttl: float = 86400.0,
                 redis: "Redis | None" = None, keys: "SharedKeys | None" = None,
                 timeout: float = 0.5) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self.redis, self.keys, self.timeout = redis, keys, timeout
        self._homes: OrderedDict[str, str] = OrderedDict()  # response id -> replica name
        self._writes: set[asyncio.Task] = set()

    def record(self, response_id: str, replica: str) -> None:
        self._homes[response_id] = replica
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)
        if self.redis is not None:
            task = asyncio.create_task(self._share(response_id, replica))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _share(self, response_id: str, replica: str) -> None:
        assert self.redis is not None and self.keys is not None
        try:
            async with asyncio.timeout(self.timeout):
                await self.redis.set(self.keys.response_home(response_id), replica,
                                     px=int(self.ttl * 1000))
        except Exception as exc:  # Redis down: this instance still knows it
            log.warning("could not share where response %s lives: %s", response_id, exc)

    async def home(self, response_id: str) -> str | None:
        """The replica that stored ``response_id``, or None when unknown."""
        home = self._homes.get(response_id)
        if home is not None or self.redis is None:
            return home
        assert self.keys is not None
        try:
            async with asyncio.timeout(self.timeout):
                value = await self.redis.get(self.keys.response_home(response_id))
        except Exception as exc:
            log.warning("could not read where response %s lives: %s", response_id, exc)
            return None
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

