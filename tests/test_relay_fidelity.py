"""The relay is byte-exact under any segmentation of what an engine writes.

Recorded streams of every dialect (``recorded_streams.py``) are replayed by a loopback engine
cut at arbitrary byte positions and event boundaries, with small pauses between the writes
(one event per write, several per write, an event split across writes). Through a real
gateway the client must receive exactly the engine's bytes, minus a usage chunk it did not
ask for, and the gateway must account exactly the engine's usage (else its token events)
and release every reserved token.

``RELAY_FIDELITY_EXAMPLES`` sets the segmentations tried per recording (default 100);
``STREAM_TAIL_REQUESTS`` the streams of the per-event-write engine test (default 200).
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Iterator

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recorded_streams import RECORDINGS, Recording
from segmented_engine import serving
from support import gateway_server, sim

EXAMPLES = int(os.environ.get("RELAY_FIDELITY_EXAMPLES", "100"))
STREAMS = int(os.environ.get("STREAM_TAIL_REQUESTS", "200"))
ENGINES = ("vllm", "sglang", "llamacpp", "tgi")
ADMIN = {"authorization": "Bearer fidelity"}
# Pauses before a write: shrinking goes to the first, which still keeps the writes apart.
GAPS = (0.001, 0.0, 0.003)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One replica per engine dialect, all served by the segmented engine."""
    with serving() as engine:
        config = {"models": [{"name": f"m-{kind}", "replicas": [
                      {"url": engine, "engine": kind, "name": f"fake-{kind}"}]} for kind in ENGINES],
                  "default_model": "m-tgi", "admin_token": "fidelity",
                  "health": {"interval": 0.5, "timeout": 1.0}}
        with gateway_server(tmp_path_factory.mktemp("fidelity"), config) as (url, _):
            yield url


def segmentations(recording: Recording) -> st.SearchStrategy[tuple[list[int], list[float]]]:
    """Cuts at any subset of event boundaries plus a few arbitrary byte positions; a pause
    before each piece but the first."""
    boundaries = recording.event_ends()
    cuts = st.tuples(st.lists(st.sampled_from(boundaries), unique=True) if boundaries else st.just([]),
                     st.lists(st.integers(1, len(recording.data) - 1), unique=True, max_size=6))
    return cuts.map(lambda c: sorted(set(c[0]) | set(c[1]))).flatmap(
        lambda c: st.tuples(st.just(c), st.lists(st.sampled_from(GAPS), min_size=len(c),
                                                  max_size=len(c))))


def accounted(client: httpx.Client, url: str, recording: Recording) -> tuple[float, float]:
    """The gateway's prompt and generated token counters of the recording's replica and API
    (read with a regex: a full exposition parse per example would cost more than the rest)."""
    api = "openai" if recording.path.startswith("/v1") else "tgi"
    text = client.get(url + "/metrics").text

    def counter(name: str) -> float:
        return sum(float(value) for labels, value in re.findall(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M)
                   if f'replica="fake-{recording.engine}"' in labels and f'api="{api}"' in labels)
    return counter("llm_gateway_prompt_tokens_total"), counter("llm_gateway_generation_tokens_total")


@pytest.mark.parametrize("name", list(RECORDINGS))
def test_client_receives_the_engines_bytes_under_any_segmentation(gateway: str, name: str) -> None:
    recording = RECORDINGS[name]
    openai_stream = recording.stream and recording.path.startswith("/v1")
    client = httpx.Client(timeout=30)

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(plan=segmentations(recording), wants_usage=st.booleans())
    def relayed_exactly(plan: tuple[list[int], list[float]], wants_usage: bool) -> None:
        cuts, gaps = plan
        body = {**recording.body, "segmentation": {"recording": name, "cuts": cuts, "gaps": gaps}}
        if recording.path.startswith("/v1"):
            body["model"] = f"m-{recording.engine}"
        if openai_stream and wants_usage:
            body["stream_options"] = {"include_usage": True}
        prompt_before, generated_before = accounted(client, gateway, recording)
        with client.stream("POST", gateway + recording.path, content=orjson.dumps(body)) as reply:
            received = b"".join(reply.iter_raw())
        assert reply.status_code == 200, received
        assert received == recording.expected(wants_usage or not openai_stream)
        prompt_after, generated_after = accounted(client, gateway, recording)
        assert generated_after - generated_before == recording.usage[1]
        assert prompt_after - prompt_before == (recording.usage[0] or 0)
        replica = next(r for r in client.get(gateway + "/admin/replicas", headers=ADMIN).json()["replicas"]
                       if r["name"] == f"fake-{recording.engine}")
        assert (replica["outstanding_tokens"], replica["in_flight"]) == (0, 0)

    try:
        relayed_exactly()
    finally:
        client.close()


async def _stream_all(url: str, n: int, concurrency: int = 4) -> list[tuple[bool, bytes]]:
    """``n`` streamed completions, every other one asking for usage: (asked, bytes received)."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(i: int) -> tuple[bool, bytes]:
            body = {"model": "sim-model", "prompt": "Tell me a story", "max_tokens": 64, "stream": True}
            if i % 2:
                body["stream_options"] = {"include_usage": True}
            async with gate, client.stream("POST", url + "/v1/completions", json=body) as reply:
                return bool(i % 2), b"".join([chunk async for chunk in reply.aiter_raw()])
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_streams_of_a_per_event_engine_arrive_whole(tmp_path: Path) -> None:
    """An engine that writes each event as soon as it has it (its usage chunk and [DONE] on
    their own, as vLLM does), through one gateway worker at concurrency 4: every stream ends
    with [DONE], and carries the engine's usage exactly when the client asked for it."""
    with sim("vllm", "sim-model", 4096, "--profile", "instant", "--event-writes") as engine:
        config = {"models": [{"name": "sim-model", "replicas": [{"url": engine, "engine": "vllm"}]}]}
        with gateway_server(tmp_path, config) as (url, _):
            before = httpx.get(engine + "/sim/state").json()
            streams = asyncio.run(_stream_all(url, STREAMS))
            after = httpx.get(engine + "/sim/state").json()
    prompt = (after["prompt_tokens_total"] - before["prompt_tokens_total"]) / STREAMS
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 64 * STREAMS
    for asked, data in streams:
        events = data.split(b"\n\n")[:-1]
        assert events[-1] == b"data: [DONE]", data[-300:]
        usage = [orjson.loads(e[6:])["usage"] for e in events if b'"usage":{' in e]
        assert usage == ([{"prompt_tokens": prompt, "total_tokens": prompt + 64, "completion_tokens": 64}]
                         if asked else [])
        assert len(events) == 64 + 1 + asked  # tokens, [DONE], the usage chunk if asked
