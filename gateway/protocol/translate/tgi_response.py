"""TGI answers rebuilt from an OpenAI engine's ``/v1/completions`` output (TGI client on a
vLLM, SGLang, llama.cpp or OpenAI-compatible replica).

Stream: one TGI token event per generated token (id, text, logprob, special; ``top_tokens``
with ``top_n_tokens``), the last one carrying ``generated_text`` and ``details``. The engine
says which chunk ends the generation (``finish_reason``) and, in a later chunk, its usage, so
the last token event waits for the usage only when ``details`` need it. llama.cpp marks the
end in a chunk of its own, after the last token: a token that may be the last (the
``max_new_tokens``-th, or an empty one: end of sequence) waits for the next chunk.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from gateway.engines import Engine
from gateway.protocol.translate.sse import ChunkReader, payloads
from gateway.protocol.translate.tgi_request import TgiParameters, mean_logprob
from gateway.protocol.translate.generated_tokens import (Token, TokenTexts, choice_tokens, mark_eos,
                                               merged_tokens)
from gateway.protocol.usage import Usage

DATA = b"data: "


def finish_reason(choice: dict[str, Any], stop_reason_key: str) -> str:
    """OpenAI ``finish_reason`` -> TGI's: ``stop`` is ``stop_sequence`` when the engine names
    the stop string that matched (``Engine.stop_reason_key``: vLLM ``stop_reason``, SGLang
    ``matched_stop``), else the end-of-sequence token."""
    reason = choice.get("finish_reason")
    if reason == "length":
        return "length"
    matched = choice.get(stop_reason_key)
    return "stop_sequence" if isinstance(matched, str) else "eos_token"


def _error_event(message: str, error_type: str = "generation") -> bytes:
    return DATA + orjson.dumps({"error": message, "error_type": error_type}) + b"\n\n"


class TgiStream(ChunkReader):
    """Reads an OpenAI engine's completion stream, writes TGI ``/generate_stream`` events.

    The relay's stream loop drives it like its same-dialect reader: ``feed`` returns the bytes
    for the client and the number of tokens the engine generated in that read.
    """

    def __init__(self, params: TgiParameters, engine: Engine, max_tokens: int,
                 texts: TokenTexts | None, seed: int | None) -> None:
        self.params = params
        # What the engine's chunks look like, read once here rather than per token.
        self.content_logprobs = engine.content_logprobs
        self.stop_reason_key = engine.stop_reason_key
        self.max_tokens = max_tokens
        self.texts = texts
        self.seed = seed
        super().__init__()
        self.index = 0         # token events written (TGI's 1-based index of the next is +1)
        self.text: list[str] = []
        self.held: Token | None = None  # a token that may be the last one
        self.finish: str | None = None
        self.decoded = 0  # tokens the engine counted so far (llama.cpp)
        # The last tokens ended inside a character whose bytes never came: the engine drops
        # them from its stream, a whole decode shows them as U+FFFD (TGI's generated_text,
        # llama.cpp's own non-streamed text), so the final text ends with one.
        self.broken_tail = False

    def _done(self, out: list[bytes]) -> None:
        out.append(self._close())

    def _after_end(self, chunk: dict[str, Any]) -> None:
        self._read_usage(chunk)  # after the final event: only the usage still counts

    def _error_event(self, message: str) -> bytes:
        return _error_event(message)

    def _chunk(self, chunk: dict[str, Any], out: list[bytes]) -> int:
        if "usage" in chunk:
            self._read_usage(chunk)
        generated = self._generated_in(chunk)
        reported = 0
        for choice in chunk.get("choices") or ():
            reported += self._choice(choice, out, generated)
        if generated is None:  # a chunk the engine did not count: its tokens are counted
            self.decoded += reported
        if self.finish is not None and self.held is not None and (
                not self.params.details or self.usage.completion_tokens is not None):
            out.append(self._final())
        return reported

    def _read_usage(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = Usage(usage.get("prompt_tokens"), usage.get("completion_tokens"),
                               self.usage.finish_reason)

    def _generated_in(self, chunk: dict[str, Any]) -> int | None:
        """Tokens generated since the last chunk, where the engine counts them (llama.cpp's
        ``timings.predicted_n`` with ``timings_per_token``)."""
        timings = chunk.get("timings")
        if not isinstance(timings, dict) or not isinstance(timings.get("predicted_n"), int):
            return None
        generated, self.decoded = timings["predicted_n"] - self.decoded, timings["predicted_n"]
        return generated

    def _choice(self, choice: dict[str, Any], out: list[bytes], generated: int | None) -> int:
        self.text.append(choice.get("text") or "")
        reason = choice.get("finish_reason")
        tokens = choice_tokens(choice, self.content_logprobs, self.params.top_n_tokens,
                               self.texts)
        if generated is not None and generated > len(tokens):
            # Tokens counted but not reported: those ending inside a character, merged into
            # the chunk that completes it, and a last one whose character never completes,
            # counted only in the finishing chunk (no text, no logprobs).
            self.broken_tail = not tokens
            tokens = merged_tokens(generated - len(tokens), self.params.top_n_tokens) + tokens
        elif tokens:
            self.broken_tail = False
        if reason is not None:
            self.finish = self.usage.finish_reason = finish_reason(choice, self.stop_reason_key)
            mark_eos(tokens, self.finish == "eos_token", self.texts)
        for token in tokens:
            if self.held is not None:
                out.append(self._event(self.held))
            self.held = token
        if self.held is not None and self.finish is None and not self._may_be_last(self.held):
            out.append(self._event(self.held))
            self.held = None
        return len(tokens)

    def _may_be_last(self, token: Token) -> bool:
        return self.index + 1 >= self.max_tokens or token.text == ""

    def _event(self, token: Token, final: bytes | None = None) -> bytes:
        self.index += 1
        event = b'{"index":%d,"token":{"id":%d,"text":%s,"logprob":%s,"special":%s}' % (
            self.index, token.id, orjson.dumps(token.text), orjson.dumps(token.logprob),
            b"true" if token.special else b"false")
        if token.top:
            event += b',"top_tokens":' + orjson.dumps([t.tgi() for t in token.top])
        return DATA + event + (final or b',"generated_text":null,"details":null}') + b"\n\n"

    def _final(self) -> bytes:
        token, self.held = self.held, None
        assert token is not None and self.finish is not None
        if self.finish == "eos_token" and self.texts is None and token.text == "":
            token.special = True
        text = "".join(self.text) + ("\ufffd" if self.broken_tail else "")
        if self.params.return_full_text:
            text = self.params.inputs + text
        details = None
        if self.params.details:
            details = {"finish_reason": self.finish,
                       "generated_tokens": self.usage.completion_tokens or self.index + 1,
                       "seed": self.seed, "input_length": self.usage.prompt_tokens}
        self.finished = True
        return self._event(token, b',"generated_text":%s,"details":%s}' % (
            orjson.dumps(text), orjson.dumps(details)))

    def _owed_tokens(self) -> bytes:
        """The engine counted more tokens than it reported, without saying in which chunk (no
        ``timings``): the missing ones end the sequence, their character never completed, as
        merged tokens do; the last waits to be the final event's token."""
        counted = self.usage.completion_tokens
        if self.held is not None or counted is None or counted <= self.index:
            return b""
        out, self.broken_tail = [], True
        for token in merged_tokens(counted - self.index, self.params.top_n_tokens):
            if self.held is not None:
                out.append(self._event(self.held))
            self.held = token
        return b"".join(out)

    def _close(self) -> bytes:
        """``[DONE]``: the generation is complete (a final event still waiting goes now)."""
        if self.finish is not None:
            owed = self._owed_tokens()
            if self.held is not None:
                return owed + self._final()
        self.finished = True
        return _error_event("the engine ended the stream without marking its last token",
                            "incomplete_generation")


