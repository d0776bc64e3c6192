"""Load generator for OpenAI and TGI endpoints: the engine of ``llm-gateway bench`` and of the
benchmark suites (``benchmarks.overhead``, ``benchmarks.suite``).

A minimal HTTP/1.1 keep-alive client written on asyncio protocols (one parser per connection,
pre-encoded requests, one timestamp per received chunk), because a client library costs more
CPU per request and per token than the gateway it measures. It speaks OpenAI
``/v1/completions`` and ``/v1/chat/completions`` and TGI ``/generate`` and
``/generate_stream``, streaming or not, over http or https.

Programmatic API::

    import asyncio
    from gateway.bench.loadgen import Target, closed_loop, open_loop, poisson_arrivals
    from gateway.bench.workload import Lengths, synthetic_requests

    target = Target("http://127.0.0.1:8080", api="openai", endpoint="/v1/completions",
                    stream=True, model="m")               # or api="tgi" (no model)
    requests = synthetic_requests(200, Lengths.parse("uniform:50:300"), Lengths.parse("64"),
                                  seed=1)                  # or [Request(prompt=..., max_tokens=...)]
    # open loop: request i is due at arrivals[i] seconds after the start, whether or not
    # earlier ones finished (latency is counted from the due time, so a slow client or
    # server cannot hide queueing)
    run = asyncio.run(open_loop(target, requests, poisson_arrivals(rate=20, n=200, seed=1)))
    # closed loop: `users` clients, each sending its next request when the last one ends
    run = asyncio.run(closed_loop(target, requests, users=64, duration=30))

    from gateway.bench.report import summarize
    summarize(run)   # TTFT/ITL/e2e percentiles, tokens/s, errors; overall, per pool, per replica

Both loops stop issuing at ``max_requests`` (closed loop; default: each request once) or after
``duration`` seconds, and every request has a ``timeout``; they return a :class:`Run` whose
``records`` hold one :class:`Record` per request. Times are ``time.perf_counter()`` seconds;
``Run.started`` is the zero. Output tokens come from the engine's usage
(OpenAI ``usage.completion_tokens``, TGI ``details.generated_tokens``) when the response has it,
else from counted token events; streaming OpenAI requests ask for usage
(``stream_options.include_usage``) and TGI requests for ``details``.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from gateway.bench.connection import Target, _Conn
from gateway.bench.records import (BAD_RESPONSE, CONNECT, DISCONNECTED, INCOMPLETE_STREAM,
                                   STREAM_ERROR, TIMEOUT, Api, Record, Request)

__all__ = ["BAD_RESPONSE", "CONNECT", "DISCONNECTED", "INCOMPLETE_STREAM", "STREAM_ERROR",
           "TIMEOUT", "Api", "Record", "Request", "Run", "Target", "closed_loop", "open_loop",
           "poisson_arrivals"]

_now = time.perf_counter


@dataclass
class Run:
    target: Target
    records: list[Record]
    started: float                  # perf_counter at the start
    ended: float
    mode: str                       # "closed" or "open"
    users: int | None = None
    rate: float | None = None

    @property
    def wall(self) -> float:
        return self.ended - self.started

# Load shapes

OnRecord = Callable[[Record], None]


def poisson_arrivals(rate: float, n: int, seed: int = 0, start: float = 0.0) -> list[float]:
    """``n`` arrival offsets (seconds) of a Poisson process of ``rate`` requests/s, seeded."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    t, out = start, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def _send(target: Target, conn: "_Conn | None", raw: bytes, record: Record,
                timeout: float) -> "_Conn | None":
    """Send on ``conn`` (or a new connection); return the connection if it can be reused."""
    if conn is None or conn.closed:
        try:
            conn = await asyncio.wait_for(target.connect(), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            record.sent = record.end = _now()
            record.error, record.detail = CONNECT, (str(exc) or type(exc).__name__)[:300]
            return None
    await conn.request(raw, record, timeout)
    return None if conn.closed else conn


async def closed_loop(target: Target, requests: Sequence[Request], users: int, *,
                      max_requests: int | None = None, duration: float | None = None,
                      timeout: float = 300.0, on_record: OnRecord | None = None,
                      stop: asyncio.Event | None = None) -> Run:
    """``users`` clients, each with one keep-alive connection, each sending its next request
    as soon as its last one ended. Requests are taken in order (cycling through ``requests``)
    until ``max_requests`` have been sent (default ``len(requests)`` unless ``duration`` or
    ``stop`` is given), ``duration`` seconds have passed or ``stop`` is set; requests in
    flight then finish (bounded by ``timeout``)."""
    if users < 1 or not requests:
        raise ValueError("need at least one user and one request")
    if max_requests is None and duration is None and stop is None:
        max_requests = len(requests)
    raw = [target.encode(r) for r in requests]
    records: list[Record] = []
    counter = itertools.count()
    started = _now()
    deadline = started + duration if duration is not None else float("inf")
    limit = max_requests if max_requests is not None else float("inf")

    async def user(u: int) -> None:
        conn = None
        while True:
            now = _now()
            if now >= deadline or stop is not None and stop.is_set():
                break
            i = next(counter)
            if i >= limit:
                break
            k = i % len(raw)
            record = Record(index=i, due=now, user=u, tag=requests[k].tag)
            conn = await _send(target, conn, raw[k], record, timeout)
            records.append(record)
            if on_record is not None:
                on_record(record)
            if record.error == CONNECT:
                await asyncio.sleep(0.05)      # do not spin on a target that is down
        if conn is not None:
            conn.close()

    try:
        await asyncio.gather(*(user(u) for u in range(users)))
    finally:
        ended = _now()
    records.sort(key=lambda r: r.index)
    return Run(target, records, started, ended, "closed", users=users)


async def open_loop(target: Target, requests: Sequence[Request], arrivals: Sequence[float], *,
                    duration: float | None = None, timeout: float = 300.0,
                    max_in_flight: int = 2048, on_record: OnRecord | None = None,
                    rate: float | None = None) -> Run:
    """Request ``i`` (cycling through ``requests``) is due ``arrivals[i]`` seconds after the
    start, whether or not earlier ones have finished. Connections are reused when idle and
    opened when none is; past ``max_in_flight`` a due request waits for a free slot, and
    that wait counts in its latency. Arrivals later than ``duration`` are not sent."""
    if not requests:
        raise ValueError("need at least one request")
    raw = [target.encode(r) for r in requests]
    records: list[Record] = []
    idle: list[_Conn] = []
    slots = asyncio.Semaphore(max_in_flight)
    tasks: set[asyncio.Task] = set()
    started = _now()

    async def one(i: int, due: float) -> None:
        k = i % len(raw)
        record = Record(index=i, due=due, tag=requests[k].tag)
        async with slots:
            conn = None
            while idle and conn is None:
                candidate = idle.pop()
                conn = None if candidate.closed else candidate
            conn = await _send(target, conn, raw[k], record, timeout)
            if conn is not None:
                idle.append(conn)
        records.append(record)
        if on_record is not None:
            on_record(record)

    try:
        for i, offset in enumerate(arrivals):
            if duration is not None and offset > duration:
                break
            due = started + offset
            delay = due - _now()
            if delay > 0.0005:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(one(i, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        for conn in idle:
            conn.close()
        ended = _now()
    records.sort(key=lambda r: r.index)
    return Run(target, records, started, ended, "open", rate=rate)
