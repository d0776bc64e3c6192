"""Per-key limits shared by every instance through Redis: the buckets of limits.py, kept in
Redis and checked and taken in one Lua script per admission (one round trip).

Settling (the unused reservation back, the concurrency slot freed) is a second script, run
off the request path when the request ends; those of requests ending together share one
round trip (EVALSHA pipelined). A concurrency slot is a lease in a sorted set,
scored by its expiry, so an instance that dies mid-request frees it after ``lease_ttl``.

Redis unreachable: fail open (``auth.fail_closed`` false): this instance limits with its own
buckets until Redis answers again (it is retried at most every RETRY_SECONDS, so a dead
Redis costs the request path nothing); one log line and the metric
``llm_gateway_access_limits_shared_up`` per transition. Fail closed: limited keys get 503.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from gateway.access.errors import LimitsUnavailable
from gateway.access.keys import ApiKey
from gateway.access.limits import LocalLimiter, Outcome
from gateway.shared.redis_keys import SharedKeys

log = logging.getLogger(__name__)

RETRY_SECONDS = 0.5  # after a failure, Redis is tried again by the next request this late

# KEYS: bucket hash, leases zset. ARGV: window ms, rpm, tpm, concurrency (0 = no limit),
# tokens to reserve, lease id, lease ttl ms.
# Returns {why, retry ms, requests left, tokens left} (levels as strings: Lua floats).
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
local rpm, tpm, conc = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
local s = redis.call('HMGET', KEYS[1], 'r', 'rt', 't', 'tt')
local function level(cap, v, at)
  if cap == 0 then return 0 end
  if not v then return cap end
  local l = tonumber(v) + (now - tonumber(at)) * cap / window
  if l > cap then return cap end
  return l
end
local r = level(rpm, s[1], s[2])
local tk = level(tpm, s[3], s[4])
local why, wait = '', 0
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= conc then why, wait = 'concurrent', 1000 end
end
if why == '' then
  if rpm > 0 and r < 1 then why, wait = 'requests', math.ceil((1 - r) * window / rpm)
  elseif tpm > 0 and cost > tpm then why, wait = 'too_large', window
  elseif tpm > 0 and tk < cost then why, wait = 'tokens', math.ceil((cost - tk) * window / tpm)
  end
end
if why == '' then
  if rpm > 0 then r = r - 1 end
  if tpm > 0 then tk = tk - cost end
  redis.call('HSET', KEYS[1], 'r', r, 'rt', now, 't', tk, 'tt', now)
  redis.call('PEXPIRE', KEYS[1], window * 4)
  if conc > 0 then
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[7]), ARGV[6])
    redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[7]))
  end
end
return {why, wait, tostring(r), tostring(tk)}
"""

# KEYS: bucket hash, leases zset. ARGV: window ms, tpm, tokens back (negative: overrun),
# lease id.
_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window, tpm, back = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and back ~= 0 then
  local s = redis.call('HMGET', KEYS[1], 't', 'tt')
  local l = tpm
  if s[1] then
    l = tonumber(s[1]) + (now - tonumber(s[2])) * tpm / window
    if l > tpm then l = tpm end
  end
  l = l + back
  if l > tpm then l = tpm end
  redis.call('HSET', KEYS[1], 't', l, 'tt', now)
  redis.call('PEXPIRE', KEYS[1], window * 4)
