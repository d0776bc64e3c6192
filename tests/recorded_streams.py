"""Streams and bodies as the real engines write them, byte for byte, for the relay-fidelity test.

Shapes follow each engine's serializer (``reference/ENGINE-WIRE.md``): vLLM and SGLang write
pydantic's compact JSON (SGLang with ``"usage":null`` on every chunk), llama.cpp its own
field order with ``"delta":{}`` and usage plus timings on the last chunk, TGI serde's compact
JSON (``data:{...}`` before 2.1) with a ``:`` keep-alive comment, vLLM's mid-stream error
``json.dumps``'d (with spaces) and followed by ``[DONE]``.

``Recording.usage`` is what the gateway must account: the engine's usage when it sends one,
else ``(None, token events)``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True)
class Recording:
    name: str
    engine: str          # the replica's engine in the gateway config (tgi-1.4.3: an old TGI)
    path: str            # the client's route (of the other dialect: translated)
    body: dict[str, Any]  # the client's request (the test may add stream_options)
    data: bytes          # what the engine writes
    usage: tuple[int | None, int]  # (prompt tokens, generated tokens) the gateway must count
    usage_chunk: bytes = b""  # the usage-only event: stripped when the client did not ask

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def expected(self, wants_usage: bool) -> bytes:
        """What a client receives through the gateway."""
        if self.usage_chunk and not wants_usage:
            return as_the_client_asked(self.data, wants_usage)
        return self.data

    def event_ends(self) -> list[int]:
        """Byte offsets just past each SSE event: where 'one event per write' cuts."""
        ends, at = [], self.data.find(b"\n\n")
        while at >= 0:
            ends.append(at + 2)
            at = self.data.find(b"\n\n", at + 2)
        return [e for e in ends if e < len(self.data)]


def _sse(obj: Any, prefix: bytes = b"data: ") -> bytes:
    return prefix + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"
# Token texts with what a careless reader trips on: quotes, escapes, a fake event boundary
# and the words the relay looks for.
TEXTS = [" The", " \"usage\":{", " data: [DONE]", "\n\n", " caf\u00e9", " \u4f60\u597d", " {}", " \"\""]


VLLM_FINGERPRINT = "vllm-0.32.0-e448ce5d"


def _vllm_completion_chunks(texts: list[str], finish: str | None) -> bytes:
    """vLLM 0.32's completion chunks, as a client that asked for usage gets them (the
    fingerprint then rides on the usage chunk, not on the terminal chunk)."""
    out = []
    for i, text in enumerate(texts):
        out.append(_sse({"id": "cmpl-7f3a9c", "object": "text_completion", "created": 1763900000,
                         "model": "m", "choices": [{"index": 0, "text": text, "logprobs": None,
                                                    "finish_reason": finish if i == len(texts) - 1 else None,
                                                    "stop_reason": None, "prompt_token_ids": None,
                                                    "token_ids": None}]}))
    return b"".join(out)


def _vllm_usage(obj: str, prompt: int, completion: int) -> bytes:
    return _sse({"id": "cmpl-7f3a9c", "object": obj, "created": 1763900000, "model": "m",
                 "choices": [], "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                          "completion_tokens": completion},
                 "system_fingerprint": VLLM_FINGERPRINT})


def _vllm_chat(texts: list[str], finish: str) -> bytes:
    """vLLM 0.32's chat chunks: a role chunk, content chunks, the last one with the finish."""
    head = {"id": "chatcmpl-41d0", "object": "chat.completion.chunk", "created": 1763900000, "model": "m"}
    out = [_sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}],
                 "prompt_token_ids": None, "prompt_text": None})]
    for i, text in enumerate(texts or [""]):
        last = i == max(len(texts), 1) - 1
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
                  "finish_reason": finish if last else None}
        if last:
            choice["stop_reason"] = None
        out.append(_sse({**head, "choices": [{**choice, "token_ids": None}]}))
    return b"".join(out)


def as_the_client_asked(engine_sent: bytes, wants_usage: bool) -> bytes:
    """What a client that asked for no usage gets of a stream the gateway asked usage for on
    its behalf: no usage-only chunk, and the fingerprint that vLLM moves from the terminal
    chunks to the usage chunk back where vLLM writes it when no usage chunk follows."""
    if wants_usage:
        return engine_sent
    events, fingerprint = [], None
    for event in (e for e in engine_sent.split(b"\n\n") if e):
        if event.startswith(b"data: {") and b'"choices":[]' in event and b'"usage":{' in event:
            fingerprint = orjson.loads(event[6:]).get("system_fingerprint")
            continue
        events.append(event)
    if fingerprint is not None:
        stamp = b',"system_fingerprint":' + orjson.dumps(fingerprint) + b"}"
        events = [e[:-1] + stamp if b'"finish_reason":"' in e and b'"system_fingerprint"' not in e
                  else e for e in events]
    return b"".join(e + b"\n\n" for e in events)


