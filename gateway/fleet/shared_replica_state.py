"""Outlier ejection and admin draining, the same on every gateway instance.

Code that ejects or drains a replica just sets ``replica.ejected_until`` / ``replica.draining``
as it would with one instance. Each sync round (``sync``) compares them with what the last
round agreed on: a local change is published, otherwise the shared value is adopted.

- ``ejected_until`` (wall clock) merges by max: two instances ejecting the same replica keep
  the later end. Lowering it (an admin lifting the ejection) is published as is.
- ``draining`` is last-writer-wins and persists in Redis until someone undrains, so a
  restarted instance comes up with the fleet's drains in place.
- After a Redis restart without persistence, instances re-seed what they hold (an ejection
  still running, a drain) but never overwrite a value that is there with a default.
"""

from __future__ import annotations

import contextlib
import time
from typing import Sequence

from redis.asyncio import Redis

from gateway.fleet.replica import Replica
from gateway.shared.redis_keys import SharedKeys

# KEYS: ejected_until hash, draining hash. ARGV: now, then per replica:
# name, ejection op (max|set|keep), ejected_until, drain op (set|keep), draining ("1"/"0").
# "keep" re-seeds a missing field only with a non-default value. Returns [until, draining] pairs.
_SYNC = """
local now = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV, 5 do
  local name, eop, untl, dop, drain = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  if eop == 'set' then
    redis.call('HSET', KEYS[1], name, untl)
  elseif eop == 'max' then
    local cur = redis.call('HGET', KEYS[1], name)
    if not cur or tonumber(cur) < tonumber(untl) then redis.call('HSET', KEYS[1], name, untl) end
  elseif tonumber(untl) > now then
    redis.call('HSETNX', KEYS[1], name, untl)
  end
  if dop == 'set' then
    redis.call('HSET', KEYS[2], name, drain)
  elseif drain == '1' then
    redis.call('HSETNX', KEYS[2], name, drain)
  end
  out[#out + 1] = redis.call('HGET', KEYS[1], name) or false  -- nil would end the array
  out[#out + 1] = redis.call('HGET', KEYS[2], name) or false
end
return out
"""


class SharedReplicaState:
    """Publishes local ejection/drain changes and adopts everyone else's, once per round.
    With Redis unreachable it keeps what it has: ejections end by themselves, drains stay."""

    def __init__(self, replicas: Sequence[Replica], keys: SharedKeys) -> None:
        self.replicas = replicas  # the live list: replicas added later are synced too
        self.keys = keys
        # What the last successful round agreed on, per replica: (ejected_until, draining).
        self._agreed = {r.name: (r.ejected_until, r.draining) for r in replicas}
        self._script = None

    async def sync(self, redis: Redis) -> None:
        if self._script is None:
            self._script = redis.register_script(_SYNC)
        replicas = list(self.replicas)  # the list may change during the round trip
        before = {r.name: (r.ejected_until, r.draining) for r in replicas}
        args: list[str | float] = [repr(time.time())]
        for replica in replicas:
            until, draining = before[replica.name]
            agreed_until, agreed_draining = self._agreed.setdefault(replica.name,
                                                                    (until, draining))
            ejection = "max" if until > agreed_until else "set" if until < agreed_until else "keep"
            args += [replica.name, ejection, repr(until),
                     "set" if draining != agreed_draining else "keep", "1" if draining else "0"]
        reply = await self._script(keys=[self.keys.replica_ejected_until,
                                         self.keys.replica_draining], args=args, client=redis)
        for replica, until, draining in zip(replicas, reply[::2], reply[1::2]):
            if (replica.ejected_until, replica.draining) != before[replica.name]:
                continue  # changed locally during the round trip: published next round
            if until is not None:
                with contextlib.suppress(ValueError):
                    replica.ejected_until = float(until)
            if draining is not None:
                replica.draining = draining == "1"
            self._agreed[replica.name] = (replica.ejected_until, replica.draining)

