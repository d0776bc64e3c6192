"""Response bodies and SSE events of OpenAI-style and TGI generation routes.

Plain stream events are cut from templates once per response (``_split``) and filled with the
pre-encoded JSON of each word piece, so a token costs a few byte concatenations. Requests that
ask for more (logprobs, token ids, stop strings, echo) get each event built as a dict, in the
engine's own field order:

- vLLM: ``logprobs`` (completions: ``tokens``/``token_logprobs``/``top_logprobs``/
  ``text_offset``; ``return_tokens_as_token_ids`` writes tokens as ``token_id:N``), chat
  ``logprobs``/``top_logprobs``, ``return_token_ids`` (``token_ids``, ``prompt_token_ids`` in
  the first chunk), ``prompt_logprobs`` (``{id: {logprob, rank, decoded_token}}``, the first
  ``null``), ``echo``, stop strings (cut from the text unless ``include_stop_str_in_output``;
  named in ``stop_reason``), ``n`` (not streamed), ``stream_interval`` (several tokens to a
  streamed chunk, their logprobs and token ids together).
- SGLang: the same logprobs, ``matched_stop`` (the stop string, or the EOS token id),
  ``no_stop_trim``.
- llama.cpp: ``logprobs.content`` (``{id, token, bytes, logprob, top_logprobs}``), the stop
  string always cut, and the end of a stream in a chunk of its own, after the last token.
- TGI: token ids and logprobs, ``top_tokens`` (``top_n_tokens``), ``prefill``
  (``decoder_input_details``), ``best_of_sequences``, ``return_full_text``; the EOS token is
  ``special`` and shows in details but not in ``generated_text``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import orjson

from gateway.sim import textgen
from gateway.sim.parse import Choice, Job
from gateway.sim.textgen import EOS, PIECES, PIECES_JSON, text

_HOLE = "\x00"
_HOLE_JSON = b'"\\u0000"'
DONE = b"data: [DONE]\n\n"
VLLM_VERSION = "0.32.0"  # the answers' shapes are this version's (checked against it: tests/real_engines)
VLLM_FINGERPRINT = f"vllm-{VLLM_VERSION}-5171a7ed"
# vLLM's chat message beside role and content (no tool_calls when there are none)
_VLLM_MESSAGE_NULLS = ("refusal", "annotations", "audio", "function_call", "reasoning")
LLAMACPP_BUILD = "b1-5171a7e"  # llama.cpp's build_info, also its system_fingerprint
_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def _split(obj: Any) -> list[bytes]:
    return orjson.dumps(obj).split(_HOLE_JSON)


def request_id(prefix: str) -> str:
    return prefix + os.urandom(12).hex()


def usage(prompt: int, completion: int) -> dict[str, int]:
    # vLLM's UsageInfo field order
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


class Vocab:
    """What the engine knows of its tokens: ids of the word pieces, the EOS token, decoding."""

    def __init__(self, piece_ids: Sequence[int], eos_id: int, eos_text: str, decode: Any) -> None:
        self.piece_ids, self.eos_id, self.eos_text, self.decode = piece_ids, eos_id, eos_text, decode

    def id(self, j: int) -> int:
        return self.eos_id if j == EOS else self.piece_ids[j]

    def openai_text(self, j: int) -> str:
        return "" if j == EOS else PIECES[j]


def openai_texts(choice: Choice, trim_stop: bool) -> list[str]:
    """Each token's share of the text the client sees: a matched stop string is cut (with
    what follows it in its token) unless the request keeps it."""
    texts = ["" if j == EOS else PIECES[j] for j in choice.pieces]
    full = "".join(texts)
    keep = len(full)
    if choice.finish == "stop" and choice.stop:
        at = full.find(choice.stop)
        keep = at if trim_stop else at + len(choice.stop)
    out, done = [], 0
    for t in texts:
        take = max(0, min(len(t), keep - done))
        out.append(t[:take])
        done += len(t)
    return out


def _stop_field(dialect: str, choice: Choice, vocab: Vocab) -> tuple[str, Any] | None:
    if dialect == "vllm":
        return "stop_reason", choice.stop
    if dialect == "sglang":
        return "matched_stop", choice.stop if choice.stop else (vocab.eos_id if choice.finish == "eos" else None)
    return None


def _openai_finish(choice: Choice) -> str:
    return "length" if choice.finish == "length" else "stop"


class _Logprobs:
    """OpenAI logprobs of one choice, in the engine's format."""

    def __init__(self, dialect: str, job: Job, vocab: Vocab, choice: Choice) -> None:
        self.dialect, self.job, self.vocab, self.choice = dialect, job, vocab, choice
        self.k = job.extras.logprobs or 0
        self.as_ids = job.extras.tokens_as_ids

    def _name(self, j: int) -> str:
        return f"token_id:{self.vocab.id(j)}" if self.as_ids else self.vocab.openai_text(j)

    def completion(self, start: int, pieces: Sequence[int], offset: int) -> dict[str, Any]:
        """vLLM/SGLang completions format for tokens ``start ..`` (text offsets from ``offset``)."""
        out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for position, j in enumerate(pieces, start):
            lp = textgen.logprob(self.choice.context(position), 0)
            out["text_offset"].append(offset)
            offset += len(self.vocab.openai_text(j))
            out["token_logprobs"].append(lp)
            out["tokens"].append(self._name(j))
            top = textgen.alternatives(self.choice.context(position), 0, j, max(self.k, 1))
            out["top_logprobs"].append({self._name(a): v for a, v in top})
        return out

    def llamacpp(self, start: int, pieces: Sequence[int]) -> dict[str, Any] | None:
        """llama.cpp's format, on both routes (chat's ``top_logprobs`` 0 still lists the
        tokens; a completion's ``n_probs`` 0 has no probabilities)."""
        if self.job.extras.logprobs is None or not (self.k or self.job.extras.chat_logprobs):
            return None
        content = []
        for position, j in enumerate(pieces, start):
            def entry(a: int, v: float) -> dict[str, Any]:
                t = self.vocab.openai_text(a)
                return {"id": self.vocab.id(a), "token": t, "bytes": list(t.encode()), "logprob": v}
            top = textgen.alternatives(self.choice.context(position), 0, j, self.k)
            content.append({**entry(j, textgen.logprob(self.choice.context(position), 0)),
                            "top_logprobs": [entry(a, v) for a, v in top]})
        return {"content": content}

    def chat(self, start: int, pieces: Sequence[int]) -> dict[str, Any]:
        content = []
        for position, j in enumerate(pieces, start):
            def entry(a: int, v: float) -> dict[str, Any]:
                t = self._name(a)
                return {"token": t, "logprob": v, "bytes": list(t.encode())}
            top = textgen.alternatives(self.choice.context(position), 0, j, self.k) if self.k else []
            content.append({**entry(j, textgen.logprob(self.choice.context(position), 0)),
                            "top_logprobs": [entry(a, v) for a, v in top]})
        return {"content": content}

    def of(self, start: int, pieces: Sequence[int], offset: int, chat: bool) -> Any:
        if self.job.extras.logprobs is None:
            return None
        if chat:
            return self.chat(start, pieces)
        return self.completion(start, pieces, offset)


