"""How a request reaches the engine picked for it, and its answer the client: chosen per
request once its replica is picked (a pool may mix engines). Pure data code: bodies, events
and errors in, bodies, events and errors out; the relay does the I/O and holds no dialect.

Same-dialect traffic passes through (``passthrough``). Between the OpenAI and TGI dialects:

- TGI client (``/generate``, ``/generate_stream``, ``POST /``) on an OpenAI-dialect engine
  (vllm, sglang, llamacpp, openai, ...): through its ``/v1/completions``
  (``tgi_request.TGI_TO_OPENAI``, ``tgi_response``), as the engine's profile says
  (``gateway/engines/``).
- OpenAI ``/v1/completions`` on a TGI older than 1.4.4 (no ``/v1/completions``): through
  ``/generate(_stream)`` (``openai_to_tgi.OPENAI_TO_TGI``). OpenAI chat on TGI uses TGI's own
  Messages API (TGI >= 1.4.0), untranslated.
- Anthropic's Messages API (``/v1/messages``) on an engine without it (``Engine.serves_messages``
  false): through its ``/v1/chat/completions`` (``anthropic_chat``).

``refusal`` says, at admission, whether an engine can serve a request exactly (else which
parameter it cannot honour); ``plan`` builds the ``Translation`` for the replica picked.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, TypeVar

import orjson

from gateway import engines
from gateway.engines import Engine
from gateway.protocol.errors import Api, ApiNotServed, EngineError, GatewayError
from gateway.protocol import anthropic as anthropic_protocol
from gateway.protocol import responses as responses_api
from gateway.protocol.request import GenerationRequest
from gateway.protocol.translate import anthropic_chat, openai_to_tgi, tgi_request, tgi_response
from gateway.protocol.translate.passthrough import PassThrough, capped_body
from gateway.protocol.translate.responses import ResponsesPassThrough
from gateway.protocol.translate.sse import malformed
from gateway.protocol.translate.generated_tokens import TokenTexts
from gateway.protocol.usage import Usage
from gateway.tokens import ChatTemplateError, ModelTokenizer

# TGI versions that changed what the gateway can send (/info ``version``).
TGI_MESSAGES_API = (1, 4, 0)      # /v1/chat/completions
TGI_COMPLETIONS_API = (1, 4, 4)   # /v1/completions
TGI_STREAM_INPUT_LENGTH = (2, 3, 0)  # /generate_stream details.input_length


def parse_version(version: str | None) -> tuple[int, ...] | None:
    """``"1.4.3"`` -> (1, 4, 3); None when absent or not a version (then: the newest)."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version or "")
    if match is None:
        return None
    return tuple(int(part or 0) for part in match.groups())


def _at_least(version: str | None, minimum: tuple[int, ...]) -> bool:
    parsed = parse_version(version)
    return parsed is None or parsed >= minimum


class StreamReader(Protocol):
    """What the relay's stream loop reads: bytes for the client and tokens per upstream read."""

    usage: Usage
    token_events: int
    finished: bool

    def feed(self, chunk: bytes) -> tuple[bytes, int]: ...

    @property
    def pending(self) -> bytes: ...


class Translation(Protocol):
    """How one request reaches its replica and how the answer comes back: where to send what,
    a reader for the stream, the whole answer's body and usage, the engine's errors."""

    @property
    def path(self) -> str: ...

    @property
    def body(self) -> bytes: ...

    def reader(self) -> StreamReader: ...

    def response(self, content: bytes, headers: Mapping[str, str]
                 ) -> tuple[bytes, Usage, list[tuple[bytes, bytes]]]:
        """The client's body from the engine's (2xx), its usage, and headers that replace
        the engine's of the same name."""

    def engine_error(self, error: EngineError) -> EngineError:
        """An engine's error (4xx/5xx) in the client's terms."""


JSON_TYPE = (b"content-type", b"application/json")


