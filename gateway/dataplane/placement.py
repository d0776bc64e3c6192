"""Placement: an admitted request's replica, picked by the balancing policy among those with
a free slot, with the request's cost reserved there in the ledger; a request that finds
every slot taken waits in its model's fair queue.

Disaggregated serving places a request twice: first the replica that answers (a ``decode``
or ``both`` replica: never a ``prefill`` one), then, for a decode replica, a prefill replica
of the same pool (``prefill_for``), balanced on the prompt alone (``prefill_cost``).

Flow control (``gateway.flow``): a saturated replica has no free slot, so requests wait here
in priority order instead of inside the engine; a sheddable request (negative priority) that
would wait is refused; a request with a latency objective goes, among the free replicas, to
one predicted to meet it."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, replace
from typing import Callable

from gateway.balance.adapter_affinity import prefer_adapter
from gateway.balance.fair_queue import FairQueue, Ticket
from gateway.balance.ledger import Lease, LoadLedger
from gateway.balance.output_estimate import OutputEstimate
from gateway.balance.policy import Policy, RequestCost
from gateway.balance.pool_split import PoolSplit
from gateway.config import BackpressureConfig, FlowControlConfig
from gateway.flow.latency_model import LatencyModels, Prediction
from gateway.flow.objective import DEFAULT_OBJECTIVE, Objective
from gateway.flow.saturation import Saturation
from gateway.fleet.model import ServedModel
from gateway.fleet.replica import Replica
from gateway.fleet.role import Role
from gateway.dataplane.admission import Admission
from gateway.protocol.errors import (NoReplicaAvailable, ObjectiveUnattainable, Overloaded,
                                     QueueFull, Shed)
from gateway.balance.pool_split import sticky_key
from gateway.protocol.request import Caller, Context, GenerationRequest


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What placement is asked, in one value: built once per request (``of``), then narrowed
    per try with ``dataclasses.replace`` (a retry's ``exclude``, a prefill's
    ``prefill_for``)."""

    model: ServedModel
    admission: Admission
    key: str | None = None  # keeps a client in one pool (gateway.balance.pool_split)
    caller: Caller | None = None  # the API key that sent it (keys on): its weight
    objective: Objective = DEFAULT_OBJECTIVE  # its priority band and latency objectives
    flow: str | None = None  # whose share of the queue it waits in (its key's, or fairness id)
    streamed: bool = True  # its first token will be seen (``LoadLedger.lease``)
    exclude: tuple[Replica, ...] = ()  # replicas this request already tried
    wait: bool = True  # False: refused at once instead of queueing (shadow copies)
    prefill_for: Replica | None = None  # a decode replica: place its prefill instead

    @classmethod
    def of(cls, request: GenerationRequest, context: Context, model: ServedModel,
           admission: Admission) -> "PlacementRequest":
        """A client request's, whichever edge admitted it."""
        return cls(model, admission, sticky_key(request, context), context.caller,
                   context.objective, context.flow, request.stream)


@dataclass(slots=True)
class Placement:
    """Where one request goes, and its reservation there (close the lease when done), with
    what admission decided (the relay writes its output cap into the engine's body)."""

    model: ServedModel
    admission: Admission
    replica: Replica
    lease: Lease
    ask: PlacementRequest  # what it answers (a retry, a prefill or a continuation narrows it)
    queued_for: float = 0.0  # seconds spent waiting for a free slot
    asked: int = 0  # output tokens the request may generate (max_tokens x choices)
    outputs: OutputEstimate | None = None
    name: str = ""  # the model name served (an alias, an adapter, or the model's own)
    prediction: Prediction | None = None  # the replica's predicted latency (flow.predict)

    @property
    def objective(self) -> Objective:
        return self.ask.objective

    @property
    def caller(self) -> Caller | None:
        """Whose share of the queue it waited in (keys on)."""
        return self.ask.caller

    def served(self, generated: int | None) -> None:
        """The replica completed the request: teach the estimate how much of its ask it
        used (only completions: an error or a disconnect says nothing about lengths)."""
        if self.outputs is not None and generated is not None:
            self.outputs.observe(self.model.name, self.asked, generated)


def _queue_name(model: str, prefill_for: Replica | None) -> str:
    """Prefills wait in a queue of their own: only a prefill slot freed wakes them."""
    return model if prefill_for is None else model + " (prefill)"


def prefill_cost(cost: RequestCost) -> RequestCost:
    """A prefill's cost: the whole prompt and the one token it answers with."""
    return replace(cost, output_tokens=1)


# A queued request also re-checks this often, for slots freed where no local lease closes
# (another instance's requests, a replica coming back, an admin undrain).
_RECHECK_SECONDS = 0.1


