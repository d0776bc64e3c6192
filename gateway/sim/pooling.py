"""vLLM's pooling routes on a simulated replica started as a pooling engine (``--runner
pooling``, as vLLM's ``--runner pooling --convert embed``): ``/v1/embeddings``,
``/pooling``, ``/classify``, ``/score`` and ``/v1/score``, ``/rerank`` and ``/v1/rerank``,
in vLLM's answer shapes, with vectors and scores drawn from the token ids (the same input
gives the same answer on every replica). A prompt past the window is vLLM's 400.
"""

from __future__ import annotations

import math
import time
import zlib
from typing import Any, Callable

from gateway.sim.dialects import ClientError
from gateway.tokens import ModelTokenizer

DIMENSIONS = 16


def _vector(ids: list[int]) -> list[float]:
    seed = zlib.crc32(repr(ids).encode())
    raw = [math.sin(seed * (i + 1) * 0.001) for i in range(DIMENSIONS)]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [v / norm for v in raw]


def _score(ids: list[int]) -> float:
    return (zlib.crc32(repr(ids).encode()) % 10000) / 10000


class PoolingRoutes:
    def __init__(self, model: str, max_model_len: int, tokenizer: ModelTokenizer) -> None:
        self.model, self.max_model_len, self.tokenizer = model, max_model_len, tokenizer
        self.routes: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "/v1/embeddings": self.embeddings, "/pooling": self.pooling,
            "/classify": self.classify, "/score": self.score, "/v1/score": self.score,
            "/rerank": self.rerank, "/v1/rerank": self.rerank}

    def _ids(self, text: Any) -> list[int]:
        if isinstance(text, list) and all(isinstance(t, int) for t in text):
            ids = text
        elif isinstance(text, str):
            ids = self.tokenizer.encode(text, add_special_tokens=True)
        else:
            raise ClientError("1 validation error:\n  {'loc': ('body', 'input'), 'msg': "
                              "'Input should be a valid string'}", "schema", "input")
        if len(ids) > self.max_model_len:
            raise ClientError(f"This model's maximum context length is {self.max_model_len} "
                              f"tokens. However, you requested {len(ids)} tokens in the input "
                              f"for embedding generation. Please reduce the length of the "
                              f"input.", "context", "input_tokens")
        return ids

    def _inputs(self, body: dict[str, Any]) -> list[list[int]]:
        value = body.get("input")
        if isinstance(value, str) or (isinstance(value, list) and value
                                      and all(isinstance(t, int) for t in value)):
            return [self._ids(value)]
        if isinstance(value, list) and value:
            return [self._ids(v) for v in value]
        raise ClientError("1 validation error:\n  {'loc': ('body', 'input'), 'msg': 'Field "
                          "required'}", "schema", "input")

    def _head(self, kind: str, body: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
        return {"id": f"{kind}-{time.monotonic_ns():x}", "object": "list",
                "created": int(time.time()), "model": body.get("model") or self.model,
                "data": [], "usage": {"prompt_tokens": prompt_tokens,
                                      "total_tokens": prompt_tokens, "completion_tokens": 0,
                                      "prompt_tokens_details": None}}

    def _vectors(self, body: dict[str, Any], kind: str, obj: str, key: str) -> dict[str, Any]:
        inputs = self._inputs(body)
        out = self._head(kind, body, sum(map(len, inputs)))
        out["data"] = [{"index": i, "object": obj, key: _vector(ids)}
                       for i, ids in enumerate(inputs)]
        return out

    def embeddings(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._vectors(body, "embd", "embedding", "embedding")

    def pooling(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._vectors(body, "pool", "pooling", "data")

    def classify(self, body: dict[str, Any]) -> dict[str, Any]:
        inputs = self._inputs(body)
        out = self._head("classify", body, sum(map(len, inputs)))
        for i, ids in enumerate(inputs):
            p = _score(ids)
            out["data"].append({"index": i, "label": "LABEL_1" if p >= 0.5 else "LABEL_0",
                                "probs": [1 - p, p], "num_classes": 2})
        return out

    def _pairs(self, first: list[str], second: list[str]) -> list[list[int]]:
        if len(first) == 1:
            first = first * len(second)
        return [self._ids(a + b) for a, b in zip(first, second)]

    def score(self, body: dict[str, Any]) -> dict[str, Any]:
        first, second = body.get("text_1"), body.get("text_2")
        first = [first] if isinstance(first, str) else first
        second = [second] if isinstance(second, str) else second
        if not isinstance(first, list) or not isinstance(second, list):
            raise ClientError("1 validation error:\n  {'loc': ('body', 'text_1'), 'msg': "
                              "'Field required'}", "schema", "text_1")
        pairs = self._pairs(first, second)
        out = self._head("score", body, sum(map(len, pairs)))
        out["data"] = [{"index": i, "object": "score", "score": _score(ids)}
                       for i, ids in enumerate(pairs)]
        return out

    def rerank(self, body: dict[str, Any]) -> dict[str, Any]:
        query, documents = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(documents, list):
            raise ClientError("1 validation error:\n  {'loc': ('body', 'query'), 'msg': "
                              "'Field required'}", "schema", "query")
        texts = [d if isinstance(d, str) else str(d.get("text", "")) for d in documents]
        pairs = self._pairs([query], texts)
        results = sorted(({"index": i, "document": {"text": texts[i]},
                           "relevance_score": _score(ids)} for i, ids in enumerate(pairs)),
                         key=lambda r: -r["relevance_score"])
        top_n = body.get("top_n")
        if isinstance(top_n, int) and top_n > 0:
            results = results[:top_n]
        return {"id": f"rerank-{time.monotonic_ns():x}", "model": body.get("model") or self.model,
                "usage": {"total_tokens": sum(map(len, pairs))}, "results": results}
