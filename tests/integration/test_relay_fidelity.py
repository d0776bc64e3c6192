"""The relay is byte-exact under any segmentation of what an engine writes.

Recorded streams of every dialect (``recorded_streams.py``) are replayed by a loopback engine
cut at arbitrary byte positions and event boundaries, with small pauses between the writes
(one event per write, several per write, an event split across writes). Through a real
gateway the client must receive exactly the engine's bytes, minus a usage chunk it did not
ask for, and the gateway must account exactly the engine's usage (else its token events)
and release every reserved token.

Translated streams (a TGI client on vLLM and on llama.cpp, OpenAI completions on TGI 1.4.3)
hold the same property: under any segmentation the client gets the bytes it gets from the
unsegmented stream (up to the per-response completion id and time the gateway writes), and
the accounting is exact. TGI requests go to a gateway's default model, so each OpenAI engine
that serves TGI clients has a gateway of its own.

``RELAY_FIDELITY_EXAMPLES`` sets the segmentations tried per recording (default 100);
``STREAM_TAIL_REQUESTS`` the streams of the per-event-write engine test (default 200).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import uuid
from pathlib import Path
from typing import Iterator

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from recorded_streams import RECORDINGS, Recording
from segmented_engine import OLD_TGI, PLANS, serving
from support import gateway_server, sim

EXAMPLES = int(os.environ.get("RELAY_FIDELITY_EXAMPLES", "100"))
STREAMS = int(os.environ.get("STREAM_TAIL_REQUESTS", "200"))
ENGINES = ("vllm", "sglang", "llamacpp", "tgi")
ADMIN = {"authorization": "Bearer fidelity"}
# Pauses before a write: shrinking goes to the first, which still keeps the writes apart.
GAPS = (0.001, 0.0, 0.003)


def _config(default: str, engine: str) -> dict:
    models = [{"name": f"m-{kind}", "replicas": [{"url": engine, "engine": kind,
                                                  "name": f"fake-{kind}"}]} for kind in ENGINES]
    models.append({"name": "m-tgi-1.4.3", "replicas": [
        {"url": engine + OLD_TGI, "engine": "tgi", "name": "fake-tgi-1.4.3"}]})
    # Health checks are not what this test checks: a loaded machine (real engines on the
    # other worker) once took the segmented engine past a 1 s check, and the replica's
    # requests were refused with a 503 mid-run.
    return {"models": models, "default_model": default, "admin_token": "fidelity",
            "health": {"interval": 0.5, "timeout": 10.0, "unhealthy_after": 3}}


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A gateway whose TGI clients reach each engine (its default model), all replicas served
    by the segmented engine: {default engine: URL}."""
    with serving() as engine, contextlib.ExitStack() as stack:
        yield {kind: stack.enter_context(gateway_server(
            tmp_path_factory.mktemp(f"fidelity-{kind}"), _config(f"m-{kind}", engine)))[0]
            for kind in ("tgi", "vllm", "llamacpp")}


def _gateway_for(gateways: dict[str, str], recording: Recording) -> str:
    return gateways[recording.engine] if recording.path.startswith("/generate") else gateways["tgi"]


def _translated(recording: Recording) -> bool:
    if recording.path.startswith("/v1"):
        return recording.engine == "tgi-1.4.3"
    return recording.engine != "tgi"


# The gateway's own per-response completion id and time (streams translated from TGI).
_PER_RESPONSE = re.compile(rb'"id":"cmpl-[0-9a-f]+","object":"text_completion","created":\d+')


def _same_response(data: bytes) -> bytes:
    return _PER_RESPONSE.sub(b'"id":"cmpl-","object":"text_completion","created":0', data)


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


def _send(client: httpx.Client, gateway: str, recording: Recording, plan: dict,
          wants_usage: bool) -> bytes:
    body = dict(recording.body)
    if recording.path.startswith("/v1"):
        body["model"] = f"m-{recording.engine}"
    if recording.stream and recording.path.startswith("/v1") and wants_usage:
        body["stream_options"] = {"include_usage": True}
    request_id = uuid.uuid4().hex
    if _translated(recording):  # the body is rewritten on its way: the plan goes by request id
        PLANS[request_id] = plan
    else:
        body["segmentation"] = plan
    try:
        with client.stream("POST", gateway + recording.path, content=orjson.dumps(body),
                           headers={"x-request-id": request_id}) as reply:
            received = b"".join(reply.iter_raw())
    finally:
        PLANS.pop(request_id, None)
    assert reply.status_code == 200, received
    return received


def _translated_reference(client: httpx.Client, gateway: str, recording: Recording,
                          wants_usage: bool) -> bytes:
    """The client's bytes from the unsegmented stream, checked for what they must say."""
    data = _send(client, gateway, recording, {"recording": recording.name, "cuts": [], "gaps": []},
                 wants_usage)
    events = [e.partition(b"data:")[2].strip() for e in data.split(b"\n\n") if e.strip()]
    if recording.path.startswith("/generate"):
        parsed = [orjson.loads(e) for e in events]
        assert [e["index"] for e in parsed] == list(range(1, recording.usage[1] + 1))
        final = parsed[-1]
        assert final["generated_text"] == "".join(e["token"]["text"] for e in parsed
                                                  if not e["token"]["special"])
        assert final["details"]["generated_tokens"] == recording.usage[1]
        assert final["details"]["input_length"] == recording.usage[0]
    else:
        assert events[-1] == b"[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert sum(bool(c["choices"]) for c in chunks) == recording.usage[1]
        assert [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")] == (
            [recording.usage[1]] if wants_usage else [])
    return _same_response(data)


@pytest.mark.parametrize("name", list(RECORDINGS))
def test_client_receives_the_engines_bytes_under_any_segmentation(gateways: dict[str, str],
                                                                    name: str) -> None:
    recording = RECORDINGS[name]
    gateway = _gateway_for(gateways, recording)
    openai_stream = recording.stream and recording.path.startswith("/v1")
    client = httpx.Client(timeout=30)
    references: dict[bool, bytes] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(plan=segmentations(recording), wants_usage=st.booleans())
    # The last byte apart: an error event's [DONE] cut short ended a stream without it.
    @example(plan=([len(recording.data) - 1], [0.001]), wants_usage=False)
    def relayed_exactly(plan: tuple[list[int], list[float]], wants_usage: bool) -> None:
        cuts, gaps = plan
        if _translated(recording) and wants_usage not in references:
            references[wants_usage] = _translated_reference(client, gateway, recording, wants_usage)
        prompt_before, generated_before = accounted(client, gateway, recording)
        received = _send(client, gateway, recording,
                         {"recording": name, "cuts": cuts, "gaps": gaps}, wants_usage)
        if _translated(recording):
            assert _same_response(received) == references[wants_usage]
        else:
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
