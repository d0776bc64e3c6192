"""vLLM's Responses API on a simulated replica: ``POST /v1/responses`` (whole or streamed),
stored in this process unless ``store`` is false, continued with ``previous_response_id``
(an id this replica did not store is vLLM's 404), read back with ``GET
/v1/responses/{id}``. Answers are drawn from the whole conversation, so a turn answered
by the wrong replica (without the earlier turns) says something else.
"""

from __future__ import annotations

import os
import time
import zlib
from typing import Any

import orjson

from gateway.sim.dialects import ClientError
from gateway.tokens import ModelTokenizer

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa")


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    parts = []
    for item in value if isinstance(value, list) else ():
        content = item.get("content", "") if isinstance(item, dict) else ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(str(content))
    return "\n".join(parts)


class SimResponses:
    def __init__(self, model: str, tokenizer: ModelTokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.stored: dict[str, dict[str, Any]] = {}
        self.history: dict[str, str] = {}  # response id -> the conversation up to its answer

    def not_found(self, response_id: str) -> ClientError:
        return ClientError(f"Response with id '{response_id}' not found.", "not_found",
                           "response_id", status=404)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        if "input" not in body:
            raise ClientError("1 validation error:\n  {'loc': ('body', 'input'), 'msg': "
                              "'Field required'}", "schema", "input")
        previous = body.get("previous_response_id")
        before = ""
        if previous is not None:
            if previous not in self.history:
                raise self.not_found(previous)
            before = self.history[previous]
        conversation = before + "\n" + _text(body["input"])
        limit = body.get("max_output_tokens") if isinstance(body.get("max_output_tokens"), int) else 8
        seed = zlib.crc32(conversation.encode())
        words = [WORDS[(seed >> i) % len(WORDS)] for i in range(max(1, min(limit, 16)))]
        text = " ".join(words)
        response_id = f"resp_{os.urandom(16).hex()}"
        input_tokens = len(self.tokenizer.encode(conversation, add_special_tokens=True))
        response = {
            "id": response_id, "created_at": int(time.time()), "incomplete_details": None,
            "instructions": body.get("instructions"), "metadata": None,
            "model": body.get("model") or self.model, "object": "response",
            "output": [{"id": f"msg_{os.urandom(8).hex()}", "type": "message",
                        "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": [],
                                     "logprobs": None}]}],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "background": False, "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": previous, "status": "completed",
            "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": len(words),
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": input_tokens + len(words)}}
        if body.get("store", True) is not False:
            self.stored[response_id] = response
            self.history[response_id] = conversation + "\n" + text
        return response

    def get(self, response_id: str) -> dict[str, Any]:
        if response_id not in self.stored:
            raise self.not_found(response_id)
        return self.stored[response_id]

    @staticmethod
    def events(response: dict[str, Any]) -> bytes:
        """The stream vLLM writes for ``response``: created, in progress, one delta per
        word, done, completed (``event:`` and ``data:`` lines, no ``[DONE]``)."""
        text = response["output"][0]["content"][0]["text"]
        started = {**response, "status": "in_progress", "output": [], "usage": None}
        out, n = [], 0

        def event(kind: str, **fields: Any) -> None:
            nonlocal n
            out.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(
                {**fields, "sequence_number": n, "type": kind}) + b"\n\n")
            n += 1

        event("response.created", response=started)
        event("response.in_progress", response=started)
        item = response["output"][0]["id"]
        pieces = text.split(" ")
        for i, piece in enumerate(pieces):
            event("response.output_text.delta", content_index=0, delta=piece if i == 0 else " " + piece,
                  item_id=item, logprobs=[], output_index=0)
        event("response.output_text.done", content_index=0, item_id=item, logprobs=[],
              output_index=0, text=text)
        event("response.completed", response=response)
        return b"".join(out)
