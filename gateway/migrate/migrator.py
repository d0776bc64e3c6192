"""Continuing a broken stream on another replica of its pool.

``Migrator.plan`` decides, as a stream is sent, whether it could go on elsewhere exactly
(``exactness.refusal``); if so the engine is asked for token ids (``return_token_ids``) and
the stream is read through a ``TokenLog``. When the stream then breaks after its first token
(``gateway.dataplane.relay``: the connection lost, an error event, a hung engine), the relay
ends that attempt (its replica failed it: outlier detection and metrics hear so, its lease
is released) and ``Migrator.resume`` places the continuation on another replica (never one
tried, draining or ejected; within the retry budget and ``migration.max_attempts``), sends
it (``continuation.body``) and hands its answer back to the same client stream, joined by
``continuation.splice``. A stream whose generation had ended (its finish reason read) is
finished without one: the engine's last events are written as it would have sent them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol

import orjson

from gateway.balance.policy import RequestCost
from gateway.dataplane.outcome import Attempt, Migration
from gateway.migrate import continuation
from gateway.migrate.config import MigrationConfig
from gateway.migrate.exactness import NotContinued, refusal
from gateway.migrate.token_log import TokenLog
from gateway.protocol.errors import GatewayError, NoReplicaAvailable, error_from_engine
from gateway.protocol.request import GenerationRequest
from gateway.protocol.translate import PassThrough, StreamReader, Translation
from gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from gateway.upstream.failure import FailureKind

if TYPE_CHECKING:
    from gateway.config import TimeoutsConfig
    from gateway.dataplane.admission import Admission
    from gateway.dataplane.outcome import Outcomes, RequestRecord
    from gateway.dataplane.placement import Placement, Placer
    from gateway.dataplane.retry_budget import RetryBudget
    from gateway.fleet.replica import Replica

_ASK_IDS = b',"return_token_ids":true}'
_JSON = ((b"content-type", b"application/json"),)
# Tokens whose text the engine held back (their text ended inside, or on an invalid, UTF-8
# sequence: a random-weight model writes runs of byte tokens), at most, before a break is
# refused; each one more costs a /detokenize of the new replica.
MAX_HELD = 32
_HELD = -1  # (``_whole``: more than MAX_HELD held)


@dataclass(slots=True)
class Continuable:
    """A stream that can go on elsewhere: what was sent, and how it is read."""

    translation: Translation
    chat: bool  # a chat client on its own dialect: the continuation's chunks become chat's
    strip: bool  # the client did not ask for token ids: they go out as null

    def ask_ids(self, body: bytes) -> bytes:
        """The engine's body (a JSON object), asking for the token ids of the prompt and of
        each chunk (a key given twice: JSON's last one counts, as in vLLM's parser)."""
        if b'"return_token_ids":true' in body:
            return body
        return body.rstrip()[:-1] + _ASK_IDS

    def log(self, reader: StreamReader) -> TokenLog:
        return TokenLog(reader, self.strip)


Plan = Continuable | NotContinued


class BrokenStream(Protocol):
    """A client's stream whose attempt broke (``gateway.dataplane.relayed_stream.RelayedStream``)."""

    request: GenerationRequest
    record: "RequestRecord | None"
    reader: StreamReader

    def continue_with(self, attempt: Attempt, response: UpstreamResponse) -> None:
        """Read on from the continuation's answer (its reader told how)."""

    def not_continued(self, why: NotContinued) -> None:
        """End the stream with the error event: it cannot go on."""


Send = Callable[[Attempt, "RequestRecord", str, bytes],
                Awaitable[tuple[UpstreamResponse, bytes]]]


