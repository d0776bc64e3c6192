"""The autoscale signal of every model, pool and role (``gateway.autoscale.signal``), from the
gateway's own view: arrivals and completions (``RecentDemand``, fed by admission and by each
attempt's outcome), the ledger's requests in flight, the requests waiting (for a slot, or
held at zero), and the placer's latency models and limits.

A pool's share of its model's arrivals is its weight's share (a shadow pool: its sample of
the pool it copies): a pool scaled to zero gets its share too, so it is asked for again.
Each role of a disaggregated pool is sized apart: decode replicas on the answers, prefill
replicas on the prefills. A latency objective sizes the fleet only when it is configured (the
model's ``objective`` or ``autoscale.ttft_ms``/``tpot_ms``): a client's header must not buy GPUs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from gateway.autoscale.candidate import scale_down_candidates
from gateway.autoscale.config import AutoscaleConfig
from gateway.autoscale.demand import RecentDemand
from gateway.autoscale.signal import (Demand, OperatingPoint, Smoother, desired_replicas,
                                      operating_point, replicas, request_seconds,
                                      with_headroom)
from gateway.balance.ledger import LoadLedger
from gateway.dataplane.outcome import Attempt, Listener, Prefill
from gateway.dataplane.placement import Placer
from gateway.fleet.model import Pool, ServedModel
from gateway.fleet.role import Role

Group = tuple[str, str, Role]  # model, pool, role


@dataclass(frozen=True, slots=True)
class GroupSignal:
    """One evaluation of one model's pool and role: its inputs and what it asks for."""

    model: str
    pool: str
    role: Role
    replicas: int  # available now (taking requests)
    demand: Demand
    point: OperatingPoint  # what a replica is sized to run (headroom below the most)
    request_seconds: float
    raw: float  # replicas' worth of demand now
    desired: float  # smoothed: what the autoscaler is told
    candidates: tuple[str, ...]  # replicas to remove, cheapest first (when fewer are wanted)


def pool_shares(model: ServedModel) -> dict[str, float]:
    """Each pool's share of the model's requests: its weight's, or a shadow's sample of its
    pool's."""
    primary = sum(p.weight for p in model.pools if p.shadow_of is None)
    shares = {p.name: (p.weight / primary if primary else 0.0)
              for p in model.pools if p.shadow_of is None}
    for pool in model.pools:
        if pool.shadow_of is not None:
            shares[pool.name] = pool.sample * shares.get(pool.shadow_of, 0.0)
    return shares


class Autoscaler(Listener):
    def __init__(self, config: AutoscaleConfig, models: dict[str, ServedModel],
                 ledger: LoadLedger, placer: Placer, held: Callable[[str], int] = lambda _: 0,
                 instances: Callable[[], int] = lambda: 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.models = models
        self.ledger = ledger
        self.placer = placer
        self.held = held  # requests held at zero, per model (gateway.autoscale.hold)
        self.instances = instances  # gateway instances sharing the fleet (redis_url), this one too
        self.clock = clock
        self.demand = RecentDemand(config.window)
        self._smoothers: dict[Group, Smoother] = {}
        self._roles: dict[tuple[str, str], set[Role]] = {}  # roles a pool ever had
        self.signals: list[GroupSignal] = []  # the last evaluation

    # --- what it hears ---

    def arrived(self, model: str, prompt_tokens: int) -> None:
        """A request was admitted (both edges: ``gateway.api.intake``)."""
        self.demand.arrived(model, prompt_tokens, self.clock())

    def ended(self, attempt: Attempt) -> None:
        if not attempt.completed or not attempt.sent_at:
            return
        replica = attempt.placement.replica
        generated = attempt.usage.completion_tokens or 0
        self.demand.completed((replica.model, replica.pool, replica.role), generated,
                              attempt.ended_at - attempt.sent_at, self.clock())

    def prefilled(self, prefill: Prefill) -> None:
        if prefill.error is None and prefill.sent_at:
            replica = prefill.placement.replica
            self.demand.completed((replica.model, replica.pool, replica.role), 0,
                                  prefill.seconds, self.clock())

    # --- what it says ---

    def evaluate(self) -> list[GroupSignal]:
        now = self.clock()
        signals = [self._signal(model, pool, role, share, now)
                   for model in self.models.values()
                   for pool, share in ((p, pool_shares(model)[p.name]) for p in model.pools)
                   for role in self._pool_roles(model.name, pool)]
        self.signals = signals
        return signals

    def _pool_roles(self, model: str, pool: Pool) -> list[Role]:
        """Its replicas' roles, and those it had before it was scaled down (else ``both``);
        the answering ones as one: ``decode`` where there are decode replicas."""
        seen = self._roles.setdefault((model, pool.name), set())
        seen.update(r.role for r in pool.replicas)
        answering = Role.DECODE if Role.DECODE in seen else Role.BOTH
        return [answering, Role.PREFILL] if Role.PREFILL in seen else [answering]

    def _signal(self, model: ServedModel, pool: Pool, role: Role, share: float,
                now: float) -> GroupSignal:
        members = [r for r in pool.replicas
                   if (r.role is Role.PREFILL) == (role is Role.PREFILL)]
        arrivals, prompt_tokens = self.demand.arrivals(model.name, now)
        output_tokens, seconds = self.demand.completions((model.name, pool.name, role), now)
        queue = model.name if role.answers else model.name + " (prefill)"
        waiting = self.placer.queued(queue) + (self.held(model.name) if role.answers else 0)
        demand = Demand(arrivals * share, prompt_tokens, output_tokens, seconds,
                        sum(self.ledger.load(r.name).in_flight for r in members),
                        round(waiting * share))
        latency = self.placer.latency
        learned = latency.find(model.name, pool.name, role) if latency and role.answers else None
        objective = model.objective
        ttft_ms = self.config.ttft_ms or (objective.ttft_ms if objective else None)
        tpot_ms = self.config.tpot_ms or (objective.tpot_ms if objective else None)
        point = operating_point(learned, ttft_ms, tpot_ms, prompt_tokens,
                                self.placer.backpressure.max_in_flight_per_replica,
                                self.config.target_in_flight)
        sized = with_headroom(learned, point, self.config.headroom, prompt_tokens)
        raw = desired_replicas(demand, sized)
        smoother = self._smoothers.get((model.name, pool.name, role))
        if smoother is None:
            # Just started: its share of the replicas there are (see Smoother).
            smoother = self._smoothers[(model.name, pool.name, role)] = Smoother(
                self.config.scale_down_after, now,
                sum(r.available for r in members) / max(1, self.instances()))
        desired = smoother.update(now, raw)
        candidates = scale_down_candidates(members, self.ledger, replicas(desired))
        return GroupSignal(model.name, pool.name, role, sum(r.available for r in members),
                           demand, sized, request_seconds(demand, sized), raw, desired,
                           tuple(r.name for r in candidates))
