"""The fleet's canary samples in Redis: every instance's requests, one bounded store per pool.

Recording stays local and synchronous (gateway/canary/samples.py): each record is also
queued here, and a background task sends the queue every ``interval`` seconds in one
pipelined round trip (RPUSH, LTRIM to the last ``per_pool``, PEXPIRE per list). No request
waits on Redis. A report first sends what this instance still holds, then reads the lists of
the pools it judges: whichever instance is asked, the same records, each tagged with the
instance that recorded it (so the report says how many contributed).

Redis down only fails rounds: the queue is kept (bounded: the oldest records go first) and
sent at the first good round, with one log line when it fails and one when it is back; a
report that cannot read the store judges this instance's own rings and says so. A round that
timed out may have reached Redis all the same, so it is sent again and the entries carry the
instance's tag and a sequence number: reading keeps each (tag, number) once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections import deque
from typing import Iterable

from redis.asyncio import Redis

from gateway.canary.samples import PairSample, Record, Sample
from gateway.shared.redis_keys import SharedKeys

log = logging.getLogger(__name__)

KEEP_FOR_MS = 7 * 86400 * 1000  # the longest window a report may ask for; then a list expires


def _number(value: float | None) -> str:
    return "" if value is None else format(value, ".6g")


def _parse(text: str) -> float | None:
    return float(text) if text else None


def encode(record: Record, tag: str, number: int) -> str:
    """One list entry: ``at tag number fields...`` separated by spaces (empty for None)."""
    head = f"{record.at:.3f} {tag} {number}"
    if isinstance(record, PairSample):
        return f"{head} {''.join('1' if f else '0' for f in record[1:])}"
    return " ".join((head, "1" if record.error else "0", *map(_number, record[2:])))


def _entries(entries: Iterable[str], since: float,
             size: int) -> Iterable[tuple[float, str, list[str]]]:
    """(at, tag, fields) of each entry of ``size`` parts at or after ``since``, each (tag,
    number) once."""
    seen: set[tuple[str, str]] = set()
    for entry in entries:
        parts = entry.split(" ")
        if len(parts) != size:
            continue
        try:
            at = float(parts[0])
        except ValueError:
            continue
        if at >= since and (parts[1], parts[2]) not in seen:
            seen.add((parts[1], parts[2]))
            yield at, parts[1], parts[3:]


def decode_samples(entries: Iterable[str], since: float, tags: set[str]) -> list[Sample]:
    """The requests that ended at or after ``since`` (malformed entries skipped); adds their
    instances' tags to ``tags``."""
    out = []
    for at, tag, fields in _entries(entries, since, 8):
        try:
            out.append(Sample(at, fields[0] == "1", *map(_parse, fields[1:])))
        except ValueError:
            continue
        tags.add(tag)
    return out


def decode_pairs(entries: Iterable[str], since: float, tags: set[str]) -> list[PairSample]:
    """The pairs that ended at or after ``since`` (malformed entries skipped)."""
    out = []
    for at, tag, (flags,) in _entries(entries, since, 4):
        # Four flags: written before skipped copies were recorded (skipped is then False).
        if len(flags) in (4, 5) and set(flags) <= {"0", "1"}:
            out.append(PairSample(at, *(f == "1" for f in flags)))
            tags.add(tag)
    return out


class FleetSamples:
    def __init__(self, redis: Redis, keys: SharedKeys, per_pool: int, interval: float,
                 timeout: float, name: str = "redis") -> None:
        self.redis = redis
        self.keys = keys
        self.per_pool = per_pool
        self.interval = interval
        self.timeout = timeout
        self.name = name  # how logs call the Redis server (no credentials)
        self.tag = secrets.token_hex(4)  # this instance, in every entry it adds
        self._numbers = itertools.count()
        self._queue: dict[str, deque[str]] = {}  # list key -> entries not yet sent
        self._keys: dict[tuple[str, str, bool], str] = {}
        self.up: bool | None = None

    def _key(self, model: str, pool: str, pair: bool) -> str:
        key = self._keys.get((model, pool, pair))
        if key is None:
            key = self._keys[(model, pool, pair)] = (self.keys.canary_pairs(model, pool) if pair
                                                     else self.keys.canary_samples(model, pool))
        return key

    def queue(self, model: str, pool: str, record: Record) -> None:
        """SampleBook's outbox: keep the record for the next round (no I/O)."""
        key = self._key(model, pool, isinstance(record, PairSample))
        entries = self._queue.get(key)
        if entries is None:
            entries = self._queue[key] = deque(maxlen=self.per_pool)
        entries.append(encode(record, self.tag, next(self._numbers)))

    async def send(self) -> None:
        """One round trip with everything queued (raises on Redis errors; kept for later)."""
        if not self._queue:
            return
        batch, self._queue = self._queue, {}
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for key, entries in batch.items():
                    pipe.rpush(key, *entries)
                    pipe.ltrim(key, -self.per_pool, -1)
                    pipe.pexpire(key, KEEP_FOR_MS)
                await pipe.execute()
        except BaseException:
            for key, entries in batch.items():  # older first, then what came meanwhile
                entries.extend(self._queue.get(key, ()))
                self._queue[key] = entries
            raise

    async def read(self, model: str, pools: list[str]) -> dict[str, tuple[list[str], list[str]]]:
        """Send this instance's queue, then every entry of the pools' lists (raises when
        Redis does not answer within the timeout)."""
        async with asyncio.timeout(max(self.timeout, 1.0)):
            await self.send()
            async with self.redis.pipeline(transaction=False) as pipe:
                for pool in pools:
                    pipe.lrange(self._key(model, pool, False), 0, -1)
                    pipe.lrange(self._key(model, pool, True), 0, -1)
                replies = await pipe.execute()
        return {pool: (replies[2 * i], replies[2 * i + 1]) for i, pool in enumerate(pools)}

    async def run(self) -> None:
        """Send every ``interval`` (cancel to stop); fail-open."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                async with asyncio.timeout(max(self.timeout, 1.0)):
                    await self.send()
            except Exception as exc:  # noqa: BLE001 - Redis away: samples stay local
                if self.up is not False:
                    log.warning("canary samples: %s unreachable (%s); reports judge this "
                                "instance's samples until it is back", self.name,
                                type(exc).__name__)
                self.up = False
                continue
            if self.up is False:
                log.warning("canary samples: sending to %s again", self.name)
            self.up = True

    async def close(self) -> None:
        """Send what is left (best effort, bounded): a stopping instance's last requests
        still count."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout):
                await self.send()
