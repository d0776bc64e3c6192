"""vLLM's routes that generate nothing, parsed into a GenerationRequest that costs its input
tokens and no output: ``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score`` (and
``/v1/score``), ``/rerank`` (and ``/v1/rerank``), and ``/tokenize``, ``/detokenize`` (which
run no model: they cost nothing, and have no window to check).

The prompts the window check counts are the texts the engine tokenizes: the inputs, or, for
score and rerank, each query joined with each document (a cross-encoder reads them as one
sequence). Bodies go to the engine as they came (pass-through); answers come back whole,
with their ``usage.prompt_tokens`` metered. Only engines that serve a route get it
(``Engine.pooling_routes``, ``Engine.tgi_routes``).
"""

from __future__ import annotations

from typing import Any, Callable

from gateway.protocol.errors import Api, InvalidRequest
from gateway.protocol.openai import check_messages, check_prompt
from gateway.protocol.request import GenerationRequest, field, parse_json_object

def _request(path: str, body: dict[str, Any], raw: bytes,
             prompt: str | list[Any] | None = None,
             messages: list[dict[str, Any]] | None = None,
             api: Api = Api.OPENAI) -> GenerationRequest:
    return GenerationRequest(api=api, path=path, body=body, raw=raw,
                             model=field(body, "model", str), stream=False, max_tokens=0,
                             prompt=prompt, messages=messages, pooling=True)


def _inputs(path: str) -> Callable[[bytes], GenerationRequest]:
    """Embeddings, pooling, classify: ``input`` (text(s) or token ids), or chat ``messages``."""

    def parse(raw: bytes) -> GenerationRequest:
        body = parse_json_object(raw, Api.OPENAI)
        if "messages" in body:
            messages = field(body, "messages", list, required=True)
            check_messages(messages)
            return _request(path, body, raw, messages=messages)
        if "input" not in body:
            raise InvalidRequest("`input` is required", param="input")
        check_prompt(body["input"], "input")
        return _request(path, body, raw, prompt=body["input"])

    return parse


def _texts(body: dict[str, Any], name: str, required: bool = True) -> list[str]:
    value = body.get(name)
    if value is None and not required:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise InvalidRequest(f"`{name}` must be a string or a non-empty array of strings",
                         param=name)


def _document_text(document: Any, index: int) -> str:
    if isinstance(document, str):
        return document
    if isinstance(document, dict) and isinstance(document.get("text"), str):
        return document["text"]
    raise InvalidRequest(f"`documents[{index}]` must be a string or an object with a `text`",
                         param="documents")


def _score(path: str) -> Callable[[bytes], GenerationRequest]:
    """``text_1`` against each of ``text_2`` (one each: pairwise)."""

    def parse(raw: bytes) -> GenerationRequest:
        body = parse_json_object(raw, Api.OPENAI)
        first, second = _texts(body, "text_1"), _texts(body, "text_2")
        if len(first) == 1:
            pairs = [first[0] + t for t in second]
        elif len(first) == len(second):
            pairs = [a + b for a, b in zip(first, second)]
        else:
            raise InvalidRequest(f"`text_1` has {len(first)} texts and `text_2` "
                                 f"{len(second)}: give one, or as many", param="text_1")
        return _request(path, body, raw, prompt=pairs)

    return parse


def _rerank(path: str) -> Callable[[bytes], GenerationRequest]:
    """``query`` against each of ``documents``."""

    def parse(raw: bytes) -> GenerationRequest:
        body = parse_json_object(raw, Api.OPENAI)
        query = field(body, "query", str, required=True)
        documents = field(body, "documents", list, required=True)
        if not documents:
            raise InvalidRequest("`documents` must not be empty", param="documents")
        field(body, "top_n", int, minimum=0)
        return _request(path, body, raw,
                        prompt=[query + _document_text(d, i) for i, d in enumerate(documents)])

    return parse


def parse_tokenize(raw: bytes) -> GenerationRequest:
    """vLLM's (``prompt`` or ``messages``), or TGI's (``inputs``: a TGI client, answered by
    TGI engines and in TGI's error shape)."""
    body = parse_json_object(raw, Api.OPENAI)
    if "inputs" in body and "prompt" not in body and "messages" not in body:
        try:
            field(body, "inputs", str, required=True)
        except InvalidRequest as error:
            error.api = Api.TGI  # a TGI client: TGI's shape
            raise
        return _request("/tokenize", body, raw, prompt="", api=Api.TGI)
    if "messages" in body:
        check_messages(field(body, "messages", list, required=True))
    else:
        field(body, "prompt", str, required=True)
    return _request("/tokenize", body, raw, prompt="")  # no model runs: it costs nothing


def parse_detokenize(raw: bytes) -> GenerationRequest:
    body = parse_json_object(raw, Api.OPENAI)
    tokens = field(body, "tokens", list, required=True)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise InvalidRequest("`tokens` must be an array of token ids", param="tokens")
    return _request("/detokenize", body, raw, prompt="")


PARSERS: dict[str, Callable[[bytes], GenerationRequest]] = {
    "/v1/embeddings": _inputs("/v1/embeddings"),
    "/pooling": _inputs("/pooling"),
    "/classify": _inputs("/classify"),
    "/score": _score("/score"),
    "/v1/score": _score("/v1/score"),
    "/rerank": _rerank("/rerank"),
    "/v1/rerank": _rerank("/v1/rerank"),
    "/tokenize": parse_tokenize,
    "/detokenize": parse_detokenize,
}