@dataclass(slots=True)
class Translated:
    """A request served by a replica of the other dialect."""

    path: str
    body: bytes
    client: Api
    reader: Callable[[], StreamReader]
    answer: Callable[[bytes, Mapping[str, str]], tuple[bytes, Usage]]

    def response(self, content: bytes,
                 headers: Mapping[str, str]) -> tuple[bytes, Usage, list[tuple[bytes, bytes]]]:
        try:
            body, usage = self.answer(content, headers)
        except (ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
            raise malformed(exc) from None
        extra = [JSON_TYPE]  # a body the gateway wrote, whatever the engine's answer was
        if self.client is Api.TGI:  # TGI reports its counts in headers too
            if usage.prompt_tokens is not None:
                extra.append((b"x-prompt-tokens", b"%d" % usage.prompt_tokens))
            if usage.completion_tokens is not None:
                extra.append((b"x-generated-tokens", b"%d" % usage.completion_tokens))
        return body, usage, extra

    def engine_error(self, error: EngineError) -> EngineError:
        """TGI clients get TGI's statuses (422 for a request the engine refused, 424 for a
        failed generation); a context-window refusal stays the gateway's 400."""
        if self.client is Api.TGI and error.code != "context_length_exceeded":
            if 400 <= error.status < 500 and error.status != 429:
                error.tgi_status_override = 422
            elif error.status >= 500:
                error.tgi_status_override = 424
                error.tgi_type = "generation"
        return error


class TranslationPlan:
    """What translation parses of one request, parsed once for every replica it is checked
    against (``servable``) and every attempt (``plan``): a TGI request's parameters, on
    first need. Admission holds it (``Admission.plan``); the request itself is never written.
    """

    __slots__ = ("request", "_tgi_parameters")

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self._tgi_parameters: tgi_request.TgiParameters | None = None

    def tgi_parameters(self) -> tgi_request.TgiParameters:
        if self._tgi_parameters is None:
            self._tgi_parameters = _tgi_parameters(self.request)
        return self._tgi_parameters


def _tgi_parameters(request: GenerationRequest,
                    parsed: TranslationPlan | None = None) -> tgi_request.TgiParameters:
    if parsed is not None:
        return parsed.tgi_parameters()
    return tgi_request.parse_parameters(request.body, request.stream, compat=request.path == "/")


def refusal(request: GenerationRequest, engine: str, version: str | None,
            has_tokenizer: bool, parsed: TranslationPlan | None = None) -> GatewayError | None:
    """None when ``engine`` can serve ``request`` (natively or translated) exactly; else the
    error that says why not. Raises InvalidRequest for TGI parameters TGI itself refuses."""
    profile = engines.get(engine)
    if request.api is Api.ANTHROPIC:
        if profile.serves_messages:
            return None
        if request.pooling:  # count_tokens: the gateway counts it itself, given a tokenizer
            if has_tokenizer:
                return None
            return ApiNotServed(f"{request.path} is not served by {engine} replicas (configure "
                                f"the model's tokenizer and the gateway counts)", param=None)
        if profile.api is Api.TGI and not _at_least(version, TGI_MESSAGES_API):
            return ApiNotServed(f"TGI {version} has no /v1/chat/completions (TGI's Messages "
                                f"API came in 1.4.0)", param="messages")
        return anthropic_chat.refusal(request, profile)
    if request.pooling:
        routes = profile.tgi_routes if request.api is Api.TGI else profile.pooling_routes
        if request.path in routes:
            return None
        return ApiNotServed(f"{request.path} is not served by {engine} replicas", param=None)
    if request.path == responses_api.PATH:
        if profile.serves_responses:
            return None
        return ApiNotServed(f"{responses_api.PATH} is not served by {engine} replicas")
    if request.api is Api.TGI:
        if profile.api is Api.TGI:
            return None
        return tgi_request.refusal(_tgi_parameters(request, parsed), profile, request.stream,
                                   has_tokenizer)
    if profile.api is not Api.TGI:
        return None
    if request.is_chat:
        if _at_least(version, TGI_MESSAGES_API):
            return None
        return ApiNotServed(f"TGI {version} has no /v1/chat/completions (TGI's Messages API "
                            f"came in 1.4.0)", param="messages")
    if _at_least(version, TGI_COMPLETIONS_API):
        return None
    return openai_to_tgi.refusal(request.body)


class EngineReplica(Protocol):
    engine: str
    version: str | None


E = TypeVar("E", bound=EngineReplica)


def servable(request: GenerationRequest, replicas: list[E], has_tokenizer: bool,
             parsed: TranslationPlan | None = None) -> list[E]:
    """The replicas that can serve ``request`` exactly; raises why none can."""
    out, refused = [], None
    for replica in replicas:
        error = refusal(request, replica.engine, replica.version, has_tokenizer, parsed)
        if error is None:
            out.append(replica)
        elif refused is None:
            refused = error
    if refused is not None and not out:
        raise refused
    return out


def plan(request: GenerationRequest, engine: str, version: str | None, model: str,
         tokenizer: ModelTokenizer | None, window: int | None, output_cap: int | None = None,
         parsed: TranslationPlan | None = None, prompt_tokens: int | None = None) -> Translation:
    """How ``request`` reaches a replica of ``engine``: translated, or passed through.
    ``output_cap`` (admission's, ``output_past_window: cap``) is written into the body the
    engine gets, never into the request; ``prompt_tokens``: the prompt's exact count, when
    admission took one (a translation that must report it need not count again)."""
    if request.path == responses_api.PATH:
        return ResponsesPassThrough(request, output_cap)
    if request.api is Api.ANTHROPIC and not engines.get(engine).serves_messages:
        return _messages_on_chat(request, engines.get(engine), model, tokenizer, output_cap,
                                 prompt_tokens)
    if passes_through(request, engine, version):
        return PassThrough(request, output_cap)
    if request.api is Api.TGI:
        return _tgi_on_openai(request, engines.get(engine), model, tokenizer, window,
                              output_cap, parsed)
    return _completions_on_tgi(request, version, tokenizer, output_cap)


def passes_through(request: GenerationRequest, engine: str, version: str | None) -> bool:
    """A replica of ``engine`` takes ``request`` in the client's own dialect (no
    translation): where a proxy that cannot translate (the endpoint picker) may send it."""
    profile = engines.get(engine)
    api = profile.api
    if request.api is Api.ANTHROPIC:
        return profile.serves_messages
    if request.api is Api.TGI:
        return api is Api.TGI
    return api is not Api.TGI or request.is_chat or _at_least(version, TGI_COMPLETIONS_API)


def _tgi_on_openai(request: GenerationRequest, engine: Engine, model: str,
                   tokenizer: ModelTokenizer | None, window: int | None,
                   output_cap: int | None, parsed: TranslationPlan | None) -> Translated:
    p = _tgi_parameters(request, parsed)
    if output_cap is not None:
        p = dataclasses.replace(p, max_new_tokens=output_cap)
    prompt_ids = None
    if p.truncate is not None and not engine.truncates_prompt and tokenizer is not None:
        prompt_ids = tokenizer.encode(p.inputs)[-p.truncate:]  # TGI keeps the last tokens
    prompt_tokens = None
    if p.max_new_tokens is None and tokenizer is not None:
        prompt_tokens = len(prompt_ids) if prompt_ids is not None else tokenizer.count_text(p.inputs)
        if p.truncate is not None:
            prompt_tokens = min(prompt_tokens, p.truncate)
    max_tokens = tgi_request.max_tokens_for(p, window, prompt_tokens)
    body, seed = tgi_request.openai_body(p, engine, model, request.stream, max_tokens, prompt_ids)
    needs_texts = tokenizer is not None and (p.top_n_tokens > 0 or engine.top_tokens_as_ids)

    def texts() -> TokenTexts | None:
        return TokenTexts(tokenizer) if needs_texts and tokenizer is not None else None

    def reader() -> StreamReader:
        return tgi_response.TgiStream(p, engine, max_tokens, texts(), seed)

    def answer(content: bytes, headers: Mapping[str, str]) -> tuple[bytes, Usage]:
        if engine.tgi_always_streams:  # asked for a stream either way (tgi_request.openai_body)
            return tgi_response.tgi_body_from_stream(p, engine, max_tokens, content, texts(),
                                                     seed, compat=request.path == "/")
        return tgi_response.tgi_body(p, engine, _json_object(content), texts(), seed,
                                     compat=request.path == "/")

    return Translated("/v1/completions", orjson.dumps(body), Api.TGI, reader, answer)


def _messages_on_chat(request: GenerationRequest, engine: Engine, model: str,
                      tokenizer: ModelTokenizer | None, output_cap: int | None,
                      counted: int | None) -> Translated:
    stop_key = engine.stop_reason_key

    def prompt_tokens() -> int | None:
        """For ``message_start``, when the engine counts the prompt only at the end:
        admission's count, else the gateway counts it now."""
        if counted is not None or tokenizer is None:
            return counted
        try:
            return anthropic_protocol.prompt_tokens(request, tokenizer)
        except ChatTemplateError:  # it failed admission's count too
            return None

    def reader() -> StreamReader:
        return anthropic_chat.MessageStream(stop_key, prompt_tokens)

    def answer(content: bytes, headers: Mapping[str, str]) -> tuple[bytes, Usage]:
        return anthropic_chat.message_body(_json_object(content), stop_key)

    return Translated("/v1/chat/completions", anthropic_chat.chat_body(request, model, output_cap),
                      Api.ANTHROPIC, reader, answer)


def _completions_on_tgi(request: GenerationRequest, version: str | None,
                        tokenizer: ModelTokenizer | None, output_cap: int | None) -> Translated:
    body, plan_ = openai_to_tgi.tgi_body(capped_body(request, output_cap), request.stream)
    # TGI gives the prompt count in `x-prompt-tokens` (>= 1.4.0) and, for streams, in
    # details.input_length (>= 2.3); else the model's tokenizer counts it, if configured.
    counted = None
    if tokenizer is not None and not (
            _at_least(version, TGI_STREAM_INPUT_LENGTH if request.stream else TGI_MESSAGES_API)):
        counted = tokenizer.count_text(plan_.prompt)

    def reader() -> StreamReader:
        return openai_to_tgi.CompletionStream(plan_, counted)

    def answer(content: bytes, headers: Mapping[str, str]) -> tuple[bytes, Usage]:
        header = headers.get("x-prompt-tokens", "")
        prompt = int(header) if header.isdigit() else counted
        return openai_to_tgi.completion_body(plan_, _json_object(content), prompt)

    path = "/generate_stream" if request.stream else "/generate"
    return Translated(path, orjson.dumps(body), Api.OPENAI, reader, answer)


def _json_object(content: bytes) -> dict[str, Any]:
    try:
        parsed = orjson.loads(content)
    except orjson.JSONDecodeError:
        return {}
    if isinstance(parsed, list) and parsed and isinstance(parsed[0], dict):
        return parsed[0]
    return parsed if isinstance(parsed, dict) else {}
