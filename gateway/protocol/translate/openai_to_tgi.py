"""OpenAI ``/v1/completions`` served by a TGI replica that has no ``/v1/completions``
(TGI < 1.4.4): the request becomes ``/generate`` (``/generate_stream``), the answer an OpenAI
completion (chunks), with usage built from TGI's ``details``.

``OPENAI_TO_TGI`` is the table: each OpenAI field and what it becomes on TGI; ``None`` means
TGI has no equivalent and a request that uses it is refused (400 naming the field).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.protocol.errors import InvalidRequest
from gateway.protocol.translate.sse import TranslatingReader
from gateway.protocol.usage import Usage

# OpenAI /v1/completions field -> TGI /generate parameter (None: refused unless neutral).
OPENAI_TO_TGI: dict[str, str | None] = {
    "model": "(routing only)",
    "prompt": "inputs",
    "max_tokens": "max_new_tokens (absent: 16, OpenAI's default)",
    "temperature": "temperature; 0 -> do_sample false (greedy), else do_sample true",
    "top_p": "top_p (1 -> not sent)",
    "top_k": "top_k (0 or -1 -> not sent)",
    "seed": "seed",
    "stop": "stop (the stop sequence is cut from the text, as OpenAI does)",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "best_of": "best_of",
    "logprobs": "details + top_n_tokens",
    "echo": "(the gateway prepends the prompt); with logprobs: decoder_input_details",
    "stream": "/generate_stream",
    "stream_options": "(usage from details)",
    "user": "(not sent: it does not change the generation)",
    "n": None,
    "presence_penalty": None,
    "logit_bias": None,
    "suffix": None,
}
DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) completions default


def _refused(name: str, why: str = "TGI's /generate has no equivalent") -> InvalidRequest:
    return InvalidRequest(f"`{name}` cannot be honoured by the TGI replicas serving this model "
                          f"({why})", param=name)


def _neutral(name: str, value: Any) -> bool:
    """A refused field with its no-op value asks for nothing."""
    return value is None or (name == "n" and value == 1) or (
        name == "presence_penalty" and value == 0) or (name == "logit_bias" and value == {})


@dataclass(slots=True)
class CompletionPlan:
    """What the answer needs from the request."""

    prompt: str
    model: str
    stop: list[str]
    echo: bool
    logprobs: int | None
    wants_usage: bool


def refusal(body: dict[str, Any]) -> InvalidRequest | None:
    for name, value in body.items():
        if name not in OPENAI_TO_TGI:
            return _refused(name, "an extension field TGI does not know")
        if OPENAI_TO_TGI[name] is None and not _neutral(name, value):
            return _refused(name)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            return _refused("prompt", "TGI takes one text prompt, not token ids or a batch")
    if body.get("echo") and body.get("logprobs") is not None and body.get("stream"):
        return _refused("echo", "prompt logprobs are not available when streaming")
    return None


def tgi_body(body: dict[str, Any], stream: bool) -> tuple[dict[str, Any], CompletionPlan]:
    """The ``/generate`` body (``details`` always: finish reason and token counts)."""
    prompt = body["prompt"][0] if isinstance(body["prompt"], list) else body["prompt"]
    parameters: dict[str, Any] = {"details": True,
                                  "max_new_tokens": body.get("max_tokens") or DEFAULT_MAX_TOKENS}
    temperature = body.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else temperature
    if temperature > 0:
        parameters["do_sample"] = True
        if temperature != 1.0:
            parameters["temperature"] = temperature
    top_p = body.get("top_p")
    if top_p is not None and top_p < 1.0:
        parameters["top_p"] = top_p
    top_k = body.get("top_k")
    if top_k is not None and top_k > 0:
        parameters["top_k"] = top_k
    for name in ("seed", "frequency_penalty", "repetition_penalty"):
        if body.get(name) is not None:
            parameters[name] = body[name]
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [s for s in stop or [] if s]
    if stop:
        parameters["stop"] = stop
    if (body.get("best_of") or 1) > 1:
        parameters["best_of"] = body["best_of"]
    logprobs = body.get("logprobs")
    if logprobs:
        parameters["top_n_tokens"] = logprobs
    if body.get("echo") and logprobs is not None:
        parameters["decoder_input_details"] = True
    options = body.get("stream_options") or {}
    plan = CompletionPlan(prompt, str(body.get("model") or ""), stop, bool(body.get("echo")),
                          logprobs, bool(options.get("include_usage")))
    return {"inputs": prompt, "parameters": parameters, "stream": stream}, plan


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _cut_stop(text: str, stop: list[str], reason: str | None) -> str:
    """TGI's text ends with the stop sequence that matched; OpenAI's does not include it."""
    if reason == "stop_sequence":
        for s in stop:
            if text.endswith(s):
                return text[:-len(s)]
    return text


def _logprobs(tokens: list[dict[str, Any]], tops: list[list[dict[str, Any]]] | None,
              offset: int, prefill: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """TGI tokens (and top tokens) -> OpenAI completion ``logprobs``."""
    entries = [*(prefill or []), *tokens]
    top_lists: list[Any] = [None] * len(prefill or []) + list(tops or [[] for _ in tokens])
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    for entry, top in zip(entries, top_lists):
        text = "" if entry.get("special") else entry.get("text", "")
        out["tokens"].append(text)
        out["token_logprobs"].append(entry.get("logprob"))
        out["text_offset"].append(offset)
        offset += len(text)
        if top is None:
            out["top_logprobs"].append(None)
        else:
            out["top_logprobs"].append({t.get("text", ""): t.get("logprob") for t in top}
                                       or {text: entry.get("logprob")})
    return out


def completion_id() -> str:
    return "cmpl-" + os.urandom(12).hex()


def usage_of(prompt_tokens: int | None, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": (prompt_tokens or 0) + completion_tokens}


def completion_body(plan: CompletionPlan, response: Any,
                    prompt_tokens: int | None) -> tuple[bytes, Usage]:
    """An OpenAI completion from a ``/generate`` answer (with details)."""
    details = response.get("details") or {}
    reason = details.get("finish_reason")
    text = _cut_stop(str(response.get("generated_text", "")), plan.stop, reason)
    prefix = plan.prompt if plan.echo else ""
    logprobs = None
    if plan.logprobs is not None:
        prefill = details.get("prefill") if plan.echo else None
        logprobs = _logprobs(details.get("tokens") or [], details.get("top_tokens") if plan.logprobs
                             else None, 0, prefill)
    generated = int(details.get("generated_tokens") or 0)
    choice = {"index": 0, "text": prefix + text, "logprobs": logprobs,
              "finish_reason": _finish(reason)}
    out = {"id": completion_id(), "object": "text_completion", "created": int(time.time()),
           "model": plan.model, "choices": [choice], "usage": usage_of(prompt_tokens, generated)}
    return orjson.dumps(out), Usage(prompt_tokens, generated, _finish(reason))


class CompletionStream(TranslatingReader):
    """Reads TGI ``/generate_stream`` events, writes OpenAI completion chunks.

    Text that could be the start of a stop sequence is held back until the next token shows
    it is not (TGI includes the stop sequence in its text; OpenAI does not).
    """

    def __init__(self, plan: CompletionPlan, prompt_tokens: int | None) -> None:
        self.plan = plan
        self.prompt_tokens = prompt_tokens
        super().__init__()
        self.sent = ""        # text written to the client
        self.text = ""        # text generated so far
        self.offset = 0
        self.head = (b'{"id":"%s","object":"text_completion","created":%d,"model":%s,"choices":'
                     % (completion_id().encode(), int(time.time()), orjson.dumps(plan.model)))
        self.first = True

    def _chunk(self, text: str, logprobs: Any, reason: str | None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return b"data: " + self.head + orjson.dumps([choice]) + b"}\n\n"

    def _events(self, payloads: list[bytes]) -> tuple[bytes, int]:
        out: list[bytes] = []
        tokens = 0
        for payload in payloads:
            if self.finished:
                break
            event = orjson.loads(payload)
            if "error" in event:
                error = {"message": str(event.get("error")), "type": "upstream_error",
                         "param": None, "code": None}
                out.append(b"data: " + orjson.dumps({"error": error}) + b"\n\ndata: [DONE]\n\n")
                self.finished = True
                continue
            token = event.get("token") or {}
            tokens += 1
            piece = "" if token.get("special") else str(token.get("text", ""))
            final = event.get("generated_text") is not None
            logprobs = None
            if self.plan.logprobs is not None:
                logprobs = _logprobs([token], [event.get("top_tokens") or []], self.offset)
                self.offset += len(piece)
            if self.first and self.plan.echo:
                self.text = self.plan.prompt
            self.first = False
            self.text += piece
            if not final:
                send = self._safe_end()
                out.append(self._chunk(self.text[len(self.sent):send], logprobs, None))
                self.sent = self.text[:send]
                continue
            details = event.get("details") or {}
            reason = details.get("finish_reason")
            prefix = self.plan.prompt if self.plan.echo else ""
            final_text = prefix + _cut_stop(str(event["generated_text"]), self.plan.stop, reason)
            rest = final_text[len(self.sent):] if final_text.startswith(self.sent) else ""
            out.append(self._chunk(rest, logprobs, _finish(reason)))
            generated = int(details.get("generated_tokens") or self.token_events + tokens)
            prompt = details.get("input_length", self.prompt_tokens)
            self.usage = Usage(prompt, generated, _finish(reason))
            if self.plan.wants_usage:
                out.append(b"data: " + self.head + b'[],"usage":'
                           + orjson.dumps(usage_of(prompt, generated)) + b"}\n\n")
            out.append(b"data: [DONE]\n\n")
            self.finished = True
        self.token_events += tokens
        return b"".join(out), tokens

    def _safe_end(self) -> int:
        """How much of the text cannot be part of a stop sequence still to complete."""
        end = len(self.text)
        for stop in self.plan.stop:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    end = min(end, len(self.text) - k)
                    break
        return max(end, len(self.sent))
