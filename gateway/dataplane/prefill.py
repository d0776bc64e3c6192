"""Disaggregated prefill: before a ``decode`` replica answers a request, a ``prefill`` replica
of its pool computes the prompt's KV cache, and what its answer says of that cache (vLLM's
``kv_transfer_params``) goes into the decode replica's request.

As vLLM's own P/D proxy does it: the request, as planned for the engine, is made a prefill
by the engine module (one token, not streamed, the KV kept for a remote decode); its answer
is never shown to the client, who gets the decode replica's answer as from any engine.

A prefill that fails on its replica is tried on another prefill replica (the retry budget
and ``max_attempts`` apply). When none is left, none is available, or the request needs the
prompt's own logits, the decode replica prefills the prompt itself, as any engine does: a
failing prefill pool costs latency, never a request. An engine's refusal of the request (a
4xx) is the client's answer, given once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from gateway.dataplane.outcome import Outcomes, Prefill
from gateway.dataplane.placement import Placement, Placer
from gateway.dataplane.retry_budget import RetryBudget
from gateway.protocol.errors import (GatewayError, NoReplicaAvailable, UpstreamTimeout,
                                     UpstreamUnavailable, error_from_engine)
from gateway.protocol.request import GenerationRequest
from gateway.protocol.translate import Translation, plan
from gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from gateway.upstream.failure import FailureKind

if TYPE_CHECKING:
    from gateway.config import TimeoutsConfig
    from gateway.fleet.replica import Replica


class Prefiller:
    def __init__(self, placer: Placer, pool: UpstreamPool, timeouts: "TimeoutsConfig",
                 outcomes: Outcomes, budget: RetryBudget, max_attempts: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.placer = placer
        self.pool = pool
        self.timeouts = timeouts
        self.outcomes = outcomes
        self.budget = budget
        self.max_attempts = max_attempts
        self.clock = clock

    async def prefill(self, request: GenerationRequest, decode: Placement,
                      request_id: str) -> Prefill | None:
        """The prompt prefilled for ``decode`` (a decode replica's placement), whose lease then
        holds the output alone; None when the decode replica is to prefill it itself. Raises
        the engine's refusal of the request, or the placement's (a queue wait past its
        timeout)."""
        tried: list[Replica] = []
        while True:
            try:
                # The decode placement's ask (key, caller, objective), for its prefill: a
                # prompt's whole reservation until its first token (streamed).
                placement = await self.placer.place(replace(
                    decode.ask, exclude=tuple(tried), prefill_for=decode.replica,
                    streamed=True))
            except NoReplicaAvailable:
                self.outcomes.prefill_skipped(decode, "unavailable" if not tried else "failed")
                return None
            replica = placement.replica
            admission = placement.admission
            translation = plan(request, replica.engine, replica.version, decode.name,
                               decode.model.tokenizer, decode.model.window(replica),
                               admission.output_cap, admission.plan)
            body = replica.profile.prefill_body(translation.body)
            if body is None:  # the prompt's own logits are asked for: a whole run gives them
                placement.lease.close()
                self.outcomes.prefill_skipped(decode, "whole_request")
                return None
            prefill = Prefill(placement, decode.replica, self.clock())
            try:
                await self._send(prefill, translation, body, request_id)
            except GatewayError as error:
                if error.failure in (None, FailureKind.HTTP_4XX):  # the request's fault
                    raise
                tried.append(replica)
                if len(tried) >= self.max_attempts or not self.budget.try_spend():
                    self.outcomes.prefill_skipped(decode, "failed")
                    return None
                continue
            decode.lease.first_token()  # the prompt is prefilled: the decode replica loads it
            return prefill

    async def _send(self, prefill: Prefill, translation: Translation, body: bytes,
                    request_id: str) -> None:
        """One prefill request; the lease closes and the listeners hear of it, however it
        ends. Raises GatewayError with the failure when it is not answered 2xx."""
        replica = prefill.replica
        response: UpstreamResponse | None = None
        headers = ((b"content-type", b"application/json"),
                   (b"x-request-id", request_id.encode()),  # the same id as the decode's
                   (b"accept-encoding", b"identity"))
        try:
            try:
                async with asyncio.timeout(self.timeouts.first_token):
                    response = await self.pool.request(replica.url, translation.path, body, headers,
                                                       self.timeouts.connect)
                    content = await response.read()
            except TimeoutError:
                raise UpstreamTimeout(f"prefill replica {replica.name} did not answer in "
                                      f"time") from None
            except UpstreamError as exc:
                raise UpstreamUnavailable(f"prefill replica {replica.name} failed: {exc}",
                                          exc.failure) from None
            prefill.status = response.status
            if response.status >= 400:
                raise translation.engine_error(error_from_engine(response.status, content))
            try:
                prefill.handoff = replica.profile.handoff(content)
            except ValueError as exc:
                raise UpstreamUnavailable(f"prefill replica {replica.name}: {exc}",
                                          FailureKind.BAD_RESPONSE) from None
        except GatewayError as error:
            prefill.error = error.failure
            raise
        except BaseException:  # the client left: the prefill is abandoned
            prefill.error = None
            prefill.status = prefill.status or 499
            raise
        finally:
            prefill.ended_at = self.clock()
            prefill.placement.lease.close()
            if response is not None and not response.ended:
                response.close()
            self.outcomes.prefilled(prefill)
