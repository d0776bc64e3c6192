"""TGI ``/generate`` parameters: validated as TGI's router does, and mapped to an OpenAI
engine's ``/v1/completions`` body (the TGI -> OpenAI request table).

``TGI_TO_OPENAI`` is the table: for every TGI parameter, the ``/v1/completions`` field it
becomes on each OpenAI-dialect engine (``Engine.tgi_parameters``, its column), or ``None``
where that engine has no equivalent (the request is then refused with a 422 naming the
parameter, never sent without it). docs/translation.md's table is this one.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field as dataclass_field
from typing import Any, Callable

import orjson

from gateway import engines
from gateway.engines import Engine
from gateway.protocol.errors import Api, InvalidRequest
from gateway.protocol.reasons import Reason
from gateway.protocol.request import field

# The engines a TGI client reaches through /v1/completions, in the table's column order.
OPENAI_ENGINES = tuple(name for name, engine in engines.ENGINES.items() if engine.api is Api.OPENAI)
_PARAMETERS = ("inputs", "max_new_tokens", "do_sample", "temperature", "top_p", "top_k",
               "typical_p", "repetition_penalty", "frequency_penalty", "seed", "stop", "truncate",
               "return_full_text", "best_of", "details", "decoder_input_details", "top_n_tokens",
               "grammar", "adapter_id", "watermark")
# TGI parameter -> engine -> the /v1/completions field(s) (each engine's column is its own).
TGI_TO_OPENAI: dict[str, dict[str, str | None]] = {
    name: {engine: engines.get(engine).tgi_parameters.get(name) for engine in OPENAI_ENGINES}
    for name in _PARAMETERS}

# Without max_new_tokens: TGI >= 3.0 generates up to the window (needs the prompt count),
# TGI < 3.0 generated 100 tokens.
PRE_3_DEFAULT_MAX_NEW_TOKENS = 100


@dataclass(slots=True)
class TgiParameters:
    """A TGI request's parameters, validated with TGI's rules and wording."""

    inputs: str
    max_new_tokens: int | None = None
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = dataclass_field(default_factory=list)
    truncate: int | None = None
    return_full_text: bool = False
    best_of: int = 1
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int = 0
    grammar: tuple[str, Any] | None = None  # ("json", schema) or ("regex", pattern)
    adapter_id: str | None = None
    watermark: bool = False

    @property
    def sampling(self) -> bool:
        """TGI samples when asked to or when any logits warper applies (its server's rule);
        otherwise it decodes greedily, and reports no seed."""
        return (self.do_sample or (self.temperature is not None and self.temperature != 1.0)
                or bool(self.top_k) or (self.top_p is not None and self.top_p < 1.0)
                or (self.typical_p is not None and self.typical_p < 1.0))

    def given(self) -> list[str]:
        """The parameters that ask for something (defaults ask for nothing)."""
        out = []
        for name in ("top_k", "typical_p", "repetition_penalty", "frequency_penalty",
                     "truncate", "adapter_id", "grammar"):
            if getattr(self, name) is not None:
                out.append(name)
        if self.stop:
            out.append("stop")
        if self.best_of > 1:
            out.append("best_of")
        for name in ("details", "decoder_input_details", "watermark"):
            if getattr(self, name):
                out.append(name)
        if self.top_n_tokens:
            out.append("top_n_tokens")
        return out


def _invalid(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(f"Input validation error: {message}", param=f"parameters.{param}")


def _number(parameters: dict[str, Any], name: str) -> float | None:
    value = field(parameters, name, float, where="parameters.")
    return None if value is None else float(value)


def _grammar(value: Any) -> tuple[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("json", "regex", "json_schema"):
        raise _invalid("`grammar` must be an object with `type` `json`, `json_schema` or "
                       "`regex` and a `value`", "grammar")
    kind, content = value["type"], value.get("value")
    if kind == "regex":
        if not isinstance(content, str) or not content:
            raise _invalid("grammar is not valid: `value` must be a non-empty regex", "grammar")
        return "regex", content
    if kind == "json_schema":
        content = content.get("schema") if isinstance(content, dict) else None
    if isinstance(content, str):
        try:
            content = orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise _invalid(f"grammar is not valid: {exc}", "grammar") from None
    if not isinstance(content, dict):
        raise _invalid("grammar is not valid: a JSON grammar needs a JSON schema object", "grammar")
    if "properties" not in content:
        raise _invalid("grammar is not valid: Grammar must have a 'properties' field", "grammar")
    return "json", content


def parse_parameters(body: dict[str, Any], stream: bool, compat: bool) -> TgiParameters:
    """``body["parameters"]`` checked in TGI's order with TGI's messages (router/validation.rs).

    ``compat`` (``POST /``): ``return_full_text`` defaults to true, as on TGI serving a
    ``text-generation`` model.
    """
    inputs = body["inputs"]
    p = field(body, "parameters", dict) or {}
    where = "parameters."
    out = TgiParameters(
        inputs=inputs,
        max_new_tokens=field(p, "max_new_tokens", int, where=where),
        do_sample=bool(field(p, "do_sample", bool, where=where)),
        temperature=_number(p, "temperature"), top_p=_number(p, "top_p"),
        top_k=field(p, "top_k", int, where=where), typical_p=_number(p, "typical_p"),
        repetition_penalty=_number(p, "repetition_penalty"),
        frequency_penalty=_number(p, "frequency_penalty"),
        seed=field(p, "seed", int, where=where), truncate=field(p, "truncate", int, where=where),
        return_full_text=bool(field(p, "return_full_text", bool, where=where) or
                              (compat and p.get("return_full_text") is None)),
        best_of=field(p, "best_of", int, where=where) or 1,
        details=bool(field(p, "details", bool, where=where)),
        decoder_input_details=bool(field(p, "decoder_input_details", bool, where=where)),
        top_n_tokens=field(p, "top_n_tokens", int, where=where) or 0,
        grammar=_grammar(p.get("grammar")),
        adapter_id=field(p, "adapter_id", str, where=where),
        watermark=bool(field(p, "watermark", bool, where=where)),
    )
    stop = field(p, "stop", list, where=where) or []
    if not all(isinstance(s, str) for s in stop):
        raise _invalid("`stop` must be an array of strings", "stop")
    out.stop = [s for s in stop if s]
    _validate(out, stream)
    return out


def _validate(p: TgiParameters, stream: bool) -> None:
    """TGI's checks and messages, in TGI's order."""
    if p.best_of < 1:
        raise _invalid(f"`best_of` must be > 0. Given: {p.best_of}", "best_of")
    given_sampling = (p.do_sample or p.temperature is not None or p.top_k is not None
                      or p.top_p is not None or p.typical_p is not None)
    if p.best_of > 1 and not given_sampling:
        raise _invalid("you must use sampling when `best_of` is > 1", "best_of")
    if p.temperature is not None and p.temperature <= 0.0:
        raise _invalid("`temperature` must be strictly positive", "temperature")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0.0:
        raise _invalid("`repetition_penalty` must be strictly positive", "repetition_penalty")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        raise _invalid("`frequency_penalty` must be >= -2.0 and <= 2.0", "frequency_penalty")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise _invalid("`top_p` must be > 0.0 and < 1.0", "top_p")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise _invalid("`typical_p` must be > 0.0 and < 1.0", "typical_p")
    if p.top_k is not None and p.top_k <= 0:
        raise _invalid("`top_k` must be strictly positive", "top_k")
    if p.max_new_tokens is not None and p.max_new_tokens <= 0:
        raise _invalid("`max_new_tokens` must be strictly positive", "max_new_tokens")
    if p.seed is not None and p.best_of > 1:
        raise _invalid("`seed` must not be set when `best_of` > 1", "seed")
    if p.seed is not None and p.seed < 0:
        raise _invalid("`seed` must be a non-negative integer", "seed")
    if p.top_n_tokens < 0:
        raise _invalid(f"`top_n_tokens` must be >= 0. Given: {p.top_n_tokens}", "top_n_tokens")
    if p.truncate is not None and p.truncate <= 0:
        raise _invalid(f"`truncate` must be strictly positive. Given: {p.truncate}", "truncate")
    if stream and p.best_of > 1:
        raise _invalid("`best_of` != 1 is not supported when streaming tokens", "best_of")
    if stream and p.decoder_input_details:
        raise _invalid("`decoder_input_details` == true is not supported when streaming tokens",
                       "decoder_input_details")


class CannotHonour(InvalidRequest):
    """A TGI parameter the chosen engine has no equivalent for: refused, never dropped."""

    reason = Reason.UNSUPPORTED_PARAMETER


def refusal(p: TgiParameters, engine: Engine, stream: bool,
            has_tokenizer: bool) -> CannotHonour | None:
    """Why ``engine`` cannot serve these parameters exactly (None: it can)."""
    if stream and engine.tgi_stream_fields is None:
        return CannotHonour(f"Input validation error: streaming from {engine.name} replicas is "
                            f"not possible: TGI token events carry token ids, which the engine "
                            f"does not report", param="stream")
    for name in p.given():
        if engine.tgi_parameters.get(name) is not None:
            continue
        return CannotHonour(f"Input validation error: `{name}` cannot be honoured by the "
                            f"{engine.name} replicas serving this model (no equivalent in its "
                            f"/v1/completions)", param=f"parameters.{name}")
    if p.grammar is not None and p.grammar[0] == "regex" and not engine.accepts_regex_grammar:
        return CannotHonour(f"Input validation error: `grammar` of type `regex` cannot be "
                            f"honoured by {engine.name} replicas (it takes JSON schemas and GBNF "
                            f"grammars, not regexes)", param="parameters.grammar")
    if p.top_n_tokens and engine.top_tokens_as_ids and not has_tokenizer:
        return CannotHonour(f"Input validation error: `top_n_tokens` on {engine.name} replicas "
                            f"needs the model's tokenizer in the gateway config ({engine.title} "
                            f"reports the top tokens' ids without their text)",
                            param="parameters.top_n_tokens")
    if p.truncate is not None and not engine.truncates_prompt and not has_tokenizer:
        return CannotHonour(f"Input validation error: `truncate` on {engine.name} replicas needs "
                            f"the model's tokenizer in the gateway config (the gateway truncates "
                            f"the prompt itself)", param="parameters.truncate")
    return None


def wants_logprobs(p: TgiParameters, stream: bool) -> bool:
    """Token ids and logprobs are needed for every stream event, for ``details`` and to pick
    the best of ``best_of`` sequences."""
    return stream or p.details or p.decoder_input_details or p.best_of > 1 or p.top_n_tokens > 0


def draw_seed() -> int:
    """TGI draws a random u64 seed for a sampled request that sets none (and reports it)."""
    return random.getrandbits(63)


def openai_body(p: TgiParameters, engine: Engine, model: str, stream: bool,
                max_tokens: int, prompt_ids: list[int] | None,
                seed_source: Callable[[], int] = draw_seed) -> tuple[dict[str, Any], int | None]:
    """The ``/v1/completions`` body for ``engine``, and the seed to report (TGI reports the
    seed of a sampled request, its own or a drawn one; none for greedy decoding)."""
    names = engine.tgi_parameters
    stream = stream or engine.tgi_always_streams
    body: dict[str, Any] = {"model": model, "prompt": prompt_ids if prompt_ids is not None
                            else p.inputs, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(engine.tgi_extra_fields)
    seed = None
    if p.sampling:
        body["temperature"] = 1.0 if p.temperature is None else p.temperature
        if p.top_p is not None:
            body["top_p"] = p.top_p
        if p.top_k is not None:
            body[names["top_k"]] = p.top_k  # type: ignore[index]
        if p.typical_p is not None:
            body[names["typical_p"]] = p.typical_p  # type: ignore[index]
        if p.best_of == 1:
            seed = p.seed if p.seed is not None else seed_source()
            body["seed"] = seed
    else:
        body["temperature"] = 0.0  # greedy: the same tokens TGI's Greedy() picks
        if p.seed is not None:
            body["seed"] = p.seed
    if p.repetition_penalty is not None:
        body[names["repetition_penalty"]] = p.repetition_penalty  # type: ignore[index]
    if p.frequency_penalty is not None:
        body["frequency_penalty"] = p.frequency_penalty
    if p.stop:
        body["stop"] = p.stop
        body.update(engine.tgi_stop_fields)  # TGI's text ends with the stop sequence
    if p.truncate is not None and prompt_ids is None:
        body["truncate_prompt_tokens"] = p.truncate  # vLLM keeps the last N, as TGI does
    if p.best_of > 1:
        body["n"] = p.best_of
    if wants_logprobs(p, stream):
        body["logprobs"] = p.top_n_tokens or engine.tgi_min_logprobs
        if engine.asks_token_ids:
            body["return_token_ids"] = True
        if engine.top_tokens_as_ids and p.top_n_tokens:
            body["return_tokens_as_token_ids"] = True  # the top tokens' ids
    if p.decoder_input_details:
        body["prompt_logprobs"] = 0
    if p.grammar is not None:
        body.update(engine.grammar_fields(*p.grammar))
    if p.adapter_id is not None:
        body[engine.adapter_field] = p.adapter_id
    return body, seed


def max_tokens_for(p: TgiParameters, window: int | None, prompt_tokens: int | None) -> int:
    """``max_new_tokens``, or TGI >= 3.0's default (the rest of the window) when the prompt
    count is known, else TGI < 3.0's default."""
    if p.max_new_tokens is not None:
        return p.max_new_tokens
    if window is not None and prompt_tokens is not None:
        return max(window - prompt_tokens, 1)
    return PRE_3_DEFAULT_MAX_NEW_TOKENS


def mean_logprob(logprobs: list[float | None]) -> float:
    """TGI picks the best of ``best_of`` sequences by mean token logprob."""
    values = [lp for lp in logprobs if lp is not None]
    return sum(values) / len(values) if values else -math.inf