class Placer:
    def __init__(self, policy: Policy, ledger: LoadLedger,
                 backpressure: BackpressureConfig = BackpressureConfig(),
                 rng: random.Random | None = None, split: PoolSplit | None = None,
                 outputs: OutputEstimate | None = None, signals_max_age: float = 3.0,
                 flow: FlowControlConfig = FlowControlConfig(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.outputs = outputs  # expected output lengths; None = reserve the whole ask
        self.signals_max_age = signals_max_age  # engine signals older than this are ignored
        self.flow = flow
        self.clock = clock  # the engine signals' clock
        self.saturation = Saturation(flow, signals_max_age) if flow.saturation else None
        self.latency = LatencyModels() if flow.predict else None
        self.policy = policy
        self.ledger = ledger
        self.backpressure = backpressure
        self.rng = rng or random.Random()
        self.split = split or PoolSplit(rng=self.rng)
        self._waiters: dict[str, FairQueue] = {}  # per model

    async def place(self, ask: PlacementRequest) -> Placement:
        """Pick an available replica with a free slot and reserve the request's cost there.

        While every available replica is at its in-flight limit the request waits in the
        model's bounded queue, served fairly across callers (gateway.balance.fair_queue);
        a full queue, a caller's full share of it or a wait past ``queue_timeout`` is a 429.
        ``ask.exclude`` holds replicas already tried by this request (retries); ``ask.key``
        keeps a client in one pool (``gateway.balance.pool_split``). Without ``ask.wait`` a
        request that finds no free slot is refused at once instead of queueing (shadow
        copies: they must never hold a place in the clients' queue). With
        ``ask.prefill_for`` (a decode replica) it places the request's prefill on a prefill
        replica of that replica's pool. ``ask.objective``: its priority band in the queue and
        its latency objectives.
        """
        model, objective = ask.model, ask.objective
        loop = asyncio.get_running_loop()
        queue = self._queue(_queue_name(model.name, ask.prefill_for))
        started = deadline = 0.0
        ticket: Ticket | None = None
        woken = False  # this request was woken for a freed slot (the slot is promised to it)
        try:
            while True:
                free = self._free_slots(ask)
                # A slot freed for a woken waiter is that waiter's: a newcomer, or a waiter
                # back from a re-check, that sees it waits on (a free slot no waiter was woken
                # for is free). So is one a waiter of a higher band should have first.
                if free and (woken or not ask.wait or not queue.promised) and \
                        not (queue and queue.outranked(objective.priority, ticket)):
                    waited = loop.time() - started if started else 0.0
                    placement = self._reserve(ask, free, waited)
                    placement.queued_for = waited
                    return placement
                if not ask.wait:
                    raise Overloaded(f"every replica of model `{model.name}` that can take "
                                     f"this request is at its in-flight limit")
                if objective.sheddable:
                    raise Shed(f"no replica of model `{model.name}` has room for this request "
                               f"now (saturated or full), and its priority "
                               f"({objective.priority}) is sheddable")
                if ticket is None:
                    started = loop.time()
                    deadline = started + self.backpressure.queue_timeout
                    ticket = self._enter_queue(queue, model.name, ask, objective.priority)
                await self._wait_for_slot(queue, model.name, deadline, ticket)
                woken = ticket.woken
                queue.resumed(ticket)
        finally:
            if ticket is not None:
                queue.leave(ticket)

    def _free_slots(self, ask: PlacementRequest) -> set[int]:
        """ids of the replicas that could take the request now (raises if none ever can)."""
        model, admission, exclude, key, prefill_for = (ask.model, ask.admission, ask.exclude,
                                                       ask.key, ask.prefill_for)
        if prefill_for is None:  # the replica that answers: any but a prefill-only one
            available = [r for r in admission.replicas
                         if r.available and r not in exclude and r.role.answers]
            if key is not None:  # a sticky client waits for a slot in its pool, never leaves it
                available = self.split.own_pool(model.pools, available, key)
        else:
            available = [r for r in admission.replicas
                         if r.available and r not in exclude and r.role is Role.PREFILL
                         and r.pool == prefill_for.pool]
        if not available:
            raise NoReplicaAvailable(f"no available {'prefill ' if prefill_for else ''}"
                                     f"replica of model `{model.name}` can take this request "
                                     f"now")
        now = self.clock()
        return {id(r) for r in available if self.has_slot(r, now)}

    def _queue(self, model: str) -> FairQueue:
        queue = self._waiters.get(model)
        if queue is None:
            queue = self._waiters[model] = FairQueue(self.backpressure.queueing == "fair",
                                                     self.flow.ageing_seconds)
        return queue

    def _enter_queue(self, queue: FairQueue, model: str, ask: PlacementRequest,
                     priority: int) -> Ticket:
        if len(queue) >= self.backpressure.queue_size:
            raise Overloaded(f"every replica of model `{model}` is at its in-flight limit "
                             f"and {len(queue)} requests are already waiting")
        flow = ask.flow if ask.flow is not None or ask.caller is None else ask.caller.name
        if flow is not None and queue.waiting[flow] >= self.backpressure.max_queued_per_key:
            raise QueueFull(f"{'API key' if ask.caller is not None else 'fairness id'} "
                            f"`{flow}` already has {queue.waiting[flow]} requests waiting for "
                            f"model `{model}` (backpressure.max_queued_per_key)")
        cost = ask.admission.cost.prompt_tokens + ask.admission.cost.output_tokens
        weight = ask.caller.weight if ask.caller is not None else 1.0
        return queue.enter(flow, weight, cost, priority)

    def _reserve(self, ask: PlacementRequest, free: set[int], waited: float) -> Placement:
        model, admission, key, prefill_for, objective = (ask.model, ask.admission, ask.key,
                                                         ask.prefill_for, ask.objective)
        if prefill_for is None:
            pool = self.split.pick(model.pools, free, key)
            assert pool is not None  # ``free`` is not empty
            candidates = [r for r in pool.replicas if id(r) in free]
            cost = admission.cost
        else:  # the prefill replicas of the decode replica's pool, on the prompt alone
            candidates = [r for r in admission.replicas if id(r) in free]
            cost = prefill_cost(admission.cost)
        # A LoRA adapter: where the engine has it loaded, or a free adapter slot, first.
        candidates = prefer_adapter(candidates, admission.adapter, self.signals_max_age)
        latency = self.latency if prefill_for is None else None  # answering replicas only
        if objective.timed and latency is not None:  # those predicted to meet it, first
            candidates = self.meeting(candidates, cost.prompt_tokens, objective, waited)
        replica = self.policy.select(candidates, cost, self.ledger)
        prediction = None if latency is None else latency.of(replica).predict(
            self.ledger.load(replica.name), cost.prompt_tokens)
        asked = cost.output_tokens
        expected = asked if self.outputs is None or prefill_for is not None \
            else self.outputs.expect(model.name, asked)
        lease = self.ledger.lease(replica.name, cost.prompt_tokens, expected, asked,
                                  ask.streamed)
        queue_name = _queue_name(model.name, prefill_for)
        lease.on_close = lambda: self._wake_one(queue_name)
        return Placement(model, admission, replica, lease, ask, asked=asked,
                         outputs=self.outputs, name=admission.name or model.name,
                         prediction=prediction)

    def meeting(self, candidates: list[Replica], prompt_tokens: int, objective: Objective,
                 waited: float) -> list[Replica]:
        """The candidates predicted to meet ``objective`` after ``waited`` seconds queued
        (a replica not predicted yet may); all of them when none is (best effort), unless
        the request asked to be refused then."""
        assert self.latency is not None
        meeting = []
        for replica in candidates:
            predicted = self.latency.of(replica).predict(
                self.ledger.load(replica.name), prompt_tokens)
            if objective.ttft_ms is not None and predicted.ttft is not None and \
                    (waited + predicted.ttft) * 1000 > objective.ttft_ms:
                continue
            if objective.tpot_ms is not None and predicted.tpot is not None and \
                    predicted.tpot * 1000 > objective.tpot_ms:
                continue
            meeting.append(replica)
        if meeting:
            return meeting
        if objective.strict:
            raise ObjectiveUnattainable(f"no replica of model `{candidates[0].model}` is "
                                        f"predicted to meet this request's latency objective")
        return candidates

    def limit_of(self, replica: Replica) -> int:
        """The replica's in-flight limit: the configured one, or the engine's own if lower."""
        limit = self.backpressure.max_in_flight_per_replica
        engine = replica.max_concurrent_requests
        return limit if engine is None else min(limit, engine)

    def has_slot(self, replica: Replica, now: float | None = None) -> bool:
        """Below its in-flight limit and not saturated (``now``: the signals' clock)."""
        load = self.ledger.load(replica.name)
        if load.in_flight >= self.limit_of(replica):
            return False
        return self.saturation is None or not self.saturation.saturated(
            replica, load, self.clock() if now is None else now)

    async def _wait_for_slot(self, queue: FairQueue, model: str, deadline: float,
                             ticket: Ticket) -> None:
        """Wait in line until woken (a slot freed here) or the re-check (slots freed where
        no local lease closes)."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise Overloaded(f"every replica of model `{model}` is at its in-flight limit; "
                             f"waited {self.backpressure.queue_timeout:g}s for a slot")
        waiter = asyncio.get_running_loop().create_future()
        queue.park(ticket, waiter)
        with contextlib.suppress(TimeoutError):  # re-check now and then (see _RECHECK_SECONDS)
            async with asyncio.timeout(min(remaining, _RECHECK_SECONDS)):
                await waiter

    def _wake_one(self, model: str) -> None:
        """A slot was freed: the first waiter in the queue's order tries again."""
        queue = self._waiters.get(model)
        if queue is not None:
            queue.wake_one()

    def queued(self, model: str) -> int:
        return len(self._waiters.get(model, ()))  # type: ignore[arg-type]

    def queued_by_priority(self) -> dict[tuple[str, int], int]:
        """Requests waiting here now, by queue (a model, or its prefills) and band."""
        return {(name, band): n for name, queue in self._waiters.items()
                for band, n in queue.by_priority.items()}
