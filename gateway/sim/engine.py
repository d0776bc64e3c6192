"""The timing model of one simulated GPU.

``BatchScheduler`` is the pure model of continuous batching (no asyncio, no clock): each
``step(now)`` admits waiting sequences while running slots and KV capacity allow, spends a
per-step token budget on decodes (one token per decoding sequence) and chunked prefill, and
returns how long the step takes:

    step = step_base + decode_per_seq * decoding sequences + prefill_per_token * prefill tokens

KV held by a sequence = its prompt + generated tokens (+1 for the token being written); when a
decode step would overflow the cache the newest sequence is preempted and later recomputed,
as vLLM does. With a prefix cache, full prompt blocks seen before skip their prefill.

The engines wrap that model for HTTP handlers, all behind one interface (``submit``, ``wait``,
``abort``, ``state``): ``BatchedEngine`` drives the scheduler from one asyncio task on a
simulated clock (``speed`` times real time); ``PacedEngine`` waits a fixed TTFT and inter-token
delay per request; ``InstantEngine`` finishes every request on submission.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence as Seq

from gateway.sim.faults import Faults
from gateway.sim.metrics import Gauges, Meter
from gateway.sim.profiles import Profile


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine."""

    prompt_tokens: int
    max_new_tokens: int            # exactly this many tokens will be generated
    finish_reason: str = "length"  # "length" or "stop", reported when it completes
    block_hashes: tuple[int, ...] = ()
    arrived: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    prefill_target: int = 0        # context tokens to (re)compute before the next token
    computed: int = 0
    generated: int = 0             # scheduler's count
    visible: int = 0               # count delivered to the HTTP side
    held: int = 0                  # KV tokens held
    cached: int = 0
    finished: bool = False         # scheduler is done with it
    done: bool = False             # the HTTP side may finish (delivered or aborted)
    aborted: bool = False
    waiter: asyncio.Future | None = None


