"""The retry loop: place an admitted request, relay it, and on a failure that reached no
client byte try another replica while the attempts allowed and the retry budget last.

As in Envoy's router, the policy is fixed (``max_attempts``, the budget, which failure kinds
are ``retryable``) and the state is the request's own (the replicas tried). A retry is
told to the outcome listeners on the failed attempt (``Attempt.retried``): metrics count
it there.

Once a primary request answers, its model's shadow pools (canary) get their copies.

A request placed on a ``decode`` replica is prefilled first on a prefill replica
(``gateway.dataplane.prefill``). If the decode replica then fails before its first byte, the
retry reuses that prefill when the failure never reached the engine (a refused connection:
its KV is still where the prefill left it); otherwise the next decode replica gets a new one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from gateway.canary import shadow
from gateway.dataplane.admission import Admission
from gateway.dataplane.outcome import Outcomes, Prefill, RequestRecord
from gateway.dataplane.placement import PlacementRequest, Placer
from gateway.dataplane.prefill import Prefiller
from gateway.dataplane.relay import Relay
from gateway.dataplane.reply import Reply
from gateway.dataplane.retry_budget import RetryBudget
from gateway.fleet.model import ServedModel
from gateway.fleet.replica import Replica
from gateway.fleet.role import Role
from gateway.protocol.errors import GatewayError
from gateway.protocol.request import Context, GenerationRequest
from gateway.upstream.failure import FailureKind

if TYPE_CHECKING:
    from gateway.canary.shadow import Shadows


class Attempts:
    def __init__(self, placer: Placer, relay: Relay, budget: RetryBudget, max_attempts: int,
                 outcomes: Outcomes, shadows: "Shadows",
                 prefiller: Prefiller | None = None) -> None:
        self.placer = placer
        self.relay = relay
        self.budget = budget
        self.max_attempts = max_attempts
        self.outcomes = outcomes
        self.shadows = shadows
        self.prefiller = prefiller  # None: no disaggregated serving (tests of the others)

    async def serve(self, request: GenerationRequest, context: Context, model: ServedModel,
                    admission: Admission, record: RequestRecord) -> Reply:
        """The reply of the first replica that answers; raises the last failure (or the
        placement's refusal) when none does."""
        self.budget.request()
        tried: list[Replica] = []
        ask = PlacementRequest.of(request, context, model, admission)
        prefill: Prefill | None = None
        while True:
            placement = await self.placer.place(replace(ask, exclude=tuple(tried)) if tried
                                                else ask)
            if placement.replica.role is not Role.DECODE:
                prefill = None
            elif prefill is None and self.prefiller is not None:
                try:
                    prefill = await self.prefiller.prefill(request, placement,
                                                           record.request_id)
                except BaseException:
                    placement.lease.close()
                    raise
            elif prefill is not None:  # reused: the prompt is prefilled
                placement.lease.first_token()
            try:
                reply = await self.relay.forward(request, placement, record, prefill)
            except GatewayError as error:
                tried.append(placement.replica)
                failure = error.failure
                if failure is not FailureKind.CONNECT:  # the decode engine may have taken it
                    prefill = None
                if (failure is None or not failure.retryable or len(tried) >= self.max_attempts
                        or not any(r.available and r not in tried and r.role.answers
                                   for r in admission.replicas)
                        or not self.budget.try_spend()):
                    raise
                failed = record.attempts[-1]  # the relay's record of this try
                failed.retried = True
                self.outcomes.retried(failed)
                continue
            if model.name in self.shadows.models:  # canary: copy it, now that it answers
                primary_text = self.shadows.start(request, model, placement.replica.pool,
                                                  record, admission.prompt_counts)
                if primary_text is not None:
                    reply = shadow.primary_reply(primary_text, reply)
            return reply