def _prompt_logprobs(job: Job, vocab: Vocab) -> list[Any]:
    """vLLM ``prompt_logprobs``: per prompt token ``{id: {logprob, rank, decoded_token}}`` (and
    the top alternatives), none for the first."""
    seed = textgen.default_seed(job.prompt_ids) ^ 0x9E37
    out: list[Any] = [None]
    k = job.extras.prompt_logprobs or 0
    for i, token_id in enumerate(job.prompt_ids[1:], 1):
        entry = {str(token_id): {"logprob": textgen.logprob(seed, i), "rank": 1,
                                 "decoded_token": vocab.decode([token_id])}}
        for rank, (a, v) in enumerate(textgen.alternatives(seed, i, EOS, k + 1)[1:], 2):
            entry.setdefault(str(vocab.id(a)), {"logprob": v, "rank": rank, "decoded_token": vocab.openai_text(a)})
        out.append(entry)
    return out


def _echo_logprobs(job: Job, vocab: Vocab) -> dict[str, Any]:
    """The prompt's part of ``logprobs`` with ``echo``: its tokens, the first without a logprob."""
    seed = textgen.default_seed(job.prompt_ids) ^ 0x9E37
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = 0
    for i, token_id in enumerate(job.prompt_ids):
        t = f"token_id:{token_id}" if job.extras.tokens_as_ids else vocab.decode([token_id])
        lp = None if i == 0 else textgen.logprob(seed, i)
        out["text_offset"].append(offset)
        offset += len(vocab.decode([token_id]))
        out["token_logprobs"].append(lp)
        out["tokens"].append(t)
        out["top_logprobs"].append(None if lp is None else {t: lp})
    return out