def block_hashes(ids: Seq[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks of a prompt: equal hash = equal whole prefix."""
    out, parent = [], 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(ids[start:start + block_size])))
        out.append(parent)
    return tuple(out)


class PrefixCache:
    """Block hashes of recently computed prompts, LRU, bounded by the KV capacity."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        self.block_size = block_size
        self.capacity_blocks = max(1, capacity_tokens // block_size)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: tuple[int, ...]) -> int:
        """Tokens of the longest cached prefix (touching its blocks)."""
        hit = 0
        for h in hashes:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            hit += 1
        return hit * self.block_size

    def insert(self, hashes: tuple[int, ...]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)


class BatchScheduler:
    """Continuous batching on one GPU, as a pure function of calls to ``step``."""

    def __init__(self, profile: Profile, meter: Meter, prefix_cache: bool = False) -> None:
        self.p = profile
        self.meter = meter
        self.cache = PrefixCache(profile.kv_capacity_tokens, profile.block_size) if prefix_cache else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.kv_used = 0
        self.completed = 0
        self.aborted = 0

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def add(self, seq: Sequence, now: float) -> None:
        seq.arrived = now
        self.waiting.append(seq)

    def abort(self, seq: Sequence, now: float) -> None:
        """Free the slot and KV of a sequence at once (client went away)."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.finished = seq.done = seq.aborted = True
        self.aborted += 1
        self._record_done(seq, "abort", now)

    def step(self, now: float, slowdown: float = 1.0) -> tuple[float, list[Sequence]]:
        """Run one engine step starting at ``now``; return its duration and who got a token."""
        p = self.p
        decoders = self._make_room_for_decodes()
        self.kv_used += len(decoders)
        for s in decoders:
            s.held += 1
        budget = p.max_batched_tokens - len(decoders)
        emitting = list(decoders)
        prefill = 0
        for s in self.running:  # continue chunked prefills, oldest first
            if s.computed < s.prefill_target and budget > 0:
                chunk = min(budget, s.prefill_target - s.computed)
                s.computed += chunk
                budget -= chunk
                prefill += chunk
                if s.computed == s.prefill_target:
                    emitting.append(s)
        while self.waiting and budget > 0 and len(self.running) < p.max_running_seqs:
            s = self.waiting[0]
            need = s.prompt_tokens + s.generated + 1
            if self.kv_used + need > p.kv_capacity_tokens:
                break  # FCFS: the head of the queue waits for KV, and so does everyone behind it
            self.waiting.popleft()
            self.running.append(s)
            self.kv_used += need
            s.held, s.prefill_target, s.computed = need, need - 1, 0
            if s.admitted_at is None:
                s.admitted_at = now
                if self.cache is not None:
                    s.cached = min(self.cache.match(s.block_hashes), s.prompt_tokens - 1)
                    s.computed = s.cached
                    self.meter.prefix_queries += s.prompt_tokens
                    self.meter.prefix_hits += s.cached
            chunk = min(budget, s.prefill_target - s.computed)
            s.computed += chunk
            budget -= chunk
            prefill += chunk
            if s.computed == s.prefill_target:
                emitting.append(s)
        if not emitting and not prefill:
            return 0.0, []
        duration = (p.step_base_s + p.decode_per_seq_s * len(decoders)
                    + p.prefill_per_token_s * prefill) * slowdown
        end = now + duration
        self.meter.steps += 1
        self.meter.busy_slots += len(self.running)
        for s in emitting:
            self._emit(s, end)
        return duration, emitting

    def _make_room_for_decodes(self) -> list[Sequence]:
        """Decoding sequences of this step, after preempting the newest ones if KV is full."""
        while True:
            decoders = [s for s in self.running if s.computed >= s.prefill_target]
            if self.kv_used + len(decoders) <= self.p.kv_capacity_tokens or len(self.running) <= 1:
                return decoders
            victim = self.running.pop()  # newest first, recomputed later (vLLM's recompute preemption)
            self.kv_used -= victim.held
            victim.held = victim.computed = 0
            self.waiting.appendleft(victim)
            self.meter.preemptions += 1

    def _emit(self, s: Sequence, at: float) -> None:
        s.generated += 1
        if s.first_token_at is None:
            s.first_token_at = at
            self.meter.first_token(at - s.arrived)
            self._prefilled(s)
        else:
            self.meter.itl.observe(at - s.last_token_at)
        s.last_token_at = at
        if s.generated >= s.max_new_tokens:
            s.finished = True
            self.running.remove(s)
            self._release(s)
            self.completed += 1
            self._record_done(s, s.finish_reason, at)

    def _prefilled(self, s: Sequence) -> None:
        """Its prompt is computed: the prefix cache learns its blocks."""
        if self.cache is not None:
            self.cache.insert(s.block_hashes)

    def _release(self, s: Sequence) -> None:
        """The sequence is done or gone: free the KV it holds."""
        self.kv_used -= s.held
        s.held = 0

    def _record_done(self, s: Sequence, reason: str, at: float) -> None:
        admitted = s.admitted_at if s.admitted_at is not None else at
        first = s.first_token_at if s.first_token_at is not None else at
        self.meter.request_done(reason, s.prompt_tokens, s.generated, at - s.arrived,
                                admitted - s.arrived, first - admitted)


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
                 prefix_cache: bool = False) -> None:
        self.profile = profile
        self.meter = meter
        self.faults = faults
        self.clock = _Clock(speed)
        self.sched = make_scheduler(profile, meter, prefix_cache)
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


def make_scheduler(profile: Profile, meter: Meter, prefix_cache: bool = False) -> BatchScheduler:
    """The pure scheduling model of a profile: ours, or vLLM V1's (``vllm_v1.py``)."""
    if profile.kind == "vllm-v1":
        from gateway.sim.vllm_v1 import V1Scheduler  # it imports this module
        return V1Scheduler(profile, meter, prefix_cache)
    return BatchScheduler(profile, meter, prefix_cache)


def make_engine(profile: Profile, meter: Meter, faults: Faults, speed: float = 1.0,
                prefix_cache: bool = False) -> Engine:
    if profile.kind == "instant":
        return InstantEngine(profile, meter)
    if profile.kind == "paced":
        return PacedEngine(profile, meter, faults, speed)
    return BatchedEngine(profile, meter, faults, speed, prefix_cache)
