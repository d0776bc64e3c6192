"""TGI-style requests (/generate, /generate_stream, POST /) into GenerationRequest."""

from __future__ import annotations

from gateway.protocol.errors import Api, InvalidRequest
from gateway.protocol.request import GenerationRequest, field, parse_json_object


def parse_generate(raw: bytes, stream: bool | None) -> GenerationRequest:
    """``stream`` is fixed by the route, or None for the compat route ``POST /``, where the
    body decides (and which is forwarded as is: it answers a list when not streaming)."""
    body = parse_json_object(raw, Api.TGI)
    inputs = field(body, "inputs", str, required=True)
    if not inputs:
        raise InvalidRequest("Input validation error: `inputs` cannot be empty", param="inputs")
    parameters = field(body, "parameters", dict) or {}
    max_new_tokens = field(parameters, "max_new_tokens", int, where="parameters.")
    if max_new_tokens is not None and max_new_tokens <= 0:
        raise InvalidRequest("Input validation error: `max_new_tokens` must be strictly positive",
                             param="parameters.max_new_tokens")
    field(parameters, "details", bool, where="parameters.")
    if stream is None:
        stream, path = bool(field(body, "stream", bool)), "/"
    else:
        path = "/generate_stream" if stream else "/generate"
    best_of = field(parameters, "best_of", int, where="parameters.")
    # A LoRA adapter: on vLLM it is a model name of its own (routed to where it is served).
    adapter_id = field(parameters, "adapter_id", str, where="parameters.") or None
    return GenerationRequest(api=Api.TGI, path=path,
                             body=body, raw=raw, model=adapter_id, stream=stream,
                             max_tokens=max_new_tokens, prompt=inputs,
                             choices=best_of if best_of and best_of > 1 else 1)  # all generated