def _plain(dialect: str, job: Job) -> bool:
    """Nothing beyond text: the pre-encoded template path."""
    x = job.extras
    return (x.logprobs is None and not x.token_ids and not x.echo and len(job.choices) == 1
            and not any(c.stop for c in job.choices))


class OpenAIStream:
    """The SSE events of one ``/v1/completions`` or ``/v1/chat/completions`` stream."""

    def __init__(self, dialect: str, chat: bool, model: str, job: Job, vocab: Vocab,
                 include_usage: bool, continuous_usage: bool, data_prefix: bytes = b"data: ",
                 interval: int = 1) -> None:
        self.dialect, self.chat, self.model, self.job, self.vocab = dialect, chat, model, job, vocab
        # vLLM's stream_interval: the first token in a chunk of its own, then a chunk every
        # `interval` tokens, and the rest with the last (vllm/v1/engine/output_processor.py)
        self.interval, self.held = interval, []
        self.prompt_tokens, self.n = job.prompt_tokens, job.max_new
        self.include_usage, self.continuous = include_usage, continuous_usage
        self.prefix = data_prefix
        self.choice = job.choices[0]
        self.id = request_id("chatcmpl-" if chat else "cmpl-")
        self.created = int(time.time())
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.plain = _plain(dialect, job) and interval == 1
        self.texts = openai_texts(self.choice, trim_stop=not job.extras.include_stop)
        self.logprobs = _Logprobs(dialect, job, vocab, job.choices[0])
        self.offset = len(job.extras.prompt_text) if job.extras.echo else 0
        # The plain path's two templates (holes: the text, and the usage when continuous):
        # every token's chunk, and the last one's (finish reason, and what ends the stream).
        self.parts = _split(self._chunk(_HOLE, None, self.n, None, _HOLE))
        self.last_parts = _split(self._chunk(_HOLE, None, self.n - 1, None, _HOLE))

    def _chunk(self, text: Any, logprobs: Any, k: int, token_ids: list[int] | None,
               usage_now: Any, first: int | None = None) -> dict[str, Any]:
        """The event of the tokens ``first .. k`` (one token, ``k``, unless ``first`` is
        given; ``usage_now``: the running usage, when continuous), in the engine's field
        order."""
        first = k if first is None else first
        last = k == self.n - 1
        vllm, ids = self.dialect == "vllm", self.job.extras.token_ids
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = _openai_finish(self.choice) if last else None
        stop = _stop_field(self.dialect, self.choice, self.vocab)
        if stop is not None and (last or not (vllm and self.chat)):  # vLLM chat: at the end only
            choice[stop[0]] = stop[1] if last else None
        if vllm and not self.chat:
            choice["prompt_token_ids"] = self.job.prompt_ids if ids and first == 0 else None
        elif ids and first == 0 and not vllm:  # vLLM chat: in the role chunk, not here
            choice["prompt_token_ids"] = self.job.prompt_ids
        if vllm or ids:
            choice["token_ids"] = token_ids if ids else None
        chunk: dict[str, Any] = {**self._head(), "choices": [choice]}
        if self.continuous:
            chunk["usage"] = usage_now
        elif self.dialect == "sglang":
            chunk["usage"] = None
        if vllm and last and not self.include_usage:  # vLLM: the fingerprint on the last chunk
            chunk["system_fingerprint"] = VLLM_FINGERPRINT
        return chunk

    def _usage(self, completion: int) -> bytes:
        return orjson.dumps(usage(self.prompt_tokens, completion))

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.obj, "created": self.created, "model": self.model}

    def open(self) -> bytes:
        """vLLM's first chat chunk carries the role and no token."""
        if not self.chat:
            return b""
        chunk: dict[str, Any] = {**self._head(), "choices": [{"index": 0, "delta": {"role": "assistant",
                                 "content": ""}, "logprobs": None, "finish_reason": None}]}
        if self.dialect == "vllm":
            chunk["prompt_token_ids"] = self.job.prompt_ids if self.job.extras.token_ids else None
            chunk["prompt_text"] = None
        if self.continuous:
            chunk["usage"] = usage(self.prompt_tokens, 0)
        return self.prefix + orjson.dumps(chunk) + b"\n\n"

    def tokens(self, start: int, pieces: Sequence[int]) -> bytes:
        """Events for tokens ``start .. start+len(pieces)-1`` (one event per token, or per
        group of ``interval``)."""
        if self.interval > 1:
            return b"".join(self._grouped(k, j) for k, j in enumerate(pieces, start))
        if not self.plain:
            return b"".join(self._rich(k, [j]) for k, j in enumerate(pieces, start))
        last = self.n - 1
        out = []
        for k, j in enumerate(pieces, start):
            parts = self.last_parts if k == last else self.parts
            if self.continuous:
                out.append(self.prefix + parts[0] + PIECES_JSON[j] + parts[1] + self._usage(k + 1) + parts[2] + b"\n\n")
            else:
                out.append(self.prefix + parts[0] + PIECES_JSON[j] + parts[1] + b"\n\n")
        return b"".join(out)

    def _grouped(self, k: int, j: int) -> bytes:
        """Token ``k`` held until its group is complete (as vLLM decides after each step)."""
        self.held.append(j)
        nothing_sent = k == len(self.held) - 1  # every token so far is held
        if len(self.held) < self.interval and not nothing_sent and k != self.n - 1:
            return b""
        group, self.held = self.held, []
        return self._rich(k - len(group) + 1, group)

    def _rich(self, first: int, pieces: list[int]) -> bytes:
        """One event for the tokens ``first ..`` (``pieces``), built as a dict."""
        k = first + len(pieces) - 1
        text = "".join(self.texts[first:k + 1])
        if first == 0 and self.job.extras.echo:
            text = self.job.extras.prompt_text + text
        logprobs = self.logprobs.of(first, pieces, self.offset, self.chat)
        self.offset += len(text)
        chunk = self._chunk(text, logprobs, k, [self.vocab.id(j) for j in pieces],
                            usage(self.prompt_tokens, k + 1), first)
        return self.prefix + orjson.dumps(chunk) + b"\n\n"

    def close(self, generated: int) -> bytes:
        if not self.include_usage:
            return self.prefix + b"[DONE]\n\n"
        chunk = {**self._head(), "choices": [], "usage": usage(self.prompt_tokens, generated)}
        if self.dialect == "vllm":
            chunk["system_fingerprint"] = VLLM_FINGERPRINT
        return self.prefix + orjson.dumps(chunk) + b"\n\n" + self.prefix + b"[DONE]\n\n"


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
        self.logprobs = _Logprobs("llamacpp", job, vocab, job.choices[0])
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
        finish = _openai_finish(self.choice)
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
    lp = _Logprobs("llamacpp", job, vocab, c).llamacpp(0, c.pieces)
    if chat:
        choice: dict[str, Any] = {"finish_reason": _openai_finish(c), "index": 0,
                                  "message": {"role": "assistant", "content": content}}
        if lp is not None:
            choice["logprobs"] = lp
    else:
        choice = {"text": content, "index": 0, "logprobs": lp, "finish_reason": _openai_finish(c)}
    generated = len(c.pieces)
    return orjson.dumps({"choices": [choice], "created": int(time.time()), "model": model,
                         "system_fingerprint": LLAMACPP_BUILD,
                         "object": "chat.completion" if chat else "text_completion",
                         "usage": llamacpp_usage(job.prompt_tokens, generated), "id": llamacpp_id(),
                         "timings": llamacpp_timings(job.prompt_tokens, generated)})