def tgi_body(params: TgiParameters, engine: Engine, response: dict[str, Any],
             texts: TokenTexts | None, seed: int | None, compat: bool) -> tuple[bytes, Usage]:
    """A ``/generate`` answer (``POST /``: a list of one) from a ``/v1/completions`` body."""
    choices = [c for c in response.get("choices") or [] if isinstance(c, dict)]
    if not choices:
        raise ValueError("no choice in the engine's answer")
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}
    counted = Usage(usage.get("prompt_tokens"), usage.get("completion_tokens"))
    top_n = params.top_n_tokens
    sequences = []
    for choice in choices:
        if texts is not None:
            texts.ids = []
        tokens = choice_tokens(choice, engine.content_logprobs, top_n, texts)
        reason = finish_reason(choice, engine.stop_reason_key)
        mark_eos(tokens, reason == "eos_token", texts)
        sequences.append((choice, tokens, reason))
    if len(sequences) > 1:  # best_of: the sequence of highest mean logprob, as TGI picks
        sequences.sort(key=lambda s: -mean_logprob([t.logprob for t in s[1]]))
    choice, tokens, reason = sequences[0]
    counted.finish_reason = reason
    prefix = params.inputs if params.return_full_text else ""
    out: dict[str, Any] = {"generated_text": prefix + (choice.get("text") or "")}
    if params.details or params.decoder_input_details:
        prefill = _prefill(choice, texts) if params.decoder_input_details else []

        def details(tokens: list[Token], reason: str, generated: int,
                    others: list[dict[str, Any]] | None = None) -> dict[str, Any]:
            entry: dict[str, Any] = {"finish_reason": reason, "generated_tokens": generated,
                                     "seed": seed, "prefill": prefill,
                                     "tokens": [t.tgi() for t in tokens]}
            if others is not None:
                entry["best_of_sequences"] = others
            if top_n:
                entry["top_tokens"] = [[c.tgi() for c in t.top or []] for t in tokens]
            return entry

        others = None
        if len(sequences) > 1:
            others = [{"generated_text": prefix + (c.get("text") or ""), **details(t, r, len(t))}
                      for c, t, r in sequences[1:]]
        generated = (counted.completion_tokens if len(choices) == 1
                     and counted.completion_tokens is not None else len(tokens))
        out["details"] = details(tokens, reason, generated, others)
    return orjson.dumps([out] if compat else out), counted


