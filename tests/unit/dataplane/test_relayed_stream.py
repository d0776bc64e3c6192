"""``RelayedStream`` without sockets: a fake upstream response feeds it, a fake client sink
takes what it writes, a fake clock says when. Timers are driven by advancing the clock and
firing the stream's timer as the loop would (its real timer is armed far in the future)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Callable

import orjson
import pytest

from gateway.balance.ledger import InProcessLedger
from gateway.config import TimeoutsConfig
from gateway.dataplane.outcome import Attempt, Listener, Outcomes
from gateway.dataplane.relay import Relay
from gateway.dataplane.relayed_stream import RelayedStream
from gateway.dataplane.reply import Reply
from gateway.fleet.replica import Replica
from gateway.protocol.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.protocol.openai import parse_completion
from gateway.protocol.translate.passthrough import PassThrough
from gateway.upstream import UpstreamTransportError
from gateway.upstream.failure import FailureKind

TIMEOUTS = TimeoutsConfig(first_token=30.0, between_tokens=10.0, total=600.0)


def token(text: str) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"index": 0, "text": text}]}) + b"\n\n"


ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
DONE = b"data: [DONE]\n\n"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Response:
    """The upstream response: records what the stream asked of it."""

    def __init__(self) -> None:
        self.paused = self.closed = self.ended = False
        self.pauses = 0

    def pause_reading(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True


class Sink:
    """The client: keeps what it is sent; ``full`` while it is not keeping up."""

    def __init__(self) -> None:
        self.data = b""
        self.full = False
        self.drained: list[Callable[[], None]] = []

    def write(self, data: bytes) -> bool:
        self.data += data
        return self.full

    def when_drained(self, callback: Callable[[], None]) -> None:
        self.drained.append(callback)

    def drain(self) -> None:
        self.full = False
        callbacks, self.drained = self.drained, []
        for callback in callbacks:
            callback()


class Heard(Listener):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def first_token(self, attempt: Attempt) -> None:
        self.calls.append("first_token")

    def ended(self, attempt: Attempt) -> None:
        self.calls.append("ended")


class Setup:
    def __init__(self) -> None:
        self.clock = Clock()
        self.heard = Heard()
        self.relay = Relay(None, TIMEOUTS, Outcomes([self.heard]),  # type: ignore[arg-type]
                           self.clock)
        self.ledger = InProcessLedger()
        replica = Replica("r0", "http://127.0.0.1:1", "vllm", "m", "default")
        self.lease = self.ledger.lease("r0", 10, 100)
        request = parse_completion(orjson.dumps({"model": "m", "prompt": "hi", "stream": True,
                                                 "stream_options": {"include_usage": True}}))
        placement = SimpleNamespace(replica=replica, lease=self.lease)
        self.attempt = Attempt(request, placement, self.clock.now)  # type: ignore[arg-type]
        self.response = Response()
        self.reply = Reply(200, [])
        reader = PassThrough(request).reader()
        self.stream = RelayedStream(self.relay, self.attempt,
                                    self.response, reader, self.reply)  # type: ignore[arg-type]
        self.sink = Sink()

    def fire_timer(self) -> None:
        """What the loop does when the stream's timer is due."""
        self.stream._timer.cancel()
        self.stream._on_timer()


async def test_tokenless_events_wait_for_the_first_token_then_go_out_with_it() -> None:
    s = Setup()
    s.stream.on_body(ROLE)
    assert not s.stream._first.done()  # a retry is still possible: nothing is sent
    s.clock.now += 0.5
    s.stream.on_body(token("a"))
    assert await s.stream.first() == ROLE + token("a")
    assert s.attempt.first_at == 100.5 and s.heard.calls == ["first_token"]
    assert s.ledger.load("r0").in_flight == 1


async def test_what_arrives_before_attach_is_sent_first_in_order_then_each_read_at_once() -> None:
    s = Setup()
    s.stream.on_body(token("a"))
    await s.stream.first()
    s.stream.on_body(token("b"))
    s.stream.on_body(token("c"))
    assert s.sink.data == b""
    s.stream.attach(s.sink)
    assert s.sink.data == token("b") + token("c")
    s.stream.on_body(token("d") + DONE)
    assert s.sink.data.endswith(token("d") + DONE)
    s.stream.on_end(None)
    await s.stream.wait()
    assert s.attempt.status == 200 and s.attempt.error is None and s.attempt.completed
    assert s.attempt.usage.completion_tokens == 4  # no usage chunk: the token events
    assert s.heard.calls == ["first_token", "ended"] and s.lease.closed


async def test_a_client_that_does_not_keep_up_pauses_the_upstream_until_it_drains() -> None:
    s = Setup()
    s.stream.on_body(token("a"))
    await s.stream.first()
    s.stream.attach(s.sink)
    s.sink.full = True
    s.stream.on_body(token("b"))
    assert s.response.paused and s.response.pauses == 1
    s.stream.on_body(token("c"))  # already read: written, not paused twice
    assert s.response.pauses == 1 and s.sink.data == token("b") + token("c")
    # Paused for the client's sake, past the between-tokens timeout: not the replica's fault.
    s.clock.now += TIMEOUTS.between_tokens * 3
    s.fire_timer()
    assert not s.stream.ended
    s.sink.drain()
    assert not s.response.paused and s.stream.active_at == s.clock.now  # its wait restarts
    s.clock.now += TIMEOUTS.between_tokens - 1
    s.fire_timer()
    assert not s.stream.ended
    s.stream.close()