def openai_body(dialect: str, chat: bool, model: str, job: Job, vocab: Vocab,
                kv_transfer_params: dict[str, Any] | None = None) -> bytes:
    """A whole ``/v1/completions`` or ``/v1/chat/completions`` answer, every choice
    (``kv_transfer_params``: a disaggregated prefill's, vLLM)."""
    vllm = dialect == "vllm"
    choices = []
    for index, c in enumerate(job.choices):
        texts = openai_texts(c, trim_stop=not job.extras.include_stop)
        content = "".join(texts)
        logprobs = _Logprobs(dialect, job, vocab, c)
        lp = logprobs.of(0, c.pieces, 0, chat)
        stop = _stop_field(dialect, c, vocab)
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            message |= dict.fromkeys(_VLLM_MESSAGE_NULLS) if vllm else {"tool_calls": []}
            choice: dict[str, Any] = {"index": index, "message": message,
                                      "logprobs": lp, "finish_reason": _openai_finish(c)}
        else:
            if job.extras.echo:
                content = job.extras.prompt_text + content
                if isinstance(lp, dict) and "tokens" in lp:
                    prompt_part = _echo_logprobs(job, vocab)
                    shift = len(job.extras.prompt_text)
                    lp = {"text_offset": prompt_part["text_offset"] + [o + shift for o in lp["text_offset"]],
                          "token_logprobs": prompt_part["token_logprobs"] + lp["token_logprobs"],
                          "tokens": prompt_part["tokens"] + lp["tokens"],
                          "top_logprobs": prompt_part["top_logprobs"] + lp["top_logprobs"]}
            choice = {"index": index, "text": content, "logprobs": lp, "finish_reason": _openai_finish(c)}
        if stop is not None:
            choice[stop[0]] = stop[1]
        prompt_fields = {}
        if job.extras.token_ids or vllm:
            choice["token_ids"] = [vocab.id(j) for j in c.pieces] if job.extras.token_ids else None
        if job.extras.prompt_logprobs is not None or vllm:
            prompt_fields["prompt_logprobs"] = (_prompt_logprobs(job, vocab)
                                                if job.extras.prompt_logprobs is not None else None)
        if job.extras.token_ids or job.extras.prompt_logprobs is not None or vllm:
            prompt_fields["prompt_token_ids"] = (job.prompt_ids if job.extras.token_ids or
                                                 job.extras.prompt_logprobs is not None else None)
        if not (vllm and chat):  # vLLM chat: the prompt's fields are the answer's, not the choice's
            choice |= prompt_fields
        if vllm:
            choice["routed_experts"] = None
        choices.append(choice)
    rid, obj = (request_id("chatcmpl-"), "chat.completion") if chat else (request_id("cmpl-"), "text_completion")
    body: dict[str, Any] = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
                            "choices": choices}
    if not vllm:
        body["usage"] = usage(job.prompt_tokens, job.max_new)
        return orjson.dumps(body)
    body |= {"service_tier": None, "system_fingerprint": VLLM_FINGERPRINT,
             "usage": {**usage(job.prompt_tokens, job.max_new),
                       "prompt_tokens_details": None, "completion_tokens_details": None}}
    if chat:
        body |= {**prompt_fields, "prompt_text": None}
    body |= {"kv_transfer_params": kv_transfer_params, "ec_transfer_params": None,
             "metrics": None}
    return orjson.dumps(body)


