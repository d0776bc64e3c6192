"""The simulated GPU behind the HTTP handlers: the timing models (``scheduler``, ``vllm_v1``)
driven in real time.

The engines all sit behind one interface (``submit``, ``wait``, ``abort``, ``state``):
``BatchedEngine`` drives a scheduler from one asyncio task on a simulated clock (``speed``
times real time); ``PacedEngine`` waits a fixed TTFT and inter-token delay per request;
``InstantEngine`` finishes every request on submission.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.sim.faults import Faults
from gateway.sim.kv_publisher import KvEventPublisher
from gateway.sim.metrics import Gauges, Meter
from gateway.sim.profiles import Profile
from gateway.sim.scheduler import BatchScheduler, Sequence
from gateway.sim.vllm_v1 import V1Scheduler


class Engine(Protocol):
    """What HTTP handlers use; one implementation per profile kind."""

    meter: Meter
    delays: bool  # False: submit() finishes the request (no waiting, no disconnect watch)

    def start(self) -> None: ...
    async def stop(self) -> None: ...
    def submit(self, seq: Sequence) -> None: ...
    async def wait(self, seq: Sequence, seen: int) -> int: ...
    def abort(self, seq: Sequence) -> None: ...
    def state(self) -> dict[str, Any]: ...
    def gauges(self) -> Gauges: ...


def _wake(seq: Sequence) -> None:
    w = seq.waiter
    if w is not None and not w.done():
        w.set_result(None)


@dataclass
class _Clock:
    """Simulated seconds = wall seconds x speed."""

    speed: float
    wall0: float = field(default_factory=time.monotonic)

    def now(self) -> float:
        return (time.monotonic() - self.wall0) * self.speed

    def wall_delay(self, sim_seconds: float) -> float:
        return sim_seconds / self.speed

    def wall_until(self, sim_time: float) -> float:
        return self.wall0 + sim_time / self.speed - time.monotonic()


class BatchedEngine:
    """The scheduler driven by one asyncio task, one step after another."""

    delays = True

    def __init__(self, profile: Profile, meter: Meter, faults: Faults, speed: float = 1.0,
                 prefix_cache: bool = False, publisher: KvEventPublisher | None = None) -> None:
        self.profile = profile
        self.meter = meter
        self.faults = faults
        self.clock = _Clock(speed)
        self.sched = make_scheduler(profile, meter, prefix_cache, kv_events=publisher is not None)
        self.publisher = publisher  # a batch of KV events after each step that made some
        self.uses_prefix_cache = prefix_cache
        self.sim_now = 0.0          # end of the last completed step (or idle time)
        self.step_end = 0.0         # end of the step in flight
        self._busy = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    def submit(self, seq: Sequence) -> None:
        # Arrivals during a step are stamped no later than its end (the driver may lag wall time).
        now = min(self.clock.now(), self.step_end) if self._busy else max(self.clock.now(), self.sim_now)
        self.sched.add(seq, now)
        self._wake.set()

    async def wait(self, seq: Sequence, seen: int) -> int:
        while seq.visible <= seen and not seq.done:
            seq.waiter = asyncio.get_running_loop().create_future()
            await seq.waiter
        return seq.visible

    def abort(self, seq: Sequence) -> None:
        self.sched.abort(seq, self.sim_now)
        _wake(seq)

    async def _run(self) -> None:
        sched = self.sched
        while True:
            if sched.idle():
                self._busy = False
                self._wake.clear()
                await self._wake.wait()
                self.sim_now = max(self.sim_now, self.clock.now())
                self._busy = True
            duration, emitting = sched.step(self.sim_now, self.faults.slowdown)
            if not emitting and duration == 0.0:
                self._wake.clear()   # nothing can run now; wait for the next event
                await self._wake.wait()
                continue
            self.step_end = self.sim_now + duration
            await asyncio.sleep(max(0.0, self.clock.wall_until(self.step_end)))
            self.sim_now = self.step_end
            if self.publisher is not None:
                events = sched.take_kv_events()
                if events:
                    await self.publisher.publish(events)
            for s in emitting:
                if not s.aborted:
                    s.visible = s.generated
                    s.done = s.finished
                    _wake(s)

    def gauges(self) -> Gauges:
        s = self.sched
        return Gauges(len(s.running), len(s.waiting), s.kv_used, self.profile.kv_capacity_tokens)

    def state(self) -> dict[str, Any]:
        s = self.sched
        return {"running": len(s.running), "waiting": len(s.waiting), "kv_used_tokens": s.kv_used,
                "kv_capacity_tokens": self.profile.kv_capacity_tokens,
                "max_running_seqs": self.profile.max_running_seqs,
                "completed_total": s.completed, "aborted_total": s.aborted,
                "sim_time_s": self.sim_now, "prefix_cache": self.uses_prefix_cache,
                "prefix_cache_blocks": len(s.cache.blocks) if s.cache else 0}


class PacedEngine:
    """Fixed TTFT then a fixed delay per token; no queueing, no KV limit."""

    delays = True

    def __init__(self, profile: Profile, meter: Meter, faults: Faults, speed: float = 1.0) -> None:
        self.profile = profile
        self.meter = meter
        self.faults = faults
        self.clock = _Clock(speed)
        self.active: set[Sequence] = set()
        self.completed = 0
        self.aborted = 0

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def submit(self, seq: Sequence) -> None:
        seq.arrived = seq.admitted_at = self.clock.now()
        self.active.add(seq)

    async def wait(self, seq: Sequence, seen: int) -> int:
        if seq.done:
            return seq.visible
        delay = (self.profile.ttft_s if seen == 0 else self.profile.itl_s) * self.faults.slowdown
        loop = asyncio.get_running_loop()
        seq.waiter = loop.create_future()
        handle = loop.call_later(self.clock.wall_delay(delay), _wake, seq)
        await seq.waiter
        handle.cancel()
        if seq.aborted:
            return seq.visible
        seq.visible = seq.generated = seq.visible + 1
        if seen == 0:
            seq.first_token_at = seq.admitted_at + delay
            self.meter.first_token(delay)
        else:
            self.meter.itl.observe(delay)
        if seq.visible >= seq.max_new_tokens:
            seq.finished = seq.done = True
            self.active.discard(seq)
            self.completed += 1
            e2e = self.clock.now() - seq.arrived
            self.meter.request_done(seq.finish_reason, seq.prompt_tokens, seq.visible, e2e, 0.0,
                                    seq.first_token_at - seq.arrived)
        return seq.visible

    def abort(self, seq: Sequence) -> None:
        if seq.finished:
            return
        seq.finished = seq.done = seq.aborted = True
        self.active.discard(seq)
        self.aborted += 1
        self.meter.request_done("abort", seq.prompt_tokens, seq.visible,
                                self.clock.now() - seq.arrived, 0.0, 0.0)
        _wake(seq)

    def gauges(self) -> Gauges:
        used = sum(s.prompt_tokens + s.visible for s in self.active)
        return Gauges(len(self.active), 0, used, self.profile.kv_capacity_tokens)

    def state(self) -> dict[str, Any]:
        g = self.gauges()
        return {"running": g.running, "waiting": 0, "kv_used_tokens": g.kv_used,
                "kv_capacity_tokens": g.kv_capacity, "max_running_seqs": None,
                "completed_total": self.completed, "aborted_total": self.aborted,
                "sim_time_s": self.clock.now(), "prefix_cache": False}


class InstantEngine:
    """Every request is complete the moment it is submitted."""

    delays = False

    def __init__(self, profile: Profile, meter: Meter) -> None:
        self.profile = profile
        self.meter = meter
        self.completed = 0

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def submit(self, seq: Sequence) -> None:
        n = seq.max_new_tokens
        seq.visible = seq.generated = n
        seq.finished = seq.done = True
        m = self.meter
        m.first_token(0.0)
        if n > 1:
            m.itl.observe(0.0, n - 1)
        m.request_done(seq.finish_reason, seq.prompt_tokens, n, 0.0, 0.0, 0.0)
        self.completed += 1

    async def wait(self, seq: Sequence, seen: int) -> int:
        return seq.visible

    def abort(self, seq: Sequence) -> None:
        pass

    def gauges(self) -> Gauges:
        return Gauges(0, 0, 0, self.profile.kv_capacity_tokens)

    def state(self) -> dict[str, Any]:
        return {"running": 0, "waiting": 0, "kv_used_tokens": 0,
                "kv_capacity_tokens": self.profile.kv_capacity_tokens, "max_running_seqs": None,
                "completed_total": self.completed, "aborted_total": 0, "sim_time_s": 0.0,
                "prefix_cache": False}


def make_scheduler(profile: Profile, meter: Meter, prefix_cache: bool = False,
                   kv_events: bool = False) -> BatchScheduler:
    """The pure scheduling model of a profile: ours, or vLLM V1's (``vllm_v1.py``, the one
    that makes KV events)."""
    if profile.kind == "vllm-v1":
        return V1Scheduler(profile, meter, prefix_cache, kv_events)
    if kv_events:
        raise ValueError("KV cache events need a vllm-v1 profile")
    return BatchScheduler(profile, meter, prefix_cache)


def make_engine(profile: Profile, meter: Meter, faults: Faults, speed: float = 1.0,
                prefix_cache: bool = False, publisher: KvEventPublisher | None = None) -> Engine:
    if profile.kind in ("instant", "paced") and publisher is not None:
        raise ValueError("KV cache events need a vllm-v1 profile")
    if profile.kind == "instant":
        return InstantEngine(profile, meter)
    if profile.kind == "paced":
        return PacedEngine(profile, meter, faults, speed)
    return BatchedEngine(profile, meter, faults, speed, prefix_cache, publisher)
