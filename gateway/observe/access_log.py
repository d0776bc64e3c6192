"""The access log: one JSON line per client request when it ends, to stdout or a file.

Lines are built from the request's record and its attempts (``RequestRecord``), never from
its body: no prompt, no output text, a key's name but never its secret. They collect in
memory and are written ``flush_interval`` later in one ``write`` (O_APPEND), so each line
lands whole even when several worker processes append to one file, and a request pays no
system call of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from datetime import datetime, timezone
from typing import Any

import orjson

from gateway.config import AccessLogConfig
from gateway.dataplane.outcome import Listener, RequestRecord

log = logging.getLogger(__name__)

_FLUSH_BYTES = 64 * 1024  # written at once past this, whatever the interval


def trace_id_of(traceparent: bytes | None) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<32 hex>-<16 hex>-<2 hex>``), if valid."""
    if traceparent is None or len(traceparent) < 55 or traceparent[2:3] != b"-":
        return None
    trace_id = traceparent[3:35]
    try:
        if int(trace_id, 16) == 0:
            return None
    except ValueError:
        return None
    return trace_id.decode().lower()


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def entry(record: RequestRecord, now_wall: float, now: float) -> dict[str, Any]:
    """The log line's fields. ``now_wall``/``now``: the same instant on the wall clock and on
    ``perf_counter`` (record times are ``perf_counter``)."""
    last = record.last
    request = record.request
    prompt = output = 0
    for attempt in record.attempts:  # as the token counters count them: answered attempts
        if attempt.answered:
            prompt += attempt.usage.prompt_tokens or 0
            output += attempt.usage.completion_tokens or 0
    replica = last.replica if last is not None else None
    ttft = itl = None
    first_at = record.first_token_at
    if first_at is not None:
        ttft = first_at - record.arrival
    if last is not None and last.first_at is not None:
        decode = last.decode
        itl = decode[0] if decode is not None else None
    # Where a stream broke and went on elsewhere: each broken attempt's replica and why.
    migrated = [{"replica": a.replica.name, "broke": a.broke} for a in record.attempts
                if a.broke is not None] or None
    error = record.error
    if error is None and last is not None and last.error is not None:
        error = last.error.label
    arrived = now_wall - (now - record.arrival)
    return {
        "time": datetime.fromtimestamp(arrived, timezone.utc).isoformat(timespec="milliseconds"),
        "request_id": record.request_id,
        "trace_id": record.trace_id or trace_id_of(record.traceparent),
        "api": record.api.value,
        "route": record.route,
        "model": record.model,
        "pool": replica.pool if replica is not None else None,
        "replica": replica.name if replica is not None else None,
        "engine": replica.engine if replica is not None else None,
        "key": record.key,
        "stream": request.stream if request is not None else None,
        "status": record.status,
        "error": error,
        "attempts": len(record.attempts),
        "retries": record.retries,
        "migrated": migrated,
        "queue_wait_s": _seconds(record.queued_for),
        "ttft_s": _seconds(ttft),
        "itl_mean_s": _seconds(itl),
        "e2e_s": _seconds((record.ended_at or now) - record.arrival),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "finish_reason": last.usage.finish_reason if last is not None else None,
        "client_left": record.client_left,
    }


def open_log(path: str) -> int:
    """The file's descriptor, for appending (created if missing)."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)


class AccessLog(Listener):
    """Writes a line per ended client request (a sampled share of them)."""

    def __init__(self, config: AccessLogConfig, rng: random.Random | None = None) -> None:
        self.sampling = config.sampling
        self.interval = config.flush_interval
        self.rng = rng or random.Random()
        self.path = config.path
        self.fd = 1 if config.path == "-" else open_log(config.path)
        self._lines: list[bytes] = []
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None
        self.lost = 0

    def request_ended(self, record: RequestRecord) -> None:
        if self.sampling < 1.0 and self.rng.random() >= self.sampling:
            return
        line = orjson.dumps(entry(record, time.time(), time.perf_counter())) + b"\n"
        self._lines.append(line)
        self._size += len(line)
        if self._size >= _FLUSH_BYTES:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.interval, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines:
            return
        data = b"".join(self._lines)
        self._lines.clear()
        self._size = 0
        view = memoryview(data)
        try:
            while view:  # a pipe (stdout) may take it in parts
                view = view[os.write(self.fd, view):]
        except OSError as exc:  # a full disk loses lines, never a request
            self.lost += data.count(b"\n", len(data) - len(view))
            log.warning("access log %s: %s (%d lines lost so far)", self.path, exc, self.lost)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        self.flush()
        if self.fd != 1:
            os.close(self.fd)
            self.fd = -1