class TGIStream:
    """``/generate_stream`` events: one per token; the last one carries ``generated_text``."""

    def __init__(self, job: Job, vocab: Vocab, input_length: bool = True,
                 data_prefix: bytes = b"data: ") -> None:
        self.job, self.vocab, self.input_length = job, vocab, input_length
        self.choice = job.choices[0]
        self.n = len(self.choice.pieces)
        self.prefix = data_prefix
        self.eos = orjson.dumps(_tgi_token(vocab, 0, EOS)["text"])

    def open(self) -> bytes:
        return b""

    def _token(self, k: int, j: int) -> bytes:
        special = b"true" if j == EOS else b"false"
        return b'{"id":%d,"text":%s,"logprob":%s,"special":%s}' % (
            self.vocab.id(j), self.eos if j == EOS else PIECES_JSON[j],
            orjson.dumps(textgen.logprob(self.choice.context(k), 0)), special)

    def tokens(self, start: int, pieces: Sequence[int]) -> bytes:
        out = []
        top_n = self.job.extras.top_n_tokens
        for k, j in enumerate(pieces, start):
            top = b""
            if top_n:
                key = self.choice.context(k)
                top = b',"top_tokens":' + orjson.dumps([_tgi_token(self.vocab, key, a, v)
                                                        for a, v in textgen.alternatives(key, 0, j, top_n)])
            if k < self.n - 1:
                out.append(b'%s{"index":%d,"token":%s%s,"generated_text":null,"details":null}\n\n'
                           % (self.prefix, k + 1, self._token(k, j), top))
            else:
                details = None
                if self.job.details:
                    details = {"finish_reason": _tgi_finish(self.choice), "generated_tokens": self.n,
                               "seed": self.job.reported_seed}
                    if self.input_length:
                        details["input_length"] = self.job.prompt_tokens
                out.append(b'%s{"index":%d,"token":%s%s,"generated_text":%s,"details":%s}\n\n'
                           % (self.prefix, k + 1, self._token(k, j), top,
                              orjson.dumps(_tgi_text(self.job, self.choice)), orjson.dumps(details)))
        return b"".join(out)

    def close(self, generated: int) -> bytes:
        return b""  # no [DONE] on /generate_stream


