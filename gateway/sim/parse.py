"""Client request bodies -> ``Job``: exact prompt tokens, output length, finish reason, seed.

Prompt tokens are counted with the gateway's own tokenizer code (``gateway.tokens``): chat is
rendered with the model's template and encoded without special tokens (vLLM's default),
completion and TGI prompts are encoded with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.sim import textgen
from gateway.sim.dialects import TGI, ClientError, Dialect
from gateway.tokens import ChatTemplateError, ModelTokenizer


@dataclass
class Job:
    """One generation, decided before it enters the engine."""

    chat: bool
    prompt_ids: list[int]
    prompt_tokens: int
    max_new: int
    finish_reason: str
    seed: int
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    details: bool = False
    reported_seed: int | None = None  # TGI details.seed


@dataclass
class Limits:
    model: str
    max_model_len: int
    mean_output_tokens: int
    max_input_tokens: int  # TGI


def load_json(body: bytes, dialect: Dialect) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ClientError(_schema_message(dialect, "body", "valid JSON", str(exc)), "schema") from None
    if not isinstance(data, dict):
        raise ClientError(_schema_message(dialect, "body", "a JSON object", data), "schema")
    return data


def _schema_message(dialect: Dialect, name: str, what: str, value: Any) -> str:
    if isinstance(dialect, TGI):  # axum's Json extractor
        return f"Failed to deserialize the JSON body into the target type: {name}: expected {what}"
    return f"1 validation error:\n  {{'loc': ('body', '{name}'), 'msg': 'Input should be {what}', 'input': {value!r}}}"


_KINDS = {int: "a valid integer", bool: "a valid boolean", str: "a valid string", list: "a valid list",
          dict: "a valid dictionary", float: "a valid number"}


def field(body: dict[str, Any], name: str, kind: type, dialect: Dialect, default: Any = None) -> Any:
    """``body[name]`` if it has the right JSON type (``None`` -> ``default``), else a 4xx naming it."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ClientError(_schema_message(dialect, name, _KINDS[kind], value), "schema", name)
    return value


def _output(seed: int, explicit: int | None, cap: int, limits: Limits, natural_reason: str) -> tuple[int, str]:
    """Exactly ``explicit`` tokens ("length"), else a seeded natural length within ``cap``."""
    cap = max(1, cap)
    if explicit is not None:
        n = min(explicit, cap)
        return n, "length"
    n = textgen.natural_length(seed, limits.mean_output_tokens, cap)
    return n, "length" if n == cap else natural_reason


def _stream_flags(body: dict[str, Any], dialect: Dialect) -> tuple[bool, bool, bool]:
    stream = field(body, "stream", bool, dialect, False)
    options = field(body, "stream_options", dict, dialect)
    if options is not None and not stream and dialect.name == "vllm" and not dialect.flat_errors:
        raise ClientError("Stream options can only be defined when `stream=True`.", "invalid", "stream_options")
    options = options or {}
    include = field(options, "include_usage", bool, dialect, False)
    continuous = field(options, "continuous_usage_stats", bool, dialect, False)
    return stream, include, continuous and include


def chat_ids(body: dict[str, Any], tok: ModelTokenizer, dialect: Dialect) -> list[int]:
    messages = field(body, "messages", list, dialect)
    if not messages:
        raise ClientError(_schema_message(dialect, "messages", "a non-empty list of messages", messages),
                          "schema", "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ClientError(_schema_message(dialect, "messages", "a list of {role, content} objects", m),
                              "schema", "messages")
        if not isinstance(m.get("content"), (str, list, type(None))):
            raise ClientError(_schema_message(dialect, "messages.content", "a string or a list of parts",
                                              m.get("content")), "schema", "messages")
    try:
        rendered = tok.render_chat(
            messages,
            add_generation_prompt=field(body, "add_generation_prompt", bool, dialect, True),
            continue_final_message=field(body, "continue_final_message", bool, dialect, False),
            tools=field(body, "tools", list, dialect),
            chat_template_kwargs=field(body, "chat_template_kwargs", dict, dialect),
        )
    except ChatTemplateError as exc:
        raise ClientError(str(exc), "invalid", "messages") from None
    return tok.encode(rendered, add_special_tokens=field(body, "add_special_tokens", bool, dialect, False))


