"""Client request bodies -> ``Job``: exact prompt tokens, output length, finish reason, seed.

Prompt tokens are counted with the gateway's own tokenizer code (``gateway.tokens``): chat is
rendered with the model's template and encoded without special tokens (vLLM's default),
completion and TGI prompts are encoded with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field as field_
from typing import Any

import orjson

from gateway.sim import textgen
from gateway.sim.dialects import TGI, ClientError, Dialect
from gateway.tokens import ChatTemplateError, ModelTokenizer


@dataclass
class Choice:
    """One generated sequence: its tokens (pieces; ``textgen.EOS`` for a natural end), why it
    ended (``length``, ``eos`` or ``stop``) and the stop string that matched."""

    pieces: list[int]
    finish: str
    stop: str | None = None
    # The context's state before each token (textgen.generate): what its logprobs are drawn
    # from, so a continuation's logprobs are the first generation's.
    states: list[int] = field_(default_factory=list)

    def context(self, position: int) -> int:
        return self.states[min(position, len(self.states) - 1)] if self.states else position


@dataclass
class Extras:
    """What a request asked to see beyond the text (per engine, as the engine names it)."""

    logprobs: int | None = None          # OpenAI: top-k logprobs (0: the sampled token's only)
    chat_logprobs: bool = False          # chat's logprobs/top_logprobs format
    token_ids: bool = False              # vLLM/SGLang return_token_ids
    tokens_as_ids: bool = False          # vLLM return_tokens_as_token_ids
    prompt_logprobs: int | None = None   # vLLM prompt_logprobs
    echo: bool = False                   # OpenAI completions: the prompt before the text
    include_stop: bool = False           # vLLM include_stop_str_in_output, SGLang no_stop_trim
    top_n_tokens: int = 0                # TGI
    decoder_input_details: bool = False  # TGI
    return_full_text: bool = False       # TGI
    prompt_text: str = ""                # the prompt as text (echo, return_full_text)
    timings_per_token: bool = False      # llama.cpp: timings (predicted_n) on every chunk
    stream_interval: int = 1             # vLLM: tokens per streamed chunk after the first


@dataclass
class Job:
    """One generation, decided before it enters the engine."""

    chat: bool
    prompt_ids: list[int]
    prompt_tokens: int
    max_new: int          # tokens the engine generates (all choices together)
    finish_reason: str    # the first choice's, in the dialect's words (metrics)
    seed: int             # the seed the tokens were drawn with
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    details: bool = False
    reported_seed: int | None = None  # TGI details.seed
    choices: list[Choice] = field_(default_factory=list)
    extras: Extras = field_(default_factory=Extras)
    lora_name: str | None = None   # vLLM: the LoRA adapter named as the model
    cache_salt: str | None = None  # vLLM: keys the prompt's first KV block
    external_tokens: int = 0  # disaggregated decode: prompt tokens whose KV is loaded (kv_connector)
    transfer_s: float = 0.0  # ... and how long loading it takes (simulated seconds)


@dataclass
class Limits:
    model: str
    max_model_len: int
    mean_output_tokens: int
    max_input_tokens: int  # TGI
    eos_before_max: bool = False  # max_tokens is a cap on a natural length, as with real models
    text_seed: int = 0  # mixed into the text drawn (not its length): another "model version"
    names: Any = None  # more names served (gateway.sim.lora.SimNames): aliases, adapters
    # Each piece's token id in the replica's tokenizer, as generation folds it into the
    # context (``textgen.generate``); default: a piece's index.
    piece_bytes: tuple[bytes, ...] = textgen.DEFAULT_ID_BYTES

    def generate(self, state: int, n: int, salt: int) -> tuple[list[int], list[int]]:
        return textgen.generate(state, n, salt, self.piece_bytes)

    def serves(self, name: str) -> bool:
        return name == self.model or (self.names is not None and self.names.serves(name))


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


def _choices(seed: int, salt: int, prompt_ids: list[int], explicit: int | None, cap: int,
             limits: Limits, stops: list[str], tgi: bool, n: int = 1) -> list[Choice]:
    """``n`` sequences: exactly ``explicit`` tokens ("length"), else a natural length within
    ``cap`` (drawn from ``seed``) ending in the EOS token; cut at the first stop string that
    matches (on TGI a sequence at its length limit ends on "length" first; elsewhere the stop
    string wins). The text is drawn from the prompt's tokens (``textgen.generate``), salted
    by ``salt`` (a client's sampling seed, or 0), the choice and the replica's text seed."""
    cap = max(1, cap)
    state = textgen.default_seed(prompt_ids)
    out = []
    for i in range(n):
        s = seed + i
        if explicit is not None and limits.eos_before_max:
            cap = min(cap, explicit)
            explicit = None
        text_salt = (salt + i) ^ limits.text_seed
        if explicit is not None:
            (pieces, states), finish = limits.generate(state, min(explicit, cap), text_salt), "length"
        else:
            natural = textgen.natural_length(s, limits.mean_output_tokens, cap)
            if natural == cap:
                (pieces, states), finish = limits.generate(state, natural, text_salt), "length"
            else:
                (pieces, states), finish = limits.generate(state, natural - 1, text_salt), "eos"
                pieces = pieces + [textgen.EOS]
        choice = Choice(pieces, finish, states=states)
        matched = textgen.stop_at(pieces, stops, suffix_rule=tgi)
        if matched is not None and not (tgi and finish == "length" and matched[0] == len(pieces) - 1):
            choice = Choice(pieces[:matched[0] + 1], "stop", matched[1], states)
        out.append(choice)
    return out


def _stops(value: Any, dialect: Dialect) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [v for v in value if v]
    raise ClientError(_schema_message(dialect, "stop", "a string or a list of strings", value), "schema", "stop")


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


def _logprob_options(body: dict[str, Any], chat: bool, stream: bool, dialect: Dialect) -> Extras:
    """logprobs, token ids and prompt logprobs, as each engine takes them."""
    extras = Extras()
    if chat:
        if field(body, "logprobs", bool, dialect, False):
            extras.logprobs = field(body, "top_logprobs", int, dialect, 0)
            extras.chat_logprobs = True
    else:
        extras.logprobs = field(body, "n_probs" if dialect.name == "llamacpp" and "n_probs" in body
                                else "logprobs", int, dialect)
    if extras.logprobs is not None and extras.logprobs < 0:
        raise ClientError(f"`logprobs` must be a positive value or -1. (parameter=logprobs, value="
                          f"{extras.logprobs})", "invalid", "logprobs")
    if extras.logprobs is not None and extras.logprobs > 20 and dialect.name == "vllm":
        raise ClientError(f"Requested sample logprobs of {extras.logprobs}, which is greater than "
                          f"max allowed: 20", "invalid", "logprobs")
    if dialect.name in ("vllm", "sglang"):
        extras.token_ids = bool(field(body, "return_token_ids", bool, dialect, False))
    if dialect.name == "vllm":
        extras.tokens_as_ids = bool(field(body, "return_tokens_as_token_ids", bool, dialect, False))
        extras.prompt_logprobs = None if chat else field(body, "prompt_logprobs", int, dialect)
        if extras.prompt_logprobs is not None and stream:
            raise ClientError("`prompt_logprobs` are not available when `stream=True`. (parameter="
                              "prompt_logprobs)", "invalid", "prompt_logprobs")
        extras.include_stop = bool(field(body, "include_stop_str_in_output", bool, dialect, False))
        extras.stream_interval = field(body, "stream_interval", int, dialect, 1)
        if extras.stream_interval < 1:
            raise ClientError(_schema_message(dialect, "stream_interval",
                                              "greater than or equal to 1",
                                              extras.stream_interval), "schema", "stream_interval")
    if dialect.name == "sglang":
        extras.include_stop = bool(field(body, "no_stop_trim", bool, dialect, False))
    if not chat and dialect.name in ("vllm", "sglang"):
        extras.echo = bool(field(body, "echo", bool, dialect, False))
    if dialect.name == "llamacpp":
        extras.timings_per_token = bool(field(body, "timings_per_token", bool, dialect, False))
    return extras


def _guided(body: dict[str, Any], dialect: Dialect) -> None:
    """Guided decoding parameters are checked as the engine checks them (the simulated text
    does not follow them)."""
    if dialect.name == "vllm":
        outputs = field(body, "structured_outputs", dict, dialect)
        if outputs is not None and sum(outputs.get(k) is not None for k in ("json", "regex", "choice")) > 1:
            raise ClientError("You can only use one kind of constraints for structured outputs ('json', "
                              "'regex' or 'choice'). (parameter=structured_outputs)", "invalid",
                              "structured_outputs")
    elif dialect.name == "sglang":
        given = [k for k in ("json_schema", "regex", "ebnf") if body.get(k) is not None]
        for key in given:
            field(body, key, str, dialect)
        if len(given) > 1:
            raise ClientError("Only one of regex, json_schema, or ebnf can be set.", "invalid", given[1])
    elif dialect.name == "llamacpp":
        field(body, "json_schema", dict, dialect)
        field(body, "grammar", str, dialect)
    for name in ("top_k", "min_p"):
        field(body, name, float, dialect)
    for name in ("repetition_penalty", "repeat_penalty", "typical_p", "frequency_penalty", "presence_penalty"):
        field(body, name, float, dialect)


def openai_job(body: dict[str, Any], chat: bool, tok: ModelTokenizer, dialect: Dialect, limits: Limits) -> Job:
    """A ``/v1/chat/completions`` or ``/v1/completions`` request, validated as ``dialect`` does."""
    model = field(body, "model", str, dialect)
    if dialect.checks_model_name and model is not None and not limits.serves(model):
        raise dialect.unknown_model(model)
    if dialect.name == "sglang" and body.get("lora_path") is not None:
        raise ClientError("LoRA is not enabled on this server (launch it with --enable-lora)", "invalid",
                          "lora_path")
    stream, include_usage, continuous = _stream_flags(body, dialect)
    n = field(body, "n", int, dialect, 1)
    if n != 1 and dialect.name == "llamacpp":
        raise ClientError("Only one completion choice is allowed", "invalid", "n")
    if n < 1 or (n != 1 and stream):
        raise ClientError("the simulator streams one choice per request (n=1)", "invalid", "n")
    max_tokens = field(body, "max_tokens", int, dialect)
    if chat:
        max_tokens = field(body, "max_completion_tokens", int, dialect) or max_tokens
    ids = chat_ids(body, tok, dialect) if chat else _completion_ids(body, tok, dialect)
    truncate = field(body, "truncate_prompt_tokens", int, dialect) if dialect.name == "vllm" else None
    if truncate is not None and 0 < truncate < len(ids):
        ids = ids[-truncate:]  # vLLM keeps the last tokens
    prompt = len(ids)
    extras = _logprob_options(body, chat, stream, dialect)
    if extras.echo:
        extras.prompt_text = body["prompt"] if isinstance(body.get("prompt"), str) else tok.decode(ids)
    _guided(body, dialect)
    stops = _stops(body.get("stop"), dialect)
    temperature = field(body, "temperature", float, dialect)
    greedy = temperature is not None and temperature <= 0
    seed = field(body, "seed", int, dialect)
    # Greedy decoding ignores the seed: the same prompt gives the same tokens.
    salt = 0 if greedy or seed is None else seed
    seed = textgen.default_seed(ids) if greedy or seed is None else seed
    limit = limits.max_model_len
    if isinstance(dialect, TGI):
        new = dialect.check_generate(prompt, max_tokens, limits.max_input_tokens, limit)
        choices = _choices(seed, salt, ids, max_tokens, new, limits, stops, tgi=True, n=n)
    else:
        if max_tokens is None and not chat:
            max_tokens = dialect.completions_default_max_tokens
        dialect.check_max_tokens(max_tokens)
        dialect.check_context(prompt, max_tokens, limit)
        if max_tokens is not None and max_tokens <= 0:  # llama.cpp n_predict <= 0: no limit
            max_tokens = None
        choices = _choices(seed, salt, ids, max_tokens, dialect.output_cap(prompt, limit), limits, stops,
                           tgi=False, n=n)
    reason = "length" if choices[0].finish == "length" else "stop"
    lora = model if limits.names is not None and model in limits.names.adapters else None
    return Job(chat, ids, prompt, sum(len(c.pieces) for c in choices), reason, seed, stream, include_usage,
               continuous, choices=choices, extras=extras, lora_name=lora,
               cache_salt=_cache_salt(body, dialect))


def _cache_salt(body: dict[str, Any], dialect: Dialect) -> str | None:
    """vLLM's ``cache_salt`` (``validate_cache_salt``); other engines ignore the field."""
    salt = body.get("cache_salt")
    if dialect.name != "vllm" or salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ClientError("Parameter 'cache_salt' must be a non-empty string if provided.",
                          "invalid", "cache_salt")
    if len(salt) > 128 or any(c in "@/\\\0" for c in salt):
        raise ClientError("Parameter 'cache_salt' must be at most 128 characters and must "
                          "not contain '@', '/', '\\\\', or NUL.", "invalid", "cache_salt")
    return salt


def tgi_job(body: dict[str, Any], tok: ModelTokenizer, dialect: TGI, limits: Limits,
            stream: bool | None = None, compat: bool = False) -> Job:
    """A ``/generate`` (``/generate_stream``, ``POST /``: ``compat``) request, validated as
    TGI's router does."""
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise ClientError("Failed to deserialize the JSON body into the target type: "
                          + ("missing field `inputs`" if inputs is None else "inputs: expected a string"), "schema")
    params = field(body, "parameters", dict, dialect, {})
    max_new = field(params, "max_new_tokens", int, dialect)
    if max_new is not None and max_new < 0:
        raise ClientError("Failed to deserialize the JSON body into the target type: "
                          "parameters.max_new_tokens: expected u32", "schema")
    if stream is None:
        stream = field(body, "stream", bool, dialect, False)
    p = tgi_parameters(body, stream, compat, dialect)
    if max_new is not None and max_new == 0:
        raise ClientError("Input validation error: `max_new_tokens` must be strictly positive")
    if len(p.stop) > dialect.max_stop_sequences:
        raise ClientError(f"Input validation error: `stop` supports up to {dialect.max_stop_sequences} stop "
                          f"sequences. Given: {len(p.stop)}")
    if p.best_of > dialect.max_best_of:
        raise ClientError(f"Input validation error: `best_of` must be > 0 and <= {dialect.max_best_of}. "
                          f"Given: {p.best_of}")
    ids = tok.encode(inputs, add_special_tokens=True)
    if p.truncate is not None and p.truncate < len(ids):
        ids = ids[-p.truncate:]  # TGI keeps the last tokens
    prompt = len(ids)
    new = dialect.check_generate(prompt, max_new, limits.max_input_tokens, limits.max_model_len)
    given_seed = p.seed
    # Greedy decoding (TGI's Greedy(): no sampling, no warper) ignores the seed and reports none.
    sampled = given_seed is not None and p.sampling
    seed = given_seed if sampled else textgen.default_seed(ids)
    choices = _choices(seed, given_seed if sampled else 0, ids, max_new, new, limits, p.stop,
                       tgi=True, n=p.best_of)
    extras = Extras(top_n_tokens=p.top_n_tokens, decoder_input_details=p.decoder_input_details,
                    return_full_text=p.return_full_text, prompt_text=inputs)
    reason = {"length": "length", "eos": "eos_token", "stop": "stop_sequence"}[choices[0].finish]
    return Job(False, ids, prompt, sum(len(c.pieces) for c in choices), reason, seed, stream,
               details=p.details or p.decoder_input_details, reported_seed=seed if p.sampling else None,
               choices=choices, extras=extras)


def tgi_parameters(body: dict[str, Any], stream: bool, compat: bool, dialect: TGI) -> Any:
    """TGI's parameter checks and messages (shared with the gateway's translation, which
    copies TGI's router for requests it sends to other engines)."""
    from gateway.protocol.errors import InvalidRequest
    from gateway.protocol.translate.tgi_request import parse_parameters

    try:
        return parse_parameters(body, stream, compat)
    except InvalidRequest as exc:
        raise ClientError(exc.message) from None
