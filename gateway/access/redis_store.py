"""Admin-created keys in Redis, shared by every instance.

Create and revoke write the hash ``{p}access:keys`` and publish the key's name on
``{p}access:events``; every instance re-reads the whole hash when it hears one, and every
``refresh_interval`` in any case (a lost message, a Redis restart), replacing its admin keys
wholesale, so a revoked key stops working everywhere within a pub/sub hop (measured in the
README) or at worst one interval. Redis unreachable: instances keep the keys they last read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis.asyncio import Redis

from gateway.access.keys import ApiKey, KeyRing
from gateway.access.store import KeyConflict, StoreUnavailable, dump_key, load_key
from gateway.shared.redis_keys import SharedKeys

log = logging.getLogger(__name__)


class RedisKeyStore:
    def __init__(self, redis: Redis, keys: SharedKeys, ring: KeyRing, interval: float,
                 timeout: float = 0.5) -> None:
        self.redis = redis
        self.keys = keys
        self.ring = ring
        self.interval = interval
        self.timeout = timeout

    async def add(self, key: ApiKey) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                if not await self.redis.hsetnx(self.keys.access_keys, key.name, dump_key(key)):
                    raise KeyConflict(f"an API key named {key.name!r} exists already")
                await self.redis.publish(self.keys.access_events, key.name)
        except (KeyConflict, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001
            raise StoreUnavailable(f"Redis unreachable ({type(exc).__name__}); key not "
                                   f"created") from None

    async def remove(self, name: str) -> bool:
        try:
            async with asyncio.timeout(self.timeout):
                removed = await self.redis.hdel(self.keys.access_keys, name)
                await self.redis.publish(self.keys.access_events, name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise StoreUnavailable(f"Redis unreachable ({type(exc).__name__}); key not "
                                   f"revoked") from None
        return bool(removed)

    async def refresh(self) -> bool:
        """Re-read every admin key; False (nothing changed here) if Redis did not answer."""
        try:
            async with asyncio.timeout(self.timeout):
                stored = await self.redis.hgetall(self.keys.access_keys)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - keep what we have
            return False
        self.ring.set_admin([k for k in map(load_key, stored.values()) if k is not None])
        return True

    async def run(self) -> None:
        """Re-read on every announcement, and every ``interval`` (cancel to stop)."""
        task = asyncio.current_task()
        while task is None or not task.cancelling():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.access_events)
                await self.refresh()  # anything announced before we listened
                while task is None or not task.cancelling():
                    message = await pubsub.get_message(timeout=self.interval)
                    await self.refresh()  # an announcement, or the interval passed
                    del message
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - Redis down: retry after an interval
                await asyncio.sleep(self.interval)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
