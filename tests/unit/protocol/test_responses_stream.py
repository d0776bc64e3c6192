"""The Responses API stream read as the relay reads it: whole events only, deltas counted as
tokens, the stored id and usage from the created and final events, however reads split."""

from __future__ import annotations

import orjson
import pytest

from gateway.protocol.translate.responses import ResponsesPassThrough, ResponsesStream


def _event(kind: str, **fields: object) -> bytes:
    return (b"event: " + kind.encode() + b"\ndata: "
            + orjson.dumps({**fields, "type": kind}) + b"\n\n")


STREAM = b"".join([
    _event("response.created", response={"id": "resp_1", "status": "in_progress", "usage": None}),
    _event("response.in_progress", response={"id": "resp_1"}),
    *(_event("response.output_text.delta", delta=f'"type":"response.x.delta" {i}')
      for i in range(5)),
    _event("response.output_text.done", text="..."),
    _event("response.completed", response={"id": "resp_1", "usage": {
        "input_tokens": 7, "output_tokens": 5, "total_tokens": 12}}),
])


@pytest.mark.parametrize("size", [1, 7, 50, len(STREAM)])
def test_any_split_gives_the_same_reading(size: int) -> None:
    reader, out, tokens = ResponsesStream(), b"", 0
    for at in range(0, len(STREAM), size):
        chunk, n = reader.feed(STREAM[at:at + size])
        out, tokens = out + chunk, tokens + n
    assert out + reader.pending == STREAM
    assert tokens == reader.token_events == 5
    assert reader.finished
    assert (reader.usage.prompt_tokens, reader.usage.completion_tokens,
            reader.usage.stored_id) == (7, 5, "resp_1")


def test_an_unfinished_stream_is_not_finished_and_a_store_false_answer_has_no_id() -> None:
    reader = ResponsesStream()
    reader.feed(STREAM[:STREAM.index(b"event: response.completed")])
    assert not reader.finished and reader.usage.stored_id == "resp_1"
    body = orjson.dumps({"id": "resp_2", "store": False, "usage": {"input_tokens": 1,
                                                                   "output_tokens": 2}})
    _, usage, _ = ResponsesPassThrough(None).response(body, {})  # type: ignore[arg-type]
    assert usage.stored_id is None and usage.completion_tokens == 2
    _, usage, _ = ResponsesPassThrough(None).response(b"not json", {})  # type: ignore[arg-type]
    assert usage.stored_id is None
