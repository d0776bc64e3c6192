"""The order in which requests waiting for a slot get one: by priority band, then fair across
API keys (or FIFO) inside a band.

**Bands.** Each request has an integer priority (``gateway.flow.objective``; 0 unless it or
its key or model sets one). A freed slot goes to the highest band that has a waiter, with one
ageing rule so no band starves: a band's effective priority rises by one for every
``ageing_seconds`` its first waiter has waited. So under a sustained flood of priority 1, a
priority-0 request that has waited ``ageing_seconds`` competes as priority 1, and then by its
tag, as inside a band (the band-1 waiters age too, but they are served and it is not, so
its lead grows until it is served: nothing waits forever).

**Inside a band**, start-time fair queueing (Goyal, Vin & Cheng, 1996), priced in tokens: a
request of flow ``f`` (an API key; requests without one are one flow) costing ``c`` tokens
(its reserved prompt + output) gets the start tag ``S = max(V, F_f)`` and moves its flow's
finish tag to ``F_f = S + c / weight``; the waiter with the smallest start tag goes first,
and the virtual time ``V`` is the start tag of the last one served. So each key gets slots
in proportion to its weight, measured in tokens: a key sending 30k-token prompts advances
its tags 100 times faster than one sending 300-token prompts, and a key that floods the
queue only queues behind itself. A key that was idle starts at ``V``: it cannot bank credit
while away. Tags share one virtual time across bands, so an aged waiter and the band it
reached compare fairly.

FIFO is the same structure with the arrival order as the tag. A request keeps its tag for its
whole wait (it re-checks for slots every so often without losing its place).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from typing import Callable, Protocol


class Waiter(Protocol):
    """What a parked request waits on (an ``asyncio.Future``; a benchmark's own stand-in)."""

    def done(self) -> bool: ...

    def set_result(self, result: None) -> None: ...


class Ticket:
    """One request's place in the queue, from its first wait until it is placed or leaves."""

    __slots__ = ("tag", "seq", "flow", "priority", "entered", "waiter", "queued", "woken")

    def __init__(self, tag: float, seq: int, flow: str | None, priority: int = 0,
                 entered: float = 0.0) -> None:
        self.tag = tag
        self.seq = seq  # ties: arrival order
        self.flow = flow
        self.priority = priority
        self.entered = entered  # the queue's clock when it entered (ageing)
        self.waiter: Waiter | None = None
        self.queued = False  # in its band's heap right now
        self.woken = False  # picked for a freed slot, not yet back to take it

    def __lt__(self, other: "Ticket") -> bool:
        return (self.tag, self.seq) < (other.tag, other.seq)


class FairQueue:
    """The waiters of one model. ``enter`` once per waiting request (a ticket), ``park``
    that ticket each time it waits, ``resumed`` each time it runs again, ``leave`` when it
    stops waiting (always); ``wake_one`` when a slot frees. ``outranked`` says whether a free
    slot belongs to a waiter of a higher band first."""

    def __init__(self, fair: bool = True, ageing_seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fair = fair
        self.ageing_seconds = ageing_seconds
        self.clock = clock
        self._bands: dict[int, list[Ticket]] = {}  # priority -> its parked tickets (a heap)
        self._virtual = 0.0
        self._finish: dict[str | None, float] = {}
        self._seq = itertools.count()
        self.waiting: Counter[str | None] = Counter()  # tickets per flow, entered, not left
        self.by_priority: Counter[int] = Counter()  # the same, per band
        self.promised = 0  # waiters woken for a freed slot that have not taken it yet

    def __len__(self) -> int:
        return sum(self.waiting.values())

    def enter(self, flow: str | None, weight: float, cost: int, priority: int = 0) -> Ticket:
        seq = next(self._seq)
        if self.fair:
            tag = max(self._virtual, self._finish.get(flow, 0.0))
            self._finish[flow] = tag + max(cost, 1) / max(weight, 1e-9)
        else:
            tag = float(seq)
        self.waiting[flow] += 1
        self.by_priority[priority] += 1
        return Ticket(tag, seq, flow, priority, self.clock())

    def leave(self, ticket: Ticket) -> None:
        self.resumed(ticket)
        self.waiting[ticket.flow] -= 1
        self.by_priority[ticket.priority] -= 1
        if self.waiting[ticket.flow] <= 0:
            del self.waiting[ticket.flow]
            if not self.waiting:  # nobody waits: old tags mean nothing any more
                self._finish.clear()
        ticket.waiter = None  # a stale heap entry is skipped when it comes up

    def resumed(self, ticket: Ticket) -> None:
        """A woken waiter runs again: the slot it was woken for is no longer promised."""
        if ticket.woken:
            ticket.woken = False
            self.promised -= 1

    def park(self, ticket: Ticket, waiter: Waiter) -> None:
        """Queue the ticket's request until ``wake_one`` picks it (at its original tag)."""
        ticket.waiter = waiter
        if not ticket.queued:
            ticket.queued = True
            heapq.heappush(self._bands.setdefault(ticket.priority, []), ticket)

    def wake_one(self) -> bool:
        """A slot was freed: the first waiter of the first band (ageing counted) is promised it
        and tries again. (One already on its way back from a re-check takes the promise with
        it.)"""
        ticket = self._first()
        if ticket is None:
            return False
        heapq.heappop(self._bands[ticket.priority])
        ticket.queued = False
        if self.fair:
            self._virtual = max(self._virtual, ticket.tag)
        waiter = ticket.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if not ticket.woken:
            ticket.woken = True
            self.promised += 1
        return True

    def outranked(self, priority: int, ticket: Ticket | None = None) -> bool:
        """Whether a parked waiter of a higher band should have a free slot before a request
        of ``priority`` (its ``ticket`` if it waits; None: a newcomer). Ageing counts for
        both; at equal effective priority the smaller tag goes first, before any newcomer."""
        if not self._bands:
            return False
        now = self.clock()
        mine = self._effective(priority, now if ticket is None else ticket.entered, now)
        for band, heap in list(self._bands.items()):
            head = self._live_head(band, heap) if band > priority else None
            if head is None:
                continue
            theirs = self._effective(band, head.entered, now)
            if theirs > mine or (theirs == mine and (ticket is None or head < ticket)):
                return True
        return False

    def _first(self) -> Ticket | None:
        """The head of the band with the highest effective priority (ties: the smaller tag,
        as inside a band)."""
        best: Ticket | None = None
        best_priority = 0
        now = self.clock()
        for band, heap in list(self._bands.items()):
            head = self._live_head(band, heap)
            if head is None:
                continue
            priority = self._effective(band, head.entered, now)
            if best is None or priority > best_priority or \
                    (priority == best_priority and head < best):
                best, best_priority = head, priority
        return best

    def _live_head(self, band: int, heap: list[Ticket]) -> Ticket | None:
        """The band's first ticket whose request still waits (those that left dropped; one
        re-checking for a slot right now still waits)."""
        while heap and heap[0].waiter is None:
            heapq.heappop(heap).queued = False
        if not heap:
            del self._bands[band]
            return None
        return heap[0]

    def _effective(self, priority: int, entered: float, now: float) -> int:
        if self.ageing_seconds <= 0:
            return priority
        return priority + int(max(0.0, now - entered) // self.ageing_seconds)
