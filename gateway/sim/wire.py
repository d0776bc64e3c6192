"""Response bodies and SSE events of OpenAI-style generation routes (vLLM, SGLang), and what
every dialect's shares (the vocabulary, logprobs, texts); llama.cpp's own are in
``wire_llamacpp``, TGI's in ``wire_tgi``.

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
from gateway.sim.textgen import EOS, PIECES, PIECES_JSON

_HOLE = "\x00"
_HOLE_JSON = b'"\\u0000"'
DONE = b"data: [DONE]\n\n"
VLLM_VERSION = "0.32.0"  # the answers' shapes are this version's (checked against it: tests/real_engines)
VLLM_FINGERPRINT = f"vllm-{VLLM_VERSION}-5171a7ed"
# vLLM's chat message beside role and content (no tool_calls when there are none)
_VLLM_MESSAGE_NULLS = ("refusal", "annotations", "audio", "function_call", "reasoning")


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


def openai_finish(choice: Choice) -> str:
    return "length" if choice.finish == "length" else "stop"


class Logprobs:
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
        self.logprobs = Logprobs(dialect, job, vocab, job.choices[0])
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
        choice["finish_reason"] = openai_finish(self.choice) if last else None
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


def openai_body(dialect: str, chat: bool, model: str, job: Job, vocab: Vocab,
                kv_transfer_params: dict[str, Any] | None = None) -> bytes:
    """A whole ``/v1/completions`` or ``/v1/chat/completions`` answer, every choice
    (``kv_transfer_params``: a disaggregated prefill's, vLLM)."""
    vllm = dialect == "vllm"
    choices = []
    for index, c in enumerate(job.choices):
        texts = openai_texts(c, trim_stop=not job.extras.include_stop)
        content = "".join(texts)
        logprobs = Logprobs(dialect, job, vocab, c)
        lp = logprobs.of(0, c.pieces, 0, chat)
        stop = _stop_field(dialect, c, vocab)
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            message |= dict.fromkeys(_VLLM_MESSAGE_NULLS) if vllm else {"tool_calls": []}
            choice: dict[str, Any] = {"index": index, "message": message,
                                      "logprobs": lp, "finish_reason": openai_finish(c)}
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
            choice = {"index": index, "text": content, "logprobs": lp, "finish_reason": openai_finish(c)}
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