_TOKEN_IDS = re.compile(rb'"(prompt_token_ids|token_ids)":\[[0-9, ]*\]')


def without_token_ids(engine_sent: bytes) -> bytes:
    """What a client that did not ask vLLM for token ids gets of a stream the gateway asked
    them for on its behalf (migration): ``null`` where the ids were, as vLLM writes them."""
    return _TOKEN_IDS.sub(rb'"\1":null', engine_sent)


def _sglang_completion(texts: list[str], prompt: int) -> tuple[bytes, bytes]:
    out = []
    for i, text in enumerate(texts):
        out.append(_sse({"id": "a1b2c3", "object": "text_completion", "created": 1763900000, "model": "m",
                         "choices": [{"index": 0, "text": text, "logprobs": None,
                                      "finish_reason": "length" if i == len(texts) - 1 else None,
                                      "matched_stop": None}], "usage": None}))
    usage = _sse({"id": "a1b2c3", "object": "text_completion", "created": 1763900000, "model": "m",
                  "choices": [], "usage": {"prompt_tokens": prompt, "total_tokens": prompt + len(texts),
                                           "completion_tokens": len(texts), "prompt_tokens_details": None}})
    return b"".join(out) + usage, usage


def _llamacpp_chat(texts: list[str], prompt: int) -> bytes:
    tail = {"created": 1763900000, "id": "chatcmpl-X6urH4f6", "model": "m",
            "system_fingerprint": "b6097-9515c613", "object": "chat.completion.chunk"}
    out = [_sse({"choices": [{"finish_reason": None, "index": 0,
                              "delta": {"role": "assistant", "content": None}}], **tail})]
    for text in texts:
        out.append(_sse({"choices": [{"finish_reason": None, "index": 0, "delta": {"content": text}}], **tail}))
    out.append(_sse({"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], **tail,
                     "usage": {"completion_tokens": len(texts), "prompt_tokens": prompt,
                               "total_tokens": prompt + len(texts)},
                     "timings": {"prompt_n": prompt, "prompt_ms": 20.3, "predicted_n": len(texts),
                                 "predicted_ms": 93.6}}))
    return b"".join(out) + DONE


def _tgi_stream(texts: list[str], details: bool, prefix: bytes = b"data: ",
                keepalive: bool = False, error_after: int | None = None,
                input_length: bool = True) -> bytes:
    out = [b":\n\n"] if keepalive else []
    for i, text in enumerate(texts):
        if error_after is not None and i == error_after:
            out.append(_sse({"error": "Request failed during generation: CUDA out of memory",
                             "error_type": "generation"}, prefix))
            return b"".join(out)
        last = i == len(texts) - 1
        event = {"index": i + 1, "token": {"id": 1000 + i, "text": text, "logprob": -0.25, "special": False},
                 "generated_text": "".join(texts) if last else None,
                 "details": ({"finish_reason": "length", "generated_tokens": len(texts), "seed": None,
                              **({"input_length": 9} if input_length else {})}
                             if last and details else None)}
        out.append(_sse(event, prefix))
        if keepalive and i == 2:
            out.append(b":\n\n")
    return b"".join(out)


def _vllm_for_tgi(texts: list[str], prompt: int) -> bytes:
    """vLLM's stream for a translated TGI request: logprobs and token ids on every chunk,
    the prompt's ids on the first, then the usage chunk and [DONE]."""
    out, offset = [], 0
    for i, text in enumerate(texts):
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": {
            "text_offset": [offset], "token_logprobs": [-0.25 - i / 100], "tokens": [text],
            "top_logprobs": [{text: -0.25 - i / 100}]},
            "finish_reason": "length" if i == len(texts) - 1 else None, "stop_reason": None}
        if i == 0:
            choice["prompt_token_ids"] = list(range(1, prompt + 1))
        choice["token_ids"] = [1000 + i]
        offset += len(text)
        out.append(_sse({"id": "cmpl-7f3a9c", "object": "text_completion", "created": 1763900000,
                         "model": "m", "choices": [choice]}))
    return b"".join(out) + _vllm_usage("text_completion", prompt, len(texts)) + DONE


def _llamacpp_for_tgi(texts: list[str], prompt: int) -> bytes:
    """llama.cpp's completion stream with probabilities: one chunk per token, the last token
    the end-of-sequence one (empty text), the end in a chunk of its own with usage, [DONE]."""
    tail = {"created": 1763900000, "model": "m", "system_fingerprint": "b6097-9515c613",
            "object": "text_completion", "id": "chatcmpl-X6urH4f6"}
    out = []
    for i, text in enumerate([*texts, ""]):
        token = {"id": 1000 + i if text else 2, "token": text, "bytes": list(text.encode()),
                 "logprob": -0.5, "top_logprobs": [{"id": 1000 + i if text else 2, "token": text,
                                                    "bytes": list(text.encode()), "logprob": -0.5}]}
        out.append(_sse({"choices": [{"text": text, "index": 0, "logprobs": {"content": [token]},
                                      "finish_reason": None}], **tail}))
    n = len(texts) + 1
    out.append(_sse({"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "stop"}],
                     **tail, "usage": {"completion_tokens": n, "prompt_tokens": prompt,
                                       "total_tokens": prompt + n},
                     "timings": {"prompt_n": prompt, "prompt_ms": 20.3, "predicted_n": n,
                                 "predicted_ms": 93.6}}))
    return b"".join(out) + DONE


