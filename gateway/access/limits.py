"""Per-key limits as token buckets, in this process: requests per minute, tokens per minute,
concurrent requests.

A bucket holds up to ``limit`` and refills at ``limit / window`` per second (OpenAI's model:
the ``reset`` headers say when it is full again). A request takes 1 from the requests
bucket and its reservation (prompt + max_tokens) from the tokens bucket at admission; when
it ends the unused part goes back at once (or the overrun is taken: a bucket may go below
zero, and later requests wait for it). Redis runs the same arithmetic (redis_limits.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

from gateway.access.keys import ApiKey


@dataclass(slots=True)
class Outcome:
    """What one admission found: refused (``why`` set) or admitted, and the levels after."""

    why: str  # "" (admitted), "concurrent", "requests", "tokens", "too_large"
    retry_after: float  # seconds
    requests_left: float
    tokens_left: float
    lease: object = None  # what ``release`` needs back (None when refused)


class Limiter(Protocol):
    async def acquire(self, key: ApiKey, tokens: int) -> Outcome: ...

    def release(self, key: ApiKey, lease: object, tokens_back: int) -> None: ...


@dataclass(slots=True)
class Bucket:
    level: float
    at: float

    def refill(self, now: float, capacity: int, window: float) -> float:
        self.level = min(capacity, self.level + (now - self.at) * capacity / window)
        self.at = now
        return self.level


@dataclass(slots=True)
class _KeyState:
    requests: Bucket
    tokens: Bucket
    in_flight: int = 0


class LocalLimiter:
    """This process's buckets (no Redis, or Redis unreachable and failing open)."""

    def __init__(self, window: float, clock=time.monotonic) -> None:
        self.window = window
        self.clock = clock
        self._state: dict[str, _KeyState] = {}

    def _of(self, key: ApiKey, now: float) -> _KeyState:
        state = self._state.get(key.name)
        if state is None:
            limits = key.limits
            state = self._state[key.name] = _KeyState(
                Bucket(float(limits.requests_per_minute or 0), now),
                Bucket(float(limits.tokens_per_minute or 0), now))
        return state

    async def acquire(self, key: ApiKey, tokens: int) -> Outcome:
        return self.acquire_now(key, tokens)

    def acquire_now(self, key: ApiKey, tokens: int) -> Outcome:
        now = self.clock()
        state, limits, window = self._of(key, now), key.limits, self.window
        rpm, tpm, conc = (limits.requests_per_minute, limits.tokens_per_minute,
                          limits.concurrent_requests)
        requests = state.requests.refill(now, rpm, window) if rpm else 0.0
        level = state.tokens.refill(now, tpm, window) if tpm else 0.0
        why, wait = "", 0.0
        if conc and state.in_flight >= conc:
            why, wait = "concurrent", 1.0
        elif rpm and requests < 1:
            why, wait = "requests", (1 - requests) * window / rpm
        elif tpm and tokens > tpm:
            why, wait = "too_large", window
        elif tpm and level < tokens:
            why, wait = "tokens", (tokens - level) * window / tpm
        if why:
            return Outcome(why, wait, requests, level)
        if rpm:
            state.requests.level -= 1
        if tpm:
            state.tokens.level -= tokens
        state.in_flight += 1
        return Outcome("", 0.0, state.requests.level, state.tokens.level, lease=self)

    def release(self, key: ApiKey, lease: object, tokens_back: int) -> None:
        state = self._state.get(key.name)
        if state is None:
            return
        state.in_flight = max(state.in_flight - 1, 0)
        tpm = key.limits.tokens_per_minute
        if tpm and tokens_back:
            state.tokens.refill(self.clock(), tpm, self.window)
            state.tokens.level = min(tpm, state.tokens.level + tokens_back)

    def in_flight(self, name: str) -> int:
        state = self._state.get(name)
        return state.in_flight if state else 0


def duration(seconds: float) -> str:
    """OpenAI's format of the ``x-ratelimit-reset-*`` headers: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(int(math.ceil(seconds * 1000)), 0)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s" if seconds < 10 else f"{int(round(seconds))}s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest}s"


def ratelimit_headers(key: ApiKey, outcome: Outcome, window: float) -> dict[str, str]:
    """OpenAI's six headers (those of the limits the key has)."""
    headers: dict[str, str] = {}
    rpm, tpm = key.limits.requests_per_minute, key.limits.tokens_per_minute
    if rpm:
        left = outcome.requests_left
        headers["x-ratelimit-limit-requests"] = str(rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(int(left), 0))
        headers["x-ratelimit-reset-requests"] = duration((rpm - left) * window / rpm)
    if tpm:
        left = outcome.tokens_left
        headers["x-ratelimit-limit-tokens"] = str(tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(int(left), 0))
        headers["x-ratelimit-reset-tokens"] = duration((tpm - left) * window / tpm)
    return headers