def _completion_ids(body: dict[str, Any], tok: ModelTokenizer, dialect: Dialect) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tok.encode(prompt, add_special_tokens=field(body, "add_special_tokens", bool, dialect, True))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ClientError("the simulator serves one prompt per request; send a batch as separate requests",
                          "invalid", "prompt")
    raise ClientError(_schema_message(dialect, "prompt", "a string or a list of token ids", prompt),
                      "schema", "prompt")


def openai_job(body: dict[str, Any], chat: bool, tok: ModelTokenizer, dialect: Dialect, limits: Limits) -> Job:
    """A ``/v1/chat/completions`` or ``/v1/completions`` request, validated as ``dialect`` does."""
    model = field(body, "model", str, dialect)
    if dialect.checks_model_name and model is not None and model != limits.model:
        raise dialect.unknown_model(model)
    stream, include_usage, continuous = _stream_flags(body, dialect)
    n = field(body, "n", int, dialect, 1)
    if n != 1:
        raise ClientError("the simulator generates one choice per request (n=1)", "invalid", "n")
    max_tokens = field(body, "max_tokens", int, dialect)
    if chat:
        max_tokens = field(body, "max_completion_tokens", int, dialect) or max_tokens
    ids = chat_ids(body, tok, dialect) if chat else _completion_ids(body, tok, dialect)
    prompt = len(ids)
    seed = field(body, "seed", int, dialect)
    seed = seed if seed is not None else textgen.default_seed(ids)
    limit = limits.max_model_len
    if isinstance(dialect, TGI):
        new = dialect.check_generate(prompt, max_tokens, limits.max_input_tokens, limit)
        max_new, reason = _output(seed, max_tokens, new, limits, "stop")
    else:
        if max_tokens is None and not chat:
            max_tokens = dialect.completions_default_max_tokens
        dialect.check_max_tokens(max_tokens)
        dialect.check_context(prompt, max_tokens, limit)
        if max_tokens is not None and max_tokens <= 0:  # llama.cpp n_predict <= 0: no limit
            max_tokens = None
        max_new, reason = _output(seed, max_tokens, dialect.output_cap(prompt, limit), limits, "stop")
    return Job(chat, ids, prompt, max_new, reason, seed, stream, include_usage, continuous)


def tgi_job(body: dict[str, Any], tok: ModelTokenizer, dialect: TGI, limits: Limits,
            stream: bool | None = None) -> Job:
    """A ``/generate`` (``/generate_stream``, ``POST /``) request, validated as TGI's router does."""
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise ClientError("Failed to deserialize the JSON body into the target type: "
                          + ("missing field `inputs`" if inputs is None else "inputs: expected a string"), "schema")
    params = field(body, "parameters", dict, dialect, {})
    max_new = field(params, "max_new_tokens", int, dialect)
    if max_new is not None and max_new < 0:
        raise ClientError("Failed to deserialize the JSON body into the target type: "
                          "parameters.max_new_tokens: expected u32", "schema")
    truncate = field(params, "truncate", int, dialect)
    details = field(params, "details", bool, dialect, False)
    given_seed = field(params, "seed", int, dialect)
    do_sample = field(params, "do_sample", bool, dialect, False)
    ids = tok.encode(inputs, add_special_tokens=True)
    if truncate is not None and truncate < len(ids):
        ids = ids[-truncate:]  # TGI keeps the last tokens
    prompt = len(ids)
    new = dialect.check_generate(prompt, max_new, limits.max_input_tokens, limits.max_model_len)
    seed = given_seed if given_seed is not None else textgen.default_seed(ids)
    n, reason = _output(seed, max_new, new, limits, "eos_token")
    if stream is None:
        stream = field(body, "stream", bool, dialect, False)
    return Job(False, ids, prompt, n, reason, seed, stream, details=details,
               reported_seed=given_seed if given_seed is not None else (seed if do_sample else None))
