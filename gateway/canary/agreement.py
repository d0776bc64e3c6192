"""Output agreement of shadowed pairs, measured as they end: did the canary say what the
baseline said? (Judged as a verdict's metric in gateway/canary/agreement_metric.py.)

Each side's generated text is read from the bytes its client would get (the primary's are
the bytes the client does get), only for requests that have a shadow: ``TextCollector``
parses OpenAI and TGI bodies and SSE events. A ``Pair`` holds the two texts until both sides
have ended, compares them (exact match, common prefix, and for greedy requests whether they
agree: a greedy disagreement means numerics, tokenizer or chat template differ), counts the
result and lets the texts go. Memory is bounded: each side keeps at most ``max_chars``
characters (a longer pair is dropped and counted), a pair lives only while its requests do,
and the disagreements kept for ``GET /admin/canary/{model}/disagreements`` are a ring.
A copy never sent (no free shadow slot, or its pool refused it) is counted as skipped, so
compared + dropped + skipped is every primary offered a copy.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from typing import Any

import orjson

from gateway.canary.samples import PairSample, SampleBook
from gateway.canary.metrics import CanaryMetrics
from gateway.protocol.errors import Api
from gateway.protocol.request import GenerationRequest

SHOWN_CHARS = 500  # of each output, in a kept disagreement


def is_greedy(request: GenerationRequest) -> bool:
    """Temperature 0 (OpenAI), or no sampling and no logits warper (TGI's rule)."""
    body = request.body
    if request.api is not Api.TGI:
        temperature = body.get("temperature")
        return isinstance(temperature, (int, float)) and temperature == 0
    p = body.get("parameters")
    p = p if isinstance(p, dict) else {}
    number = lambda name: p.get(name) if isinstance(p.get(name), (int, float)) else None  # noqa: E731
    temperature, top_p, typical_p = number("temperature"), number("top_p"), number("typical_p")
    return not (p.get("do_sample") is True or (temperature is not None and temperature != 1.0)
                or bool(number("top_k")) or (top_p is not None and top_p < 1.0)
                or (typical_p is not None and typical_p < 1.0))


def prompt_hash(request: GenerationRequest) -> str:
    """Names the prompt without showing it (first 16 hex digits of its SHA-256)."""
    prompt = request.messages if request.messages is not None else request.prompt
    data = orjson.dumps(prompt) if prompt is not None else request.raw
    return hashlib.sha256(data).hexdigest()[:16]


class TextCollector:
    """The generated text of one side, from its client-protocol body or stream bytes."""

    __slots__ = ("api", "max_chars", "parts", "chars", "too_long", "failed", "_pending",
                 "_final")

    def __init__(self, api: Api, max_chars: int) -> None:
        self.api = api
        self.max_chars = max_chars
        self.parts: dict[int, list[str]] = {}  # choice index -> pieces
        self.chars = 0
        self.too_long = False
        self.failed = False
        self._pending = b""
        self._final: str | None = None  # TGI's generated_text: the whole text, authoritative

    @property
    def text(self) -> str:
        if self._final is not None:
            return self._final
        return "\x1e".join("".join(self.parts[i]) for i in sorted(self.parts))

    def _add(self, index: int, piece: Any) -> None:
        if not isinstance(piece, str) or not piece or self.too_long:
            return
        self.chars += len(piece)
        if self.chars > self.max_chars:
            self.too_long, self.parts = True, {}
            return
        self.parts.setdefault(index if isinstance(index, int) else 0, []).append(piece)

    def _set_final(self, text: Any) -> None:
        if isinstance(text, str) and not self.too_long:
            if len(text) > self.max_chars:
                self.too_long, self.parts = True, {}
            else:
                self._final = text

    def body(self, body: bytes) -> None:
        """A whole (non-streamed) answer."""
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            self.failed = True
            return
        if self.api is Api.TGI:
            if isinstance(payload, list) and payload:  # TGI's POST / answers a list
                payload = payload[0]
            if isinstance(payload, dict) and "generated_text" in payload:
                self._set_final(payload["generated_text"])
            else:
                self.failed = True
            return
        if self.api is Api.ANTHROPIC:
            blocks = payload.get("content") if isinstance(payload, dict) else None
            if not isinstance(blocks, list):
                self.failed = True
                return
            for block in blocks:
                if isinstance(block, dict) and block.get("type") == "text":
                    self._add(0, block.get("text"))
            return
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list):
            self.failed = True
            return
        for choice in choices:
            if isinstance(choice, dict):
                message = choice.get("message")
                text = message.get("content") if isinstance(message, dict) else choice.get("text")
                self._add(choice.get("index", 0), text)

    def feed(self, chunk: bytes) -> None:
        """Stream bytes as sent to the client (whole SSE events, or pieces of them)."""
        data = self._pending + chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._pending = data[-65536:]  # an event is never that long; bounded anyway
            return
        self._pending = data[cut + 2:]
        for event in data[:cut].split(b"\n\n"):
            payload = event.partition(b"data:")[2].strip()
            if not payload.startswith(b"{"):
                continue  # [DONE], comments, keep-alives
            try:
                parsed = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if isinstance(parsed, dict):
                self._event(parsed)

    def _event(self, event: dict[str, Any]) -> None:
        if "error" in event:
            self.failed = True
            return
        if self.api is Api.ANTHROPIC:
            delta = event.get("delta")
            if event.get("type") == "content_block_delta" and isinstance(delta, dict):
                self._add(0, delta.get("text"))
            return
        if self.api is Api.TGI:
            if event.get("generated_text") is not None:
                self._set_final(event["generated_text"])
                return
            token = event.get("token")
            if isinstance(token, dict) and not token.get("special"):
                self._add(0, token.get("text"))
            return
        for choice in event.get("choices") or ():
            if isinstance(choice, dict):
                delta = choice.get("delta")
                text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                self._add(choice.get("index", 0), text)


