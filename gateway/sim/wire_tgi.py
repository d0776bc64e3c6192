"""TGI's answers: ``/generate_stream`` events (one per token, the last with
``generated_text``) and ``/generate``'s body (details, ``prefill``, ``best_of_sequences``)."""

from __future__ import annotations

from typing import Any, Sequence

import orjson

from gateway.sim import textgen
from gateway.sim.parse import Choice, Job
from gateway.sim.textgen import EOS, PIECES, PIECES_JSON, text
from gateway.sim.wire import Vocab


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
