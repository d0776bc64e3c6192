"""The access log's lines from request records, without sockets."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

from gateway.config import AccessLogConfig
from gateway.upstream.failure import FailureKind
from gateway.dataplane.outcome import Attempt, Outcomes, Refusal, RequestRecord
from gateway.fleet.replica import Replica
from gateway.observe.access_log import AccessLog, entry, trace_id_of
from gateway.protocol.errors import Api
from gateway.protocol.reasons import Reason
from gateway.protocol.request import GenerationRequest
from gateway.protocol.usage import Usage
from support import wait_until_async

FIELDS = {"time", "request_id", "trace_id", "api", "route", "model", "pool", "replica", "engine",
          "key", "stream", "status", "error", "attempts", "retries", "queue_wait_s", "ttft_s",
          "itl_mean_s", "e2e_s", "prompt_tokens", "output_tokens", "finish_reason",
          "client_left", "migrated"}


def served(traceparent: bytes | None = None) -> RequestRecord:
    record = RequestRecord("req-7", Api.TGI, "/generate_stream", 10.0, traceparent)
    record.request = GenerationRequest(api=Api.TGI, path="/generate_stream", body={},
                                       raw=b"{}", model=None, stream=True, max_tokens=8,
                                       prompt="the prompt text")
    record.model, record.key, record.status = "llama", "team-a", 200
    for name, queued in (("r0", 0.25), ("r1", 0.0)):
        replica = Replica(name=name, url="http://h", engine="vllm", model="llama", pool="stable")
        one = Attempt(record.request, SimpleNamespace(replica=replica, queued_for=queued),
                      record.arrival)  # type: ignore[arg-type]
        record.attempts.append(one)
    failed, ok = record.attempts
    failed.end(502, FailureKind.CONNECT)
    failed.retried = True  # as the retry loop marks it
    ok.answered, ok.first_at, ok.last_at = True, 10.5, 11.5
    ok.usage = Usage(20, 5, "length")
    ok.end(200)
    record.ended_at = 12.0
    return record


def test_a_line_has_every_field_and_no_text() -> None:
    line = entry(served(), now_wall=1_700_000_002.0, now=12.0)
    assert set(line) == FIELDS
    assert line["time"] == "2023-11-14T22:13:20.000+00:00"  # arrival: 2 s before "now"
    assert line["attempts"] == 2 and line["retries"] == 1 and line["migrated"] is None
    assert line["replica"] == "r1" and line["pool"] == "stable" and line["engine"] == "vllm"
    assert line["queue_wait_s"] == 0.25 and line["ttft_s"] == 0.5 and line["e2e_s"] == 2.0
    assert line["itl_mean_s"] == 0.25  # 4 gaps in 1 s
    assert (line["prompt_tokens"], line["output_tokens"]) == (20, 5)
    assert line["finish_reason"] == "length" and line["error"] is None
    assert line["key"] == "team-a" and line["trace_id"] is None
    assert b"the prompt text" not in orjson.dumps(line)


def test_the_trace_id_is_the_gateways_or_else_the_clients() -> None:
    client = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    record = served(client)
    assert entry(record, 0.0, 12.0)["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    record.trace_id = "f" * 32
    assert entry(record, 0.0, 12.0)["trace_id"] == "f" * 32


@pytest.mark.parametrize("bad", [b"", b"00", b"00-" + b"0" * 32 + b"-" + b"1" * 16 + b"-01",
                                 b"00-" + b"z" * 32 + b"-" + b"1" * 16 + b"-01"])
def test_a_bad_traceparent_gives_no_trace_id(bad: bytes) -> None:
    assert trace_id_of(bad) is None


def test_a_refused_request_has_its_error_and_no_replica() -> None:
    record = RequestRecord("r", Api.OPENAI, "/v1/completions", 1.0, status=400,
                           refusal=Refusal(Reason.CONTEXT_LENGTH, "m", Api.OPENAI), ended_at=1.001)
    line = entry(record, 100.0, 1.001)
    assert line["replica"] is None and line["attempts"] == 0 and line["retries"] == 0
    assert line["error"] == "context_length" and line["status"] == 400


async def test_lines_are_written_whole_after_the_interval_and_sampled(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    log = AccessLog(AccessLogConfig(enabled=True, path=str(path), flush_interval=0.05))
    outcomes = Outcomes([log])
    assert outcomes.ends and not outcomes.starts and not outcomes.sends
    for _ in range(3):
        outcomes.request_ended(served())
    assert not path.exists() or path.read_bytes() == b""  # in memory until the interval
    await wait_until_async(lambda: path.exists() and len(path.read_bytes().splitlines()) == 3,
                           5, "the interval's flush")
    lines = path.read_bytes().splitlines()
    assert len(lines) == 3 and all(orjson.loads(line)["request_id"] == "req-7" for line in lines)
    log.close()
    sampled = AccessLog(AccessLogConfig(enabled=True, path=str(path), sampling=0.1),
                        rng=random.Random(1))
    for _ in range(1000):
        sampled.request_ended(served())
    sampled.close()
    assert 60 < len(path.read_bytes().splitlines()) - 3 < 140