class Pair:
    """One primary request and its shadow copy; compared when both have ended."""

    __slots__ = ("agreement", "model", "pool", "baseline", "request", "greedy", "primary",
                 "shadow", "skipped", "_open", "_primary_ok", "_shadow_ok")

    def __init__(self, agreement: "Agreement", model: str, pool: str, baseline: str,
                 request: GenerationRequest, primary: TextCollector) -> None:
        self.agreement = agreement
        self.model, self.pool, self.baseline = model, pool, baseline
        self.request = request
        self.greedy = is_greedy(request)
        self.primary = primary  # shared by every shadow pool of the request
        self.shadow = TextCollector(request.api, agreement.max_chars)
        self.skipped = False
        self._open = 2
        self._primary_ok = self._shadow_ok = False

    def skip(self, reason: str) -> None:
        """The copy was not sent: the pair counts as skipped (at once), not as dropped."""
        self.skipped = True
        self.agreement.skipped(self.model, self.pool, reason, self.greedy)

    def primary_done(self, ok: bool) -> None:
        self._primary_ok = ok and not self.primary.failed
        self._end()

    def shadow_done(self, ok: bool) -> None:
        self._shadow_ok = ok and not self.shadow.failed
        self._end()

    def _end(self) -> None:
        self._open -= 1
        if self._open == 0:
            if not self.skipped:
                self.agreement.judge(self)
            self.request = None  # type: ignore[assignment]  # the texts and body go now
            self.primary = self.shadow = None  # type: ignore[assignment]