def _tgi_finish(choice: Choice) -> str:
    return {"length": "length", "eos": "eos_token", "stop": "stop_sequence"}[choice.finish]


def _tgi_text(job: Job, choice: Choice) -> str:
    """TGI's generated text: special tokens skipped, the stop sequence kept, and the prompt
    first with ``return_full_text``."""
    return (job.extras.prompt_text if job.extras.return_full_text else "") + text(choice.pieces)


def _tgi_token(vocab: Vocab, key: int, j: int, lp: float | None = None) -> dict[str, Any]:
    """One token of TGI's details (``key``: its context, ``Choice.context``)."""
    return {"id": vocab.id(j), "text": vocab.eos_text if j == EOS else PIECES[j],
            "logprob": textgen.logprob(key, 0) if lp is None else lp, "special": j == EOS}


def tgi_output(job: Job, vocab: Vocab) -> dict[str, Any]:
    """A ``/generate`` answer; with ``best_of`` the sequence of highest mean logprob wins."""
    scored = []
    for i, c in enumerate(job.choices):
        seed = job.seed + i
        tokens = [_tgi_token(vocab, c.context(k), j) for k, j in enumerate(c.pieces)]
        mean = sum(t["logprob"] for t in tokens) / max(len(tokens), 1)
        scored.append((mean, i, c, tokens, seed))
    scored.sort(key=lambda s: (-s[0], s[1]))
    _, _, best, tokens, seed = scored[0]
    out: dict[str, Any] = {"generated_text": _tgi_text(job, best)}
    if not job.details:
        return out

    def details(c: Choice, tokens: list[dict[str, Any]], seed: int) -> dict[str, Any]:
        d: dict[str, Any] = {"finish_reason": _tgi_finish(c), "generated_tokens": len(c.pieces),
                             "seed": job.reported_seed if len(job.choices) == 1 else seed,
                             "prefill": _prefill(job, vocab) if job.extras.decoder_input_details else [],
                             "tokens": tokens}
        return d

    out["details"] = details(best, tokens, seed)
    if len(scored) > 1:
        out["details"]["best_of_sequences"] = [{"generated_text": _tgi_text(job, c), **details(c, t, s)}
                                               for _, _, c, t, s in scored[1:]]
    if job.extras.top_n_tokens:
        out["details"]["top_tokens"] = [
            [_tgi_token(vocab, best.context(k), a, v)
             for a, v in textgen.alternatives(best.context(k), 0, j, job.extras.top_n_tokens)]
            for k, j in enumerate(best.pieces)]
    return out


def _prefill(job: Job, vocab: Vocab) -> list[dict[str, Any]]:
    """TGI's ``prefill``: the prompt's tokens, each with its logprob (the first has none)."""
    seed = textgen.default_seed(job.prompt_ids) ^ 0x9E37
    return [{"id": t, "text": vocab.decode([t]), "logprob": None if i == 0 else textgen.logprob(seed, i)}
            for i, t in enumerate(job.prompt_ids)]