def _recordings() -> list[Recording]:
    texts = TEXTS * 2  # 16 tokens
    completion = {"model": "m", "prompt": "Once upon", "max_tokens": 16, "stream": True}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": True}
    usage16 = _vllm_usage("text_completion", 9, 16)
    chat_usage = _vllm_usage("chat.completion.chunk", 12, 16)
    chat_eos_usage = _vllm_usage("chat.completion.chunk", 12, 1)
    sglang, sglang_usage = _sglang_completion(texts, 9)
    vllm_error = b"data: " + json.dumps({"error": {  # vLLM json.dumps()es its error events
        "message": "EngineCore encountered an issue.", "type": "InternalServerError",
        "param": None, "code": 500}}).encode() + b"\n\n"
    tgi_body = {"inputs": "Once upon", "parameters": {"max_new_tokens": 16, "details": True}}
    generate_json = orjson.dumps({"generated_text": "".join(texts), "details": {
        "finish_reason": "length", "generated_tokens": 16, "seed": None, "prefill": [],
        "tokens": [{"id": 1000 + i, "text": t, "logprob": -0.25, "special": False}
                   for i, t in enumerate(texts)]}})
    completion_json = orjson.dumps({"id": "cmpl-9", "object": "text_completion", "created": 1763900000,
                                    "model": "m", "choices": [{"index": 0, "text": "".join(texts),
                                                               "logprobs": None, "finish_reason": "length",
                                                               "stop_reason": None}],
                                    "usage": {"prompt_tokens": 9, "total_tokens": 25, "completion_tokens": 16}})
    return [
        Recording("vllm-completions-usage", "vllm", "/v1/completions", completion,
                  _vllm_completion_chunks(texts, "length") + usage16 + DONE, (9, 16), usage16),
        Recording("vllm-completions-no-usage", "vllm", "/v1/completions", completion,
                  _vllm_completion_chunks(texts, "length") + DONE, (None, 16)),
        Recording("vllm-chat-usage", "vllm", "/v1/chat/completions", chat,
                  _vllm_chat(texts, "length") + chat_usage + DONE, (12, 16), chat_usage),
        Recording("vllm-chat-eos-first", "vllm", "/v1/chat/completions", chat,
                  _vllm_chat([], "stop") + chat_eos_usage + DONE, (12, 1), chat_eos_usage),
        Recording("vllm-error-mid-stream", "vllm", "/v1/completions", completion,
                  _vllm_completion_chunks(texts[:5], None) + vllm_error + DONE, (None, 5)),
        Recording("sglang-completions-usage", "sglang", "/v1/completions", completion,
                  sglang + DONE, (9, 16), sglang_usage),
        Recording("llamacpp-chat", "llamacpp", "/v1/chat/completions", chat,
                  _llamacpp_chat(texts, 12), (12, 16)),
        Recording("tgi-generate-stream-details", "tgi", "/generate_stream", tgi_body,
                  _tgi_stream(texts, details=True, keepalive=True), (9, 16)),
        Recording("tgi-generate-stream-no-space", "tgi", "/generate_stream",
                  {"inputs": "Once upon", "parameters": {"max_new_tokens": 16}},
                  _tgi_stream(texts, details=False, prefix=b"data:"), (None, 16)),
        Recording("tgi-error-mid-stream", "tgi", "/generate_stream", tgi_body,
                  _tgi_stream(texts, details=True, error_after=6), (None, 6)),
        Recording("vllm-completion-body", "vllm", "/v1/completions", {**completion, "stream": False},
                  completion_json, (9, 16)),
        Recording("tgi-generate-body", "tgi", "/generate", tgi_body, generate_json, (None, 16)),
        # Translated: a TGI client on OpenAI engines, OpenAI completions on TGI 1.4.3 (whose
        # streams are `data:{` without a space, keep-alives and all, and report no prompt count).
        Recording("vllm-for-tgi-client", "vllm", "/generate_stream", tgi_body,
                  _vllm_for_tgi(texts, 9), (9, 16)),
        Recording("llamacpp-for-tgi-client", "llamacpp", "/generate_stream", tgi_body,
                  _llamacpp_for_tgi(texts[:15], 9), (9, 16)),
        Recording("tgi-1.4.3-for-openai-client", "tgi-1.4.3", "/v1/completions", completion,
                  _tgi_stream(texts, details=True, prefix=b"data:", keepalive=True,
                              input_length=False), (None, 16)),
    ]


RECORDINGS = {r.name: r for r in _recordings()}