async def test_no_first_token_in_time_is_a_timeout_before_any_byte_reached_the_client() -> None:
    s = Setup()
    s.stream.on_body(ROLE)  # activity, not a token: the first-token clock still runs
    s.clock.now += TIMEOUTS.first_token - 1
    s.fire_timer()
    assert not s.stream.ended  # re-armed: 1 s left
    s.clock.now += 1
    s.fire_timer()
    with pytest.raises(UpstreamTimeout) as error:
        await s.stream.first()
    assert error.value.failure is FailureKind.STREAM_TIMEOUT and not error.value.failure.retryable
    assert s.attempt.error is FailureKind.STREAM_TIMEOUT and s.attempt.status == 504
    assert s.response.closed and s.lease.closed and s.heard.calls == ["ended"]


async def test_a_stall_between_tokens_ends_the_stream_with_the_protocols_error_event() -> None:
    s = Setup()
    s.stream.on_body(token("a"))
    await s.stream.first()
    s.stream.attach(s.sink)
    s.clock.now += TIMEOUTS.between_tokens / 2
    s.stream.on_body(token("b"))  # moves the deadline
    s.clock.now += TIMEOUTS.between_tokens * 0.9
    s.fire_timer()
    assert not s.stream.ended
    s.clock.now += TIMEOUTS.between_tokens * 0.2
    s.fire_timer()
    assert s.stream.ended and s.attempt.error is FailureKind.STREAM_TIMEOUT
    event = s.sink.data[len(token("b")):]
    assert event.startswith(b'data: {"error":') and event.endswith(DONE)
    assert s.attempt.status == 504 and s.response.closed


async def test_the_total_budget_holds_however_often_tokens_come() -> None:
    s = Setup()
    s.stream.on_body(token("a"))
    await s.stream.first()
    s.stream.attach(s.sink)
    while s.clock.now - s.attempt.arrival < TIMEOUTS.total:
        s.clock.now += TIMEOUTS.between_tokens / 2
        s.stream.on_body(token("x"))
    s.fire_timer()
    assert s.stream.ended and s.attempt.error is FailureKind.STREAM_TIMEOUT


async def test_a_break_before_the_first_token_may_be_retried_after_it_may_not() -> None:
    s = Setup()
    s.stream.on_body(ROLE)
    s.stream.on_end(UpstreamTransportError("reset"))
    with pytest.raises(UpstreamUnavailable) as error:
        await s.stream.first()
    assert error.value.failure is FailureKind.STREAM_BROKEN and error.value.failure.retryable
    assert s.attempt.error is FailureKind.STREAM_BROKEN and s.attempt.status == 502
    late = Setup()
    late.stream.on_body(token("a"))
    await late.stream.first()
    late.stream.attach(late.sink)
    late.stream.on_end(None)  # no [DONE]: ended before it was complete
    assert late.attempt.error is FailureKind.STREAM_BROKEN
    assert late.sink.data.startswith(b'data: {"error":')  # told in the stream, not retried


async def test_a_client_that_leaves_aborts_the_stream_once() -> None:
    s = Setup()
    s.stream.on_body(token("a"))
    await s.stream.first()
    s.stream.attach(s.sink)
    s.stream.close()
    s.stream.close()
    s.stream.on_body(token("b"))  # after the end: ignored
    assert s.attempt.status == 499 and s.attempt.error is None and s.response.closed
    assert s.heard.calls == ["first_token", "ended"] and s.sink.data == b""
    assert s.ledger.load("r0").in_flight == 0


class Resumes:
    """A migrator that only records the streams handed to it (``gateway.migrate``)."""

    stall_timeout = 3.0

    def __init__(self) -> None:
        self.resumed: list[str] = []

    async def resume(self, stream: RelayedStream, log, plan, broken: Attempt,  # noqa: ANN001
                     tried) -> None:  # noqa: ANN001
        self.resumed.append(broken.broke or "")


def ids_token(text: str, token_id: int) -> bytes:
    return b"data: " + orjson.dumps({"id": "cmpl-1", "object": "text_completion",
                                     "created": 1, "model": "m", "choices": [
        {"index": 0, "text": text, "token_ids": [token_id]}]}) + b"\n\n"


async def test_a_hung_replica_is_told_from_a_slow_token_by_its_other_streams() -> None:
    """With migration, a stream silent for ``stall_timeout`` breaks only when every other
    stream of its replica is silent too (``Replica.streamed_at``); then it goes on."""
    from gateway.migrate.migrator import Continuable
    from gateway.migrate.token_log import TokenLog

    s = Setup()
    migrator = Resumes()
    s.relay.migrator = migrator  # type: ignore[assignment]
    request = s.attempt.request
    plan = Continuable(PassThrough(request), chat=False, strip=True)
    reader = TokenLog(PassThrough(request).reader(), strip=True)
    stream = RelayedStream(s.relay, s.attempt, s.response, reader, s.reply,  # type: ignore[arg-type]
                           record=SimpleNamespace(), plan=plan)  # type: ignore[arg-type]
    stream.on_body(ids_token("a", 5))
    await stream.first()
    stream.attach(s.sink)
    replica = s.attempt.placement.replica
    for _ in range(3):  # its other streams move: a slow token, not a hung engine
        s.clock.now += 2.0
        replica.streamed_at = s.clock.now
        stream._timer.cancel()
        stream._on_timer()
        assert not stream.ended and not migrator.resumed
    s.clock.now += migrator.stall_timeout  # and now nothing of its replica moves
    stream._timer.cancel()
    stream._on_timer()
    await asyncio.sleep(0)
    assert migrator.resumed == ["stall"] and s.attempt.error is FailureKind.STREAM_TIMEOUT
    assert s.response.closed and s.lease.closed and not stream.ended  # it goes on elsewhere
    stream.close()