end
redis.call('ZREM', KEYS[2], ARGV[4])
return 1
"""


class RedisLimiter:
    """The Limiter of limits.py over Redis, with this process's buckets as the fallback."""

    def __init__(self, redis: Redis, keys: SharedKeys, window: float, lease_ttl: float,
                 instance: str, fail_closed: bool = False, timeout: float = 0.5) -> None:
        self.redis = redis
        self.keys = keys
        self.window_ms = int(window * 1000)
        self.lease_ttl_ms = int(lease_ttl * 1000)
        self.instance = instance
        self.fail_closed = fail_closed
        self.timeout = timeout
        self.local = LocalLimiter(window)
        self.up: bool | None = None  # None until the first admission
        self.metrics = None  # AccessMetrics, once the gateway has metrics
        self._acquire = redis.register_script(_ACQUIRE)
        self._settle = redis.register_script(_SETTLE)
        self._ids = itertools.count()
        self._retry_at = 0.0
        self._pending: set[asyncio.Task] = set()
        self._settlements: list[tuple[ApiKey, str, int]] = []

    async def acquire(self, key: ApiKey, tokens: int) -> Outcome:
        if time.monotonic() < self._retry_at:
            return self._fallback(key, tokens)
        limits = key.limits
        lease = f"{self.instance}:{next(self._ids)}"
        call = asyncio.ensure_future(self._acquire(
            keys=self._keys(key),
            args=[self.window_ms, limits.requests_per_minute or 0, limits.tokens_per_minute or 0,
                  limits.concurrent_requests or 0, tokens, lease, self.lease_ttl_ms],
            client=self.redis))
        try:
            # Shielded: a request cancelled here still learns what Redis did, and undoes it.
            async with asyncio.timeout(self.timeout):
                why, wait, requests, level = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: self._undo(key, tokens, lease, done))
            raise
        except Exception as exc:  # noqa: BLE001 - whatever Redis does, fail open or closed
            self._down(exc)
            return self._fallback(key, tokens)
        self._transition(True)
        why = why.decode() if isinstance(why, bytes) else why
        return Outcome(why, int(wait) / 1000, float(requests), float(level),
                       lease=None if why else lease)

    def release(self, key: ApiKey, lease: object, tokens_back: int) -> None:
        if isinstance(lease, LocalLimiter):  # taken while failing open
            lease.release(key, lease, tokens_back)
            return
        self._settlements.append((key, str(lease), tokens_back))
        if len(self._settlements) == 1:  # the first since the last flush: schedule one
            task = asyncio.ensure_future(self._flush())
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _flush(self) -> None:
        """Every settlement waiting now, in one round trip (under load, many)."""
        await asyncio.sleep(0)  # let requests ending in the same loop turn join
        batch, self._settlements = self._settlements, []
        try:
            async with asyncio.timeout(self.timeout):
                if len(batch) == 1:  # EVALSHA, reloading the script if Redis lost it
                    key, lease, back = batch[0]
                    await self._settle(keys=self._keys(key), client=self.redis,
                                       args=self._settle_args(key, lease, back))
                    return
                for _ in range(2):  # a pipeline of EVALSHA; once more if Redis lost the script
                    async with self.redis.pipeline(transaction=False) as pipe:
                        for key, lease, back in batch:
                            pipe.evalsha(self._settle.sha, 2, *self._keys(key),
                                         *self._settle_args(key, lease, back))
                        results = await pipe.execute(raise_on_error=False)
                    if not any(isinstance(r, NoScriptError) for r in results):
                        return
                    await self.redis.script_load(_SETTLE)
        except Exception as exc:  # noqa: BLE001 - the bucket refills anyway; leases expire
            self._down(exc)

    def _keys(self, key: ApiKey) -> list[str]:
        return [self.keys.rate_limit(key.name), self.keys.rate_limit_leases(key.name)]

    def _settle_args(self, key: ApiKey, lease: str, back: int) -> list[int | str]:
        return [self.window_ms, key.limits.tokens_per_minute or 0, back, lease]

    def _undo(self, key: ApiKey, tokens: int, lease: str, done: asyncio.Future) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        if not done.result()[0]:  # it was admitted: give it all back
            self.release(key, lease, tokens)

    def _fallback(self, key: ApiKey, tokens: int) -> Outcome:
        if self.fail_closed:
            raise LimitsUnavailable()
        return self.local.acquire_now(key, tokens)

    def _down(self, exc: Exception) -> None:
        self._retry_at = time.monotonic() + RETRY_SECONDS
        if self.metrics is not None:
            self.metrics.shared_failures.inc()
        if self.up is not False:
            log.warning("API key limits: Redis unreachable (%s); %s until it is back",
                        type(exc).__name__, "refusing limited keys' requests (fail_closed)"
                        if self.fail_closed else "each instance limits on its own (fail open)")
        self._transition(False)

    def _transition(self, up: bool) -> None:
        if self.up is up:
            return
        if up and self.up is False:
            log.warning("API key limits: Redis is back; limits are shared again")
        self.up = up
        if self.metrics is not None:
            self.metrics.shared_up.set(1 if up else 0)

    async def close(self) -> None:
        if self._pending:
            await asyncio.wait(self._pending, timeout=self.timeout)