def tgi_body_from_stream(params: TgiParameters, engine: Engine, max_tokens: int, content: bytes,
                         texts: TokenTexts | None, seed: int | None,
                         compat: bool) -> tuple[bytes, Usage]:
    """A ``/generate`` answer from the engine's whole stream (llama.cpp: see ``openai_body``):
    the stream's own TGI events, gathered. The tokens are the events' tokens, so both ways
    of asking give the same tokens."""
    reader = TgiStream(replace(params, details=True), engine, max_tokens, texts, seed)
    events = reader.feed(content)[0] + reader.pending
    tokens, final = [], None
    for payload in payloads(events):
        event = orjson.loads(payload)
        if "error" in event:
            raise ValueError(f"the engine's stream failed: {event['error']}")
        entry = event["token"]
        if event.get("top_tokens") is not None:
            entry = {**entry, "top_tokens": event["top_tokens"]}
        tokens.append(entry)
        if event.get("generated_text") is not None:
            final = event
    if final is None:
        raise ValueError("the engine's stream ended without its last token")
    out: dict[str, Any] = {"generated_text": final["generated_text"]}
    if params.details:
        details = {**final["details"], "prefill": []}
        details.pop("input_length", None)
        details["tokens"] = [{k: v for k, v in t.items() if k != "top_tokens"} for t in tokens]
        if params.top_n_tokens:
            details["top_tokens"] = [t.get("top_tokens") or [] for t in tokens]
        out["details"] = details
    return orjson.dumps([out] if compat else out), reader.usage


def _prefill(choice: dict[str, Any], texts: TokenTexts | None) -> list[dict[str, Any]]:
    """vLLM ``prompt_logprobs`` (+ ``prompt_token_ids``) -> TGI ``prefill``: each prompt
    token with its logprob; the first has none."""
    ids = choice.get("prompt_token_ids") or []
    entries = choice.get("prompt_logprobs") or []
    out = []
    for i, token_id in enumerate(ids):
        entry = entries[i] if i < len(entries) else None
        logprob, text = None, None
        if isinstance(entry, dict):
            info = entry.get(str(token_id))
            if isinstance(info, dict):
                logprob, text = info.get("logprob"), info.get("decoded_token")
        if text is None:
            text = texts.one(token_id) if texts is not None else ""
        out.append({"id": token_id, "text": text, "logprob": logprob})
    return out