class Migrator:
    """``send``: how an attempt reaches its replica (``Relay.send``)."""

    def __init__(self, config: MigrationConfig, placer: "Placer", send: Send,
                 pool: UpstreamPool, timeouts: "TimeoutsConfig", outcomes: "Outcomes",
                 budget: "RetryBudget") -> None:
        self.config = config
        self.placer = placer
        self.send = send
        self.pool = pool  # and ``timeouts``: for asking a replica to detokenize
        self.timeouts = timeouts
        self.outcomes = outcomes
        self.budget = budget

    @property
    def stall_timeout(self) -> float:
        return self.config.stall_timeout

    def plan(self, request: GenerationRequest, placement: "Placement",
             translation: Translation) -> Plan:
        """Whether ``request``'s stream, sent as ``translation`` to ``placement``, could go on
        elsewhere exactly if it broke."""
        if not self.config.enabled:
            return NotContinued.DISABLED
        why = refusal(request, placement.replica.profile)
        if why is not None:
            return why
        same_dialect = isinstance(translation, PassThrough)
        return Continuable(translation, chat=same_dialect and request.is_chat,
                           strip=same_dialect and request.body.get("return_token_ids") is not True)

    async def resume(self, stream: BrokenStream, log: TokenLog, plan: Continuable,
                     broken: Attempt, tried: list["Replica"]) -> None:
        """Place and send the continuation of ``stream`` (whose attempt ``broken`` just
        ended; ``tried``: the replicas it ran on, each continuation one more) and hand its
        answer to the stream; or end the stream with the error event when it cannot go on."""
        request, record = stream.request, stream.record
        assert record is not None
        placement: "Placement | None" = None
        try:
            prompt, generated = log.prompt_ids(), log.generated_ids()
            if prompt is None or len(generated) < stream.reader.token_events:
                return stream.not_continued(NotContinued.NO_TOKEN_IDS)
            sent = orjson.loads(plan.translation.body)
            first = broken.placement
            allowed = continuation.tokens_left(sent, plan.chat, len(prompt), 0,
                                               first.model.window(first.replica))
            if allowed is None or allowed <= len(generated):
                return stream.not_continued(NotContinued.NO_TOKENS_LEFT)
            origin = continuation.Origin.of(log.head)
            cost = RequestCost(len(prompt) + len(generated), allowed - len(generated),
                               session=first.admission.cost.session)
            admission = dataclasses.replace(
                first.admission, cost=cost,
                replicas=[r for r in first.admission.replicas
                          if r.pool == first.replica.pool and r.profile.continues])
            for _ in range(self.config.max_attempts - (len(tried) - 1)):
                if not self.budget.try_spend():
                    return stream.not_continued(NotContinued.BUDGET)
                try:
                    placement = await self._place(first, admission, tried)
                except GatewayError:  # none left to take it (or a queue that will not)
                    return stream.not_continued(NotContinued.NO_REPLICA)
                whole = await self._whole(placement, generated)
                if whole == _HELD:
                    return stream.not_continued(NotContinued.HELD)
                if whole is None:  # it cannot say: the next one may
                    tried.append(placement.replica)
                    placement.lease.close()
                    placement = None
                    continue
                attempt = Attempt(request, placement, record.arrival,
                                  migration=Migration(broken, whole))
                record.attempts.append(attempt)
                body = continuation.body(sent, plan.chat, prompt + generated[:whole], whole,
                                         allowed - whole)
                response = await self._send(attempt, body, record)
                if response is None:
                    tried.append(placement.replica)
                    placement = None
                    continue
                log.continue_from(continuation.splice(origin, plan.chat, len(prompt), whole),
                                  generated[whole:], attempt.migration.inexact)
                stream.continue_with(attempt, response)
                placement = None  # the stream holds its lease now
                return None
            return stream.not_continued(NotContinued.ATTEMPTS)
        except ValueError:  # a first event the continuation cannot name itself after
            return stream.not_continued(NotContinued.NO_TOKEN_IDS)
        finally:
            if placement is not None:
                placement.lease.close()

    async def _whole(self, placement: "Placement", generated: list[int]) -> int | None:
        """How many of the ``generated`` tokens went out whole: the most whose text does not
        end inside a character, asked of the new replica's own detokenizer (vLLM holds back
        text that ends with U+FFFD; a chunk's text cannot tell which of its tokens it held).
        A continuation starts there: vLLM 0.32, given a prompt that ends inside a character,
        writes the prompt's own text into its first chunk (seen on the CPU build). None:
        the replica did not answer; ``_HELD``: more than ``MAX_HELD`` were held. All of them
        first (usually the answer); else every shorter one at once (one round trip, not one
        each: a run of byte tokens is common)."""
        text = await self._detokenized(placement, generated)
        if text is None or not text.endswith("\ufffd"):
            return None if text is None else len(generated)
        lengths = range(len(generated) - 1, max(len(generated) - MAX_HELD, 0) - 1, -1)
        texts = await asyncio.gather(*(self._detokenized(placement, generated[:n])
                                       for n in lengths))
        for n, text in zip(lengths, texts):
            if text is None:
                return None
            if not text.endswith("\ufffd"):
                return n
        return _HELD

    async def _detokenized(self, placement: "Placement", ids: list[int]) -> str | None:
        """The replica's text of ``ids`` (its ``/detokenize``); None: it did not answer."""
        if not ids:
            return ""
        try:
            async with asyncio.timeout(self.timeouts.connect):
                response = await self.pool.request(
                    placement.replica.url, "/detokenize",
                    orjson.dumps({"model": placement.name, "tokens": ids}), _JSON,
                    self.timeouts.connect)
                answer = await response.read()
            text = orjson.loads(answer)["prompt"] if response.status == 200 else None
        except (TimeoutError, UpstreamError, orjson.JSONDecodeError, KeyError, TypeError):
            return None
        return text if isinstance(text, str) else None

    async def _place(self, first: "Placement", admission: "Admission",
                     tried: list["Replica"]) -> "Placement":
        """A replica for the continuation: one the stream has not run on, else (the pool
        is small) any but the one that just broke it. Draining, ejected and unhealthy
        replicas never (``Placer``)."""
        ask = replace(first.ask, admission=admission, streamed=True)
        try:
            return await self.placer.place(replace(ask, exclude=tuple(tried)))
        except NoReplicaAvailable:
            return await self.placer.place(replace(ask, exclude=tuple(tried[-1:])))

    async def _send(self, attempt: Attempt, body: bytes,
                    record: "RequestRecord") -> UpstreamResponse | None:
        """The continuation's answer once it began (2xx); None when its replica failed it
        (the attempt is ended and told)."""
        response = None
        try:
            response, content = await self.send(attempt, record, continuation.PATH, body)
            if response.status < 400:
                attempt.answered = True
                return response
            response.close()
            error: GatewayError = error_from_engine(response.status, content)
            status, failure = response.status, error.failure or FailureKind.of_status(
                response.status)
        except GatewayError as exc:  # the replica did not answer (in time)
            status, failure = exc.status, exc.failure
        except BaseException:  # the client left meanwhile
            attempt.placement.lease.close()
            attempt.end(499)
            self.outcomes.ended(attempt)
            raise
        attempt.placement.lease.close()
        attempt.end(status, failure)
        self.outcomes.ended(attempt)
        return None
