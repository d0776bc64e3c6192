"""A load ledger shared by every gateway instance through Redis, off the request path.

Each instance keeps its own load exactly, in process, as ``InProcessLedger`` does: leases
change it synchronously and it can never go negative. Every sync round (``sync``, run by
``gateway.shared.sync.SharedStateSync``) publishes those totals to this instance's own key,
refreshes its heartbeat, and reads every other live instance's last published totals, all in
one Lua script (one round trip). ``load()`` is then

    own exact load + sum of the other live instances' last published load

Rounds run every ``redis_sync_interval`` and at once when a request is placed or ends or a
prompt is prefilled here (``wake``); such a round announces itself on a pub/sub channel so
that peers sync at once too. Bounds (interval = ``redis_sync_interval``, ttl =
``redis_peer_ttl``):

- a peer's placed or ended request is seen here within a few Redis round trips; smaller
  changes (tokens streamed) and lost announcements within about 2 x interval;
- a peer killed with SIGKILL stops counting within ttl + interval (its heartbeat expires);
- with Redis unreachable, peers' last totals are kept for at most ttl after the last good
  round and then dropped (own load only): fail-open, never stuck on phantom load.

Nothing here can go negative: own totals come from leases, peers' totals are parsed as
non-negative numbers and replaced wholesale every round (never incremented remotely).
"""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
import secrets
import socket

from redis.asyncio import Redis

from gateway.balance.ledger import LoadLedger, ReplicaLoad
from gateway.shared.redis_keys import SharedKeys

# Own changes at least this big (or a request placed or ended) are announced to peers at once.
ANNOUNCE_TOKENS = 64

# KEYS: instances zset, own load hash. ARGV: instance id, ttl ms, load key prefix, channel to
# announce a change on ("" = none), then (replica, outstanding tokens, in flight, prefill
# tokens) quadruples.
# Returns [peer id, [field, value, ...], ...].
_SYNC = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('DEL', KEYS[2])
for i = 5, #ARGV, 4 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1] .. ' ' .. ARGV[i + 2] .. ' ' .. ARGV[i + 3])
end
if #ARGV > 4 then redis.call('PEXPIRE', KEYS[2], ttl) end
if ARGV[4] ~= '' then redis.call('PUBLISH', ARGV[4], ARGV[1]) end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local out = {}
for _, peer in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if peer ~= ARGV[1] then
    out[#out + 1] = peer
    out[#out + 1] = redis.call('HGETALL', ARGV[3] .. peer)
  end
end
return out
"""


def parse_load(value: str) -> ReplicaLoad | None:
    """``"<tokens> <in_flight> <prefill tokens>"`` -> ReplicaLoad; None if malformed or
    negative. The two-number form of earlier versions is read as no prefill (rolling upgrade)."""
    parts = value.split()
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        return None
    return ReplicaLoad(*map(int, parts))


class RedisLedger(LoadLedger):
    """Own load exact and local; peers' load as of the last sync round."""

    def __init__(self, keys: SharedKeys, instance: str, peer_ttl: float) -> None:
        self.keys = keys
        self.instance = instance
        self.peer_ttl = peer_ttl
        self.peers: dict[str, dict[str, ReplicaLoad]] = {}  # live peer -> its published load
        self._own: defaultdict[str, ReplicaLoad] = defaultdict(ReplicaLoad)
        self._view: defaultdict[str, ReplicaLoad] = defaultdict(ReplicaLoad)  # own + others
        self._script = None
        # Set on a change peers should hear of soon (a request placed or ended, a prompt
        # prefilled): the sync task publishes at once instead of at its next interval.
        self.wake = asyncio.Event()
        self._announce = False

    # --- the LoadLedger interface: local, synchronous, no I/O ---

    def load(self, replica: str) -> ReplicaLoad:
        return self._view[replica]

    def own_load(self, replica: str) -> ReplicaLoad:
        return self._own[replica]

    def _adjust(self, replica: str, tokens: int, requests: int, prefill: int = 0) -> None:
        self.own_load(replica).add(tokens, requests, prefill)
        self.load(replica).add(tokens, requests, prefill)
        if requests or abs(tokens) >= ANNOUNCE_TOKENS:
            self._announce = True
            self.wake.set()

    def snapshot(self) -> dict[str, ReplicaLoad]:
        return {name: load.copy() for name, load in self._view.items()}

    # --- sharing ---

    def set_peers(self, peers: dict[str, dict[str, ReplicaLoad]]) -> None:
        """Replace what the other instances contribute (wholesale: nothing accumulates)."""
        self.peers = peers
        others: dict[str, ReplicaLoad] = {}
        for loads in peers.values():
            for replica, load in loads.items():
                others.setdefault(replica, ReplicaLoad()).add(
                    load.outstanding_tokens, load.in_flight, load.prefill_tokens)
        none = ReplicaLoad()
        for replica in self._view.keys() | others.keys() | self._own.keys():
            own, other, view = self.own_load(replica), others.get(replica, none), self.load(replica)
            view.outstanding_tokens = own.outstanding_tokens + other.outstanding_tokens
            view.in_flight = own.in_flight + other.in_flight
            view.prefill_tokens = own.prefill_tokens + other.prefill_tokens

    async def sync(self, redis: Redis) -> None:
        """One round trip: publish own load and heartbeat, read the live peers' load."""
        if self._script is None:
            self._script = redis.register_script(_SYNC)
        announce, self._announce = self._announce, False
        args: list[str | int] = [self.instance, int(self.peer_ttl * 1000), self.keys.load_prefix,
                                 self.keys.load_events if announce else ""]
        for replica, load in self._own.items():
            if load.outstanding_tokens or load.in_flight:
                args += [replica, load.outstanding_tokens, load.in_flight, load.prefill_tokens]
        try:
            reply = await self._script(keys=[self.keys.instances, self.keys.load(self.instance)],
                                       args=args, client=redis)
        except BaseException:
            self._announce = self._announce or announce  # not published: next round
            raise
        peers: dict[str, dict[str, ReplicaLoad]] = {}
        for peer, fields in zip(reply[::2], reply[1::2]):
            loads = peers[peer] = {}
            for replica, value in zip(fields[::2], fields[1::2]):
                load = parse_load(value)
                if load is not None:
                    loads[replica] = load
        self.set_peers(peers)

    def stale(self) -> None:
        """Redis has been unreachable for longer than the peer TTL: trust own load only."""
        if self.peers:
            self.set_peers({})

    async def withdraw(self, redis: Redis) -> None:
        """Graceful stop: leave the shared view at once instead of after the TTL."""
        async with redis.pipeline(transaction=True) as pipe:
            pipe.zrem(self.keys.instances, self.instance)
            pipe.delete(self.keys.load(self.instance))
            await pipe.execute()


def instance_id() -> str:
    """Unique per process and start: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
