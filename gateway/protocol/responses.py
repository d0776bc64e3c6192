"""OpenAI's Responses API (``POST /v1/responses``) into a GenerationRequest.

vLLM keeps stored responses in its own process: a request that continues one
(``previous_response_id``) must reach the replica that stored it (``pinned`` at admission,
gateway/fleet/response_homes.py). The window check sees only this turn's input (the
earlier turns live on the engine): a lower bound of the real prompt, so what it refuses the
engine would refuse too.
"""

from __future__ import annotations

from typing import Any

from gateway.protocol.errors import Api, GatewayError, InvalidRequest
from gateway.protocol.reasons import Reason
from gateway.protocol.request import GenerationRequest, field, parse_json_object
from gateway.tokens import flatten_content

PATH = "/v1/responses"


class ResponseNotFound(GatewayError):
    """The stored response is unknown here, or the replica that stored it is gone."""

    status = 404
    openai_type = "invalid_request_error"
    tgi_type = "validation"
    code = "response_not_found"
    reason = Reason.BAD_REQUEST

    def __init__(self, response_id: str, param: str = "previous_response_id") -> None:
        super().__init__(f"Response with id '{response_id}' not found.", param=param)


def _input_text(value: Any) -> str:
    """The text of ``input``: a string, or items (messages with text or parts)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequest("`input` must be a string or an array of input items",
                             param="input")
    texts = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise InvalidRequest(f"`input[{i}]` must be an object", param="input")
        content = item.get("content", item.get("output", ""))
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        texts.append(str(flatten_content(content) or ""))
    return "\n".join(texts)


def parse_responses(raw: bytes) -> GenerationRequest:
    body = parse_json_object(raw, Api.OPENAI)
    if "input" not in body:
        raise InvalidRequest("`input` is required", param="input")
    text = _input_text(body["input"])
    instructions = field(body, "instructions", str)
    previous = field(body, "previous_response_id", str)
    if previous is not None and not 0 < len(previous) <= 256:
        raise InvalidRequest("`previous_response_id` must be 1 to 256 characters",
                             param="previous_response_id")
    field(body, "store", bool)
    return GenerationRequest(
        api=Api.OPENAI, path=PATH, body=body, raw=raw, model=field(body, "model", str),
        stream=bool(field(body, "stream", bool)),
        max_tokens=field(body, "max_output_tokens", int, minimum=1),
        prompt=f"{instructions}\n{text}" if instructions else text,
        previous_response_id=previous)
