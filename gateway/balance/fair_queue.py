"""The order in which requests waiting for a slot get one: fair across API keys, or FIFO.

Start-time fair queueing (Goyal, Vin & Cheng, 1996), priced in tokens: a request of flow
``f`` (an API key; requests without one are one flow) costing ``c`` tokens (its reserved
prompt + output) gets the start tag ``S = max(V, F_f)`` and moves its flow's finish tag to
``F_f = S + c / weight``; the waiter with the smallest start tag goes first, and the virtual
time ``V`` is the start tag of the last one served. So each key gets slots in proportion to
its weight, measured in tokens: a key sending 30k-token prompts advances its tags 100 times
faster than one sending 300-token prompts, and a key that floods the queue only queues
behind itself. A key that was idle starts at ``V``: it cannot bank credit while away.

FIFO is the same structure with the arrival order as the tag. A request keeps its tag for its
whole wait (it re-checks for slots every so often without losing its place).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter


class Ticket:
    """One request's place in the queue, from its first wait until it is placed or leaves."""

    __slots__ = ("tag", "seq", "flow", "waiter", "queued", "woken")

    def __init__(self, tag: float, seq: int, flow: str | None) -> None:
        self.tag = tag
        self.seq = seq  # ties: arrival order
        self.flow = flow
        self.waiter: asyncio.Future[None] | None = None
        self.queued = False  # in the heap right now
        self.woken = False  # picked for a freed slot, not yet back to take it

    def __lt__(self, other: "Ticket") -> bool:
        return (self.tag, self.seq) < (other.tag, other.seq)


class FairQueue:
    """The waiters of one model. ``enter`` once per waiting request (a ticket), ``park``
    that ticket each time it waits, ``resumed`` each time it runs again, ``leave`` when it
    stops waiting (always); ``wake_one`` when a slot frees."""

    def __init__(self, fair: bool = True) -> None:
        self.fair = fair
        self._heap: list[Ticket] = []
        self._virtual = 0.0
        self._finish: dict[str | None, float] = {}
        self._seq = itertools.count()
        self.waiting: Counter[str | None] = Counter()  # tickets per flow, entered, not left
        self.promised = 0  # waiters woken for a freed slot that have not taken it yet

    def __len__(self) -> int:
        return sum(self.waiting.values())

    def enter(self, flow: str | None, weight: float, cost: int) -> Ticket:
        seq = next(self._seq)
        if self.fair:
            tag = max(self._virtual, self._finish.get(flow, 0.0))
            self._finish[flow] = tag + max(cost, 1) / max(weight, 1e-9)
        else:
            tag = float(seq)
        self.waiting[flow] += 1
        return Ticket(tag, seq, flow)

    def leave(self, ticket: Ticket) -> None:
        self.resumed(ticket)
        self.waiting[ticket.flow] -= 1
        if self.waiting[ticket.flow] <= 0:
            del self.waiting[ticket.flow]
            if not self.waiting:  # nobody waits: old tags mean nothing any more
                self._finish.clear()
        ticket.waiter = None  # a stale heap entry is skipped by ``wake_one``

    def resumed(self, ticket: Ticket) -> None:
        """A woken waiter runs again: the slot it was woken for is no longer promised."""
        if ticket.woken:
            ticket.woken = False
            self.promised -= 1

    def park(self, ticket: Ticket, waiter: asyncio.Future[None]) -> None:
        """Queue the ticket's request until ``wake_one`` picks it (at its original tag)."""
        ticket.waiter = waiter
        if not ticket.queued:
            ticket.queued = True
            heapq.heappush(self._heap, ticket)

    def wake_one(self) -> bool:
        """A slot was freed: the waiter with the smallest tag tries again."""
        while self._heap:
            ticket = heapq.heappop(self._heap)
            ticket.queued = False
            waiter = ticket.waiter
            if waiter is not None and not waiter.done():
                if self.fair:
                    self._virtual = max(self._virtual, ticket.tag)
                waiter.set_result(None)
                if not ticket.woken:
                    ticket.woken = True
                    self.promised += 1
                return True
        return False