class Agreement:
    """Pairs of one gateway: counts, and the last disagreements per model."""

    def __init__(self, metrics: CanaryMetrics, max_chars: int, kept: int,
                 samples: SampleBook | None = None, prefix_chars: int = 64) -> None:
        self.metrics = metrics
        self.max_chars = max_chars
        self.kept = kept
        self.samples = samples  # each pair's result, for the verdict's agreement metrics
        self.prefix_chars = prefix_chars
        self.disagreements: dict[str, deque[dict[str, Any]]] = {}
        self.counts: dict[tuple[str, str], dict[str, int]] = {}  # (model, pool) -> result -> n

    def collector(self, api: Api) -> TextCollector:
        return TextCollector(api, self.max_chars)

    def pair(self, model: str, pool: str, baseline: str, request: GenerationRequest,
             primary: TextCollector) -> Pair:
        return Pair(self, model, pool, baseline, request, primary)

    def _count(self, model: str, pool: str, result: str) -> None:
        counts = self.counts.setdefault((model, pool), {})
        counts[result] = counts.get(result, 0) + 1

    def skipped(self, model: str, pool: str, reason: str, greedy: bool) -> None:
        """A primary's copy to ``pool`` not sent (``reason``: in_flight_limit, no_slot,
        rejected): counted in /metrics, the disagreements view and the verdict's pairs."""
        self.metrics.shadow_skipped.labels(model, pool, reason).inc()
        self._count(model, pool, f"skipped_{reason}")
        if self.samples is not None:
            self.samples.paired(model, pool,
                                PairSample(time.time(), greedy, False, False, False, True))

    def judge(self, pair: Pair) -> None:
        if not pair._primary_ok or not pair._shadow_ok:
            reason = "primary_failed" if not pair._primary_ok else "shadow_failed"
        elif pair.primary.too_long or pair.shadow.too_long:
            reason = "too_long"
        else:
            reason = None
        if reason is not None:
            self.metrics.pairs_dropped.labels(pair.model, pair.pool, reason).inc()
            self._count(pair.model, pair.pool, f"dropped_{reason}")
            if self.samples is not None:
                self.samples.paired(pair.model, pair.pool,
                                    PairSample(time.time(), pair.greedy, False, False, False))
            return
        a, b = pair.primary.text, pair.shadow.text
        agreed = a == b
        prefix = len(os.path.commonprefix([a, b]))
        prefix_agreed = prefix >= min(self.prefix_chars, max(len(a), len(b)))
        result = "agreed" if agreed else "disagreed"
        greedy = "true" if pair.greedy else "false"
        self.metrics.pairs.labels(pair.model, pair.pool, greedy, result).inc()
        if prefix_agreed:
            self.metrics.prefix_agreed.labels(pair.model, pair.pool, greedy).inc()
        if self.samples is not None:
            self.samples.paired(pair.model, pair.pool,
                                PairSample(time.time(), pair.greedy, True, agreed, prefix_agreed))
        self.metrics.common_prefix.labels(pair.model, pair.pool).observe(
            prefix / max(len(a), len(b)) if a or b else 1.0)
        self._count(pair.model, pair.pool, result)
        if pair.greedy:
            self._count(pair.model, pair.pool, f"greedy_{result}")
        if not agreed and self.kept:
            ring = self.disagreements.setdefault(pair.model, deque(maxlen=self.kept))
            ring.append({"at": time.time(), "baseline_pool": pair.baseline,
                         "shadow_pool": pair.pool, "prompt_sha256": prompt_hash(pair.request),
                         "greedy": pair.greedy, "common_prefix_chars": prefix,
                         "primary_chars": len(a), "shadow_chars": len(b),
                         "primary": a[:SHOWN_CHARS], "shadow": b[:SHOWN_CHARS]})

    def report(self, model: str) -> dict[str, Any]:
        """What ``GET /admin/canary/{model}/disagreements`` shows: per shadow pool, the pairs
        compared, agreed, dropped and skipped (copies not sent); then the last disagreements,
        newest first."""
        pools = {}
        for (name, pool), counts in self.counts.items():
            if name != model:
                continue
            compared = counts.get("agreed", 0) + counts.get("disagreed", 0)
            greedy = counts.get("greedy_agreed", 0) + counts.get("greedy_disagreed", 0)
            pools[pool] = {"compared": compared, "agreed": counts.get("agreed", 0),
                           "agreement": counts.get("agreed", 0) / compared if compared else None,
                           "greedy_compared": greedy,
                           "greedy_agreed": counts.get("greedy_agreed", 0),
                           "dropped": _by_reason(counts, "dropped_"),
                           "skipped": _by_reason(counts, "skipped_")}
        return {"model": model, "pools": pools,
                "disagreements": list(reversed(self.disagreements.get(model, ())))}


def _by_reason(counts: dict[str, int], prefix: str) -> dict[str, int]:
    return {k.removeprefix(prefix): v for k, v in counts.items() if k.startswith(prefix)}
