"""Shadow traffic: a sampled copy of a primary request also goes to a pool that shadows the
primary's (``shadow_of``), fire and forget.

The copy starts once the primary is placed and answering (its first token is read, or its
whole body), in a task of its own that the client's path never awaits: the client only ever
sees (and waits for) the primary, and the copy's admission (tokenizing, chat template) and
connection set-up never land inside the primary's time to first token. At most
``max_in_flight`` copies run at once per instance; past that a copy is skipped and counted
(in /metrics, the disagreements view and the verdict's pairs), as is a copy whose pool has
no free slot (copies never wait in the clients' queue).
A copy goes through the same admission, balancing (inside its pool) and metering as any
request, labelled ``role="shadow"``: one callable built at wiring (``ServeCopy``) does that,
so this module knows nothing of the admitter, the placer or the relay. It is never retried,
and its failures neither eject nor clear a replica's failures (the outlier listener is not
told of a copy's attempts), nor count as the primary's rejections. Its stream is read to the
end (usage counted) and its
lease closed like any other. When a pair is compared (``gateway.canary.agreement``), both
sides' texts are collected; ordinary requests pay nothing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping

from gateway.canary.agreement import Agreement, Pair, TextCollector, is_greedy
from gateway.dataplane.outcome import RequestRecord
from gateway.fleet.model import Pool, ServedModel
from gateway.canary.metrics import CanaryMetrics
from gateway.protocol.errors import GatewayError, Overloaded
from gateway.protocol.request import GenerationRequest
from gateway.protocol.responses import PATH as RESPONSES

if TYPE_CHECKING:
    from gateway.dataplane.reply import Reply

log = logging.getLogger(__name__)


class NotSent(Exception):
    """A copy that admission or placement refused: skipped, never sent."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error

    @property
    def reason(self) -> str:
        return "no_slot" if isinstance(self.error, Overloaded) else "rejected"


# Serves one copy (already marked ``shadow``) in its pool, with the primary's prompt counts
# (None: not taken) and its own record: admitted, placed without queueing and relayed.
# Raises NotSent when it could not be placed; any other GatewayError is the copy's failure
# once sent.
ServeCopy = Callable[[GenerationRequest, str, "list[int] | None", RequestRecord],
                     Awaitable["Reply"]]


def shadow_pools(model: ServedModel, pool: str) -> list[Pool]:
    return [p for p in model.pools if p.shadow_of == pool]


class Shadows:
    """Starts, bounds and tracks one instance's shadow copies."""

    def __init__(self, serve_copy: ServeCopy, models: Mapping[str, ServedModel],
                 metrics: CanaryMetrics, agreement: Agreement, max_in_flight: int,
                 rng: random.Random | None = None) -> None:
        self.serve_copy = serve_copy
        self.metrics = metrics
        self.agreement = agreement
        self.max_in_flight = max_in_flight
        self.rng = rng or random.Random()
        self.in_flight = 0
        self._tasks: set[asyncio.Task] = set()
        # Models with a shadow pool: the one check ordinary requests pay.
        self.models = {name for name, m in models.items() if any(p.shadow_of for p in m.pools)}
        for name in self.models:
            for pool in models[name].pools:
                if pool.shadow_of:
                    metrics.start_at_zero(name, pool.name)

    def start(self, request: GenerationRequest, model: ServedModel, pool: str,
              primary_record: RequestRecord,
              prompt_counts: list[int] | None = None) -> TextCollector | None:
        """Copy a primary request just placed in ``pool`` to that pool's shadows (those whose
        sample draws it); ``prompt_counts``: the primary's exact counts, if taken (a copy
        does not count again). Returns the collector of the primary's text, to be fed and ended
        with ``tap``/``primary_body``/``primary_failed``, or None when nothing was copied."""
        if (request.shadow or request.pooling or request.path == RESPONSES
                or model.name not in self.models):
            # Pooling answers are vectors and scores: no text to agree on. A Response is
            # stored where it ran (a copy would store another conversation elsewhere).
            return None
        primary: TextCollector | None = None
        for target in shadow_pools(model, pool):
            if target.sample < 1.0 and self.rng.random() >= target.sample:
                continue
            if self.in_flight >= self.max_in_flight:
                self.agreement.skipped(model.name, target.name, "in_flight_limit",
                                       is_greedy(request))
                continue
            if primary is None:
                primary = _PrimaryText(request.api, self.agreement.max_chars)
            pair = self.agreement.pair(model.name, target.name, pool, request, primary)
            primary.pairs.append(pair)
            copy = request._replace(shadow=True)
            self.in_flight += 1  # released in _run's finally, exactly once
            task = asyncio.create_task(self._run(copy, pair, primary_record, prompt_counts),
                                       name="canary-shadow")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return primary

    async def _run(self, request: GenerationRequest, pair: Pair, primary: RequestRecord,
                   prompt_counts: list[int] | None) -> None:
        ok = False
        try:
            # Its own record (no client hears of it: no access log line); tracing links
            # its attempt to the primary's request.
            record = RequestRecord(f"{primary.request_id}-shadow", primary.api, primary.route,
                                   time.perf_counter(), primary=primary, request=request)
            try:
                reply = await self.serve_copy(request, pair.pool, prompt_counts, record)
            except NotSent as refused:
                pair.skip(refused.reason)
                log.debug("shadow copy to %s not sent: %s", pair.pool, refused)
                return
            except GatewayError:
                return  # counted by the relay under role="shadow"; never retried
            if reply.stream is None:
                pair.shadow.body(reply.body)
                ok = reply.status < 400
                return
            try:
                pair.shadow.feed(reply.first)
                reply.stream.attach(_Reader(pair.shadow.feed))
                await reply.stream.wait()  # to the end: usage counted, lease closed
                ok = True
            finally:
                reply.stream.close()
        except Exception:  # noqa: BLE001 - a shadow never fails anything but itself
            log.exception("shadow copy to %s failed", pair.pool)
        finally:
            self.in_flight -= 1
            pair.shadow_done(ok)

    async def close(self) -> None:
        """Stop the copies still running (gateway shutdown); their leases close."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _PrimaryText(TextCollector):
    """The primary's text, shared by its pairs; each pair hears once when it ended."""

    __slots__ = ("pairs", "ended")

    def __init__(self, api: Any, max_chars: int) -> None:
        super().__init__(api, max_chars)
        self.pairs: list[Pair] = []
        self.ended = False

    def end(self, ok: bool) -> None:
        if not self.ended:
            self.ended = True
            for pair in self.pairs:
                pair.primary_done(ok)
            self.pairs = []


def primary_reply(primary: TextCollector, reply: "Reply") -> "Reply":
    """Have the primary's answer read on its way to the client: a body at once, a stream as
    it passes (its end, or the client leaving, ends the primary's side)."""
    assert isinstance(primary, _PrimaryText)
    if reply.stream is None:
        primary.body(reply.body)
        primary.end(reply.status < 400)
        return reply
    primary.feed(reply.first)
    reply.stream.tap(primary)  # ends the primary's side when the stream ends or is closed
    return reply


def primary_failed(primary: TextCollector) -> None:
    """The primary got no answer: its pairs are dropped."""
    assert isinstance(primary, _PrimaryText)
    primary.end(False)


class _Reader:
    """The relay's sink for a shadow copy: every byte read, never full."""

    __slots__ = ("feed",)

    def __init__(self, feed: Callable[[bytes], None]) -> None:
        self.feed = feed

    def write(self, data: bytes) -> bool:
        self.feed(data)
        return False

    def when_drained(self, callback: Callable[[], None]) -> None:
        callback()
