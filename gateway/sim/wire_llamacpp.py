"""llama.cpp's (``llama-server``'s) answers on its OpenAI-compatible routes, in its own field
order: a stream's end in a chunk of its own after the last token, ``timings``, its usage."""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import orjson

from gateway.sim.parse import Job
from gateway.sim.wire import Logprobs, Vocab, openai_finish, openai_texts

LLAMACPP_BUILD = "b1-5171a7e"  # llama.cpp's build_info, also its system_fingerprint
_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


class LlamaCppStream:
    """llama.cpp's SSE events for ``/v1/completions`` and ``/v1/chat/completions``, in its
    own field order: the end in a chunk of its own after the last token (a completion's with
    usage and timings; chat's usage in one more chunk when asked), ids ``chatcmpl-`` on both
    routes, ``timings`` on every token's chunk with ``timings_per_token``."""

    def __init__(self, chat: bool, model: str, job: Job, vocab: Vocab, include_usage: bool,
                 data_prefix: bytes = b"data: ") -> None:
        self.chat, self.model, self.job, self.vocab = chat, model, job, vocab
        self.include_usage, self.prefix = include_usage, data_prefix
        self.choice = job.choices[0]
        self.texts = openai_texts(self.choice, trim_stop=True)
        self.logprobs = Logprobs("llamacpp", job, vocab, job.choices[0])
        self.per_token = job.extras.timings_per_token
        self.id, self.created = llamacpp_id(), int(time.time())
        self.obj = "chat.completion.chunk" if chat else "text_completion"

    def _event(self, choices: list[dict[str, Any]], generated: int, usage: dict[str, Any] | None = None,
               timings: bool = False) -> bytes:
        """One chunk; chat's id comes after ``created``, a completion's after its usage."""
        chunk: dict[str, Any] = {"choices": choices, "created": self.created}
        if self.chat:
            chunk["id"] = self.id
        chunk |= {"model": self.model, "system_fingerprint": LLAMACPP_BUILD, "object": self.obj}
        if usage is not None:
            chunk["usage"] = usage
        if not self.chat:
            chunk["id"] = self.id
        if timings:
            chunk["timings"] = llamacpp_timings(self.job.prompt_tokens, generated)
        return self.prefix + orjson.dumps(chunk) + b"\n\n"

    def open(self) -> bytes:
        if not self.chat:
            return b""
        return self._event([{"finish_reason": None, "index": 0,
                             "delta": {"role": "assistant", "content": None}}], 0)

    def tokens(self, start: int, pieces: Sequence[int]) -> bytes:
        out = []
        for k, j in enumerate(pieces, start):
            lp = self.logprobs.llamacpp(k, [j])
            if self.chat:
                choice: dict[str, Any] = {"finish_reason": None, "index": 0, "delta": {"content": self.texts[k]}}
                if lp is not None:
                    choice["logprobs"] = lp
            else:
                choice = {"text": self.texts[k], "index": 0, "logprobs": lp, "finish_reason": None}
            out.append(self._event([choice], k + 1, timings=self.per_token))
        return b"".join(out)

    def close(self, generated: int) -> bytes:
        finish = openai_finish(self.choice)
        usage_now = llamacpp_usage(self.job.prompt_tokens, generated)
        if not self.chat:  # usage and timings on the end's chunk, asked or not
            return self._event([{"text": "", "index": 0, "logprobs": None, "finish_reason": finish}],
                               generated, usage_now, timings=True) + self.prefix + b"[DONE]\n\n"
        end = [{"finish_reason": finish, "index": 0, "delta": {}}]
        if not self.include_usage:
            return self._event(end, generated, timings=True) + self.prefix + b"[DONE]\n\n"
        return (self._event(end, generated) + self._event([], generated, usage_now, timings=True)
                + self.prefix + b"[DONE]\n\n")


def llamacpp_id() -> str:
    """``chatcmpl-`` and 32 letters and digits, on either route."""
    return "chatcmpl-" + "".join(_ALNUM[b % 62] for b in os.urandom(32))


def llamacpp_usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"completion_tokens": completion, "prompt_tokens": prompt, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 0}}


def llamacpp_timings(prompt: int, predicted: int) -> dict[str, Any]:
    """llama.cpp's timings, at a simulated 0.5 ms per prompt token and 2 ms per token out."""
    prompt_ms, predicted_ms = 0.5 * prompt, 2.0 * predicted
    return {"cache_n": 0, "prompt_n": prompt, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt if prompt else 0.0,
            "prompt_per_second": 1000.0 * prompt / prompt_ms if prompt_ms else 0.0,
            "predicted_n": predicted, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
            "predicted_per_second": 1000.0 * predicted / predicted_ms if predicted_ms else 0.0}


def llamacpp_body(chat: bool, model: str, job: Job, vocab: Vocab) -> bytes:
    """A whole llama.cpp answer (one choice: llama.cpp has no ``n``)."""
    c = job.choices[0]
    content = "".join(openai_texts(c, trim_stop=True))
    lp = Logprobs("llamacpp", job, vocab, c).llamacpp(0, c.pieces)
    if chat:
        choice: dict[str, Any] = {"finish_reason": openai_finish(c), "index": 0,
                                  "message": {"role": "assistant", "content": content}}
        if lp is not None:
            choice["logprobs"] = lp
    else:
        choice = {"text": content, "index": 0, "logprobs": lp, "finish_reason": openai_finish(c)}
    generated = len(c.pieces)
    return orjson.dumps({"choices": [choice], "created": int(time.time()), "model": model,
                         "system_fingerprint": LLAMACPP_BUILD,
                         "object": "chat.completion" if chat else "text_completion",
                         "usage": llamacpp_usage(job.prompt_tokens, generated), "id": llamacpp_id(),
                         "timings": llamacpp_timings(job.prompt_tokens, generated)})
