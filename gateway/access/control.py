"""Access control on the request path: one object, two calls.

``authenticate`` reads the bearer key before the body is read (an unknown caller costs no
parsing or tokenizing); ``admit`` checks the model allowlist and reserves the key's quota
once the window check has priced the request. The ``Grant`` it returns is settled exactly
once when the request ends, however it ends (served, failed, client gone), returning the
unused part of the reservation at once.
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis

from gateway.access.errors import InvalidApiKey, ModelNotAllowed, RateLimited
from gateway.access.keys import ApiKey, KeyRing
from gateway.access.limits import Limiter, LocalLimiter, Outcome, ratelimit_headers
from gateway.access.secret import bearer, hash_secret, new_secret
from gateway.access.redis_limits import RedisLimiter
from gateway.access.redis_store import RedisKeyStore
from gateway.access.store import KeyConflict, KeyStore, LocalStore
from gateway.config import AuthConfig, KeyLimits, ObjectiveConfig, Settings
from gateway.access.metrics import AccessMetrics
from gateway.metrics import GatewayMetrics
from gateway.shared.redis_keys import SharedKeys
from gateway.balance.redis_ledger import instance_id
from gateway.shared.sync import connect
from gateway.protocol.usage import Usage

log = logging.getLogger(__name__)

_MESSAGES = {
    "concurrent": "Too many concurrent requests for API key `{key}` (limit {conc}).",
    "requests": "Rate limit reached for API key `{key}`: {rpm} requests per {window}.",
    "tokens": "Rate limit reached for API key `{key}`: {tpm} tokens per {window}; this "
              "request reserves {tokens} (prompt + max_tokens).",
    "too_large": "Request too large for API key `{key}`: it reserves {tokens} tokens (prompt + "
                 "max_tokens), more than its limit of {tpm} per {window}. Lower max_tokens.",
}


class Grant:
    """One admitted request's reservation; ``settle`` it once when the request ends."""

    __slots__ = ("key", "limiter", "outcome", "reserved", "prompt_tokens", "headers", "_open")

    def __init__(self, key: ApiKey | None = None, limiter: Limiter | None = None,
                 outcome: Outcome | None = None, reserved: int = 0, prompt_tokens: int = 0,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.key = key
        self.limiter = limiter
        self.outcome = outcome
        self.reserved = reserved
        self.prompt_tokens = prompt_tokens
        self.headers = headers or []  # the x-ratelimit-* headers of every response
        self._open = limiter is not None

    def settle(self, usage: Usage | None) -> None:
        """Return what the request did not use: everything when it got no answer
        (``usage`` None), else its reservation minus the real prompt + output tokens."""
        if not self._open:
            return
        self._open = False
        used = 0
        if usage is not None:
            prompt = usage.prompt_tokens if usage.prompt_tokens is not None else self.prompt_tokens
            output = (usage.completion_tokens if usage.completion_tokens is not None
                      else self.reserved - self.prompt_tokens)
            used = prompt + output
        assert self.key is not None and self.limiter is not None and self.outcome is not None
        self.limiter.release(self.key, self.outcome.lease, self.reserved - used)


OPEN = Grant()  # keys off, or a key without limits: nothing to settle


class AccessControl:
    def __init__(self, auth: AuthConfig | None, limiter: Limiter | None = None,
                 store: KeyStore | None = None) -> None:
        self.enabled = auth is not None
        self.window = auth.window if auth else 60.0
        self.keys = KeyRing([ApiKey.from_config(k) for k in (auth.keys if auth else ())])
        self.limiter: Limiter = limiter or LocalLimiter(self.window)
        self.store: KeyStore = store or LocalStore()
        self._tasks: list[asyncio.Task] = []
        self._redis: Redis | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> "AccessControl":
        """Keys and limits in this process, or shared through Redis with ``redis_url``."""
        auth = settings.auth
        access = cls(auth)
        if auth is None or settings.redis_url is None:
            return access
        # A client of its own: admissions must not queue behind the load sync's rounds.
        access._redis = connect(settings.redis_url, settings.redis_timeout)
        keys = SharedKeys(settings.redis_key_prefix)
        access.limiter = RedisLimiter(access._redis, keys, auth.window,
                                      settings.timeouts.total + 60, instance_id(),
                                      auth.fail_closed, settings.redis_timeout)
        access.store = RedisKeyStore(access._redis, keys, access.keys, auth.refresh_interval,
                                     settings.redis_timeout)
        return access

    async def start(self, metrics: GatewayMetrics) -> None:
        """Read the shared keys once (bounded), then keep them fresh in the background."""
        if isinstance(self.limiter, RedisLimiter):
            registry = metrics.registry  # None when metrics are off
            if registry is not None:
                self.limiter.metrics = AccessMetrics(registry)
        if isinstance(self.store, RedisKeyStore):
            await self.store.refresh()
            self._tasks.append(asyncio.create_task(self.store.run(), name="access-keys"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if isinstance(self.limiter, RedisLimiter):
            await self.limiter.close()
        if self._redis is not None:
            await self._redis.aclose()

    async def create(self, name: str, models: list[str] | None, weight: float,
                     limits: KeyLimits, objective: ObjectiveConfig | None = None,
                     max_priority: int | None = None) -> tuple[ApiKey, str]:
        """A new key (admin API): returns it and its secret, which is never stored."""
        if self.keys.by_name(name) is not None:
            raise KeyConflict(f"an API key named {name!r} exists already")
        secret = new_secret()
        key = ApiKey(name, hash_secret(secret), frozenset(models) if models is not None else None,
                     weight, limits, source="admin", objective=objective,
                     max_priority=max_priority)
        await self.store.add(key)
        self.keys.add_admin(key)
        log.info("API key %r created", name)
        return key, secret

    async def revoke(self, name: str) -> ApiKey | None:
        """Remove an admin-created key here and in the shared store; None if unknown."""
        key = self.keys.by_name(name)
        if key is None and isinstance(self.store, RedisKeyStore):
            await self.store.refresh()  # created elsewhere a moment ago
            key = self.keys.by_name(name)
        if key is not None and key.source == "config":
            raise KeyConflict(f"API key {name!r} is defined in the config file; remove it there")
        removed = await self.store.remove(name)
        key = self.keys.remove_admin(name) or key
        if key is None or not (removed or key.source == "admin"):
            return None
        log.info("API key %r revoked", name)
        return key

    def authenticate(self, authorization: bytes | None) -> ApiKey | None:
        """The caller's key (None when keys are off); InvalidApiKey when missing or unknown."""
        if not self.enabled:
            return None
        token = bearer(authorization)
        key = self.keys.find(hash_secret(token)) if token is not None else None
        if key is None:
            raise InvalidApiKey(given=authorization is not None)
        return key

    async def admit(self, key: ApiKey | None, model: str, prompt_tokens: int,
                    output_tokens: int) -> Grant:
        """Allowlist, then limits: reserve 1 request and prompt + output tokens (else
        RateLimited)."""
        if key is None:
            return OPEN
        if not key.allows(model):
            raise ModelNotAllowed(key.name, model)
        if not key.limited:
            return OPEN
        tokens = prompt_tokens + output_tokens
        outcome = await self.limiter.acquire(key, tokens)
        headers = ratelimit_headers(key, outcome, self.window)
        if outcome.why:
            limits = key.limits
            message = _MESSAGES[outcome.why].format(
                key=key.name, conc=limits.concurrent_requests, rpm=limits.requests_per_minute,
                tpm=limits.tokens_per_minute, tokens=tokens, window=_window_words(self.window))
            raise RateLimited(message, outcome.retry_after, headers)
        return Grant(key, self.limiter, outcome, tokens, prompt_tokens,
                     [(k.encode(), v.encode()) for k, v in headers.items()])


def _window_words(window: float) -> str:
    return "minute" if window == 60 else f"{window:g} s"
