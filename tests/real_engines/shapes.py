"""The shape of an engine's answers, values aside: what keeps the simulators honest.

The simulators (``llm-gateway sim``) stand in for the engines wherever a CPU engine cannot
(many GPUs, timing, faults), so they must answer in the engines' exact shapes. Here the same
requests go to a real engine and to the simulator of its dialect, and each answer is reduced
to its shape: every key in the engine's order, each value's JSON type, and the few values
that are part of the contract (``object``, ``role``, an error's ``type`` and ``param``).
Stream events are grouped by their place in the stream (first, middle, the one with
``finish_reason``, usage, the end).
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

# What both engines take: the requests whose answers' shapes are compared.
SHAPE_REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "completion": ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 6}),
    "completion stream+usage": ("/v1/completions", {
        "prompt": "The quick brown fox", "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}}),
    "completion logprobs": ("/v1/completions", {
        "prompt": "The quick brown fox", "max_tokens": 6, "logprobs": 2}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                      "max_tokens": 6}),
    "chat stream+usage": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}}),
    "chat stream logprobs": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "stream": True,
        "logprobs": True, "top_logprobs": 2}),
    "prompt too long": ("/v1/completions", {"prompt": "word " * 1100, "max_tokens": 6}),  # any window here
}

# Values that are part of the contract rather than data.
LITERAL_KEYS = frozenset({"object", "role", "type", "param"})
# Objects keyed by data (a token's text or id) under these keys: only their values have a shape.
MAP_KEYS = frozenset({"top_logprobs", "prompt_logprobs"})


def shape(value: Any, key: str = "") -> Any:
    """``value`` with every leaf replaced by its JSON type (a few literal keys kept)."""
    if isinstance(value, dict):
        if key in MAP_KEYS and "logprob" not in value:
            return ["map", *_distinct(shape(v) for v in value.values())]
        return [(k, shape(v, k)) for k, v in value.items()]
    if isinstance(value, list):
        return ["list", *_distinct(shape(item, key) for item in value)]
    if key in LITERAL_KEYS and isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "null" if value is None else type(value).__name__


def _distinct(shapes: Any) -> list[Any]:
    distinct: list[Any] = []
    for s in shapes:
        if s not in distinct:
            distinct.append(s)
    return distinct


def _place(chunk: dict[str, Any], first: bool) -> str:
    choices = chunk.get("choices")
    if choices == []:
        return "usage"
    if choices and any(c.get("finish_reason") for c in choices):
        return "finish"
    return "first" if first else "middle"


def stream_shape(data: bytes) -> dict[str, list[Any]]:
    """A stream's events by place: each place's distinct shapes; ``end`` the literal last
    event (``data: [DONE]``)."""
    events = [e for e in data.split(b"\n\n") if e.strip()]
    places: dict[str, list[Any]] = {}
    for i, event in enumerate(events):
        if event == b"data: [DONE]":
            places.setdefault("end", []).append("[DONE]")
            continue
        assert event.startswith(b"data: "), event[:80]
        chunk = orjson.loads(event[6:])
        s = shape(chunk)
        found = places.setdefault(_place(chunk, i == 0), [])
        if s not in found:
            found.append(s)
    return places


def answer_shape(base: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """The status and shape of ``body`` posted to ``base + path``."""
    answer = httpx.post(base + path, json=body, timeout=120)
    if body.get("stream") and answer.status_code == 200:
        return answer.status_code, stream_shape(answer.content)
    return answer.status_code, shape(answer.json())


def same_shapes(real_url: str, simulated_url: str, path: str, body: dict[str, Any]) -> list[str]:
    """Where the simulator's answer to a greedy ``body`` parts from the engine's (status and
    shape); empty when they agree."""
    body = {"model": "tiny", "temperature": 0, **body}
    real_status, real = answer_shape(real_url, path, body)
    sim_status, simulated = answer_shape(simulated_url, path, body)
    status = [] if real_status == sim_status else [f"status: engine {real_status} vs simulator {sim_status}"]
    return status + differences(real, simulated)


def differences(real: Any, simulated: Any, where: str = "") -> list[str]:
    """Where two shapes part, one line each (empty when they agree)."""
    if real == simulated:
        return []
    if isinstance(real, dict) and isinstance(simulated, dict):
        out = []
        for k in dict.fromkeys([*real, *simulated]):
            if k not in simulated:
                out.append(f"{where}/{k}: only the engine has it")
            elif k not in real:
                out.append(f"{where}/{k}: only the simulator has it")
            else:
                out += differences(real[k], simulated[k], f"{where}/{k}")
        return out
    if _is_object(real) and _is_object(simulated):
        r, s = dict(real), dict(simulated)
        out = [f"{where}: key order {list(r)} vs {list(s)}"] if (
            set(r) == set(s) and list(r) != list(s)) else []
        return out + differences(r, s, where)
    return [f"{where}: engine {_short(real)} vs simulator {_short(simulated)}"]


def uncovered(real: Any, simulated: Any, where: str = "") -> list[str]:
    """What the simulator says that the engine does not say the same way (keys only the
    engine has, and key order, aside): for the long descriptions (llama.cpp's /props) where
    the simulator writes only what clients read."""
    if _is_object(real) and _is_object(simulated):
        r, out = dict(real), []
        for k, v in simulated:
            out += [f"{where}/{k}: only the simulator has it"] if k not in r else uncovered(r[k], v, f"{where}/{k}")
        return out
    if isinstance(real, list) and isinstance(simulated, list) and real[:1] == simulated[:1] == ["list"]:
        if len(real) == len(simulated) == 2:
            return uncovered(real[1], simulated[1], where + "[]")
    return [] if real == simulated else [f"{where}: engine {_short(real)} vs simulator {_short(simulated)}"]


def _is_object(s: Any) -> bool:
    return isinstance(s, list) and all(isinstance(p, tuple) and len(p) == 2 for p in s) and (
        not s or s[0] != "list")


def _short(s: Any) -> str:
    text = repr(s)
    return text if len(text) < 300 else text[:300] + "..."


def metric_families(base: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Each metric family's type and label names from ``base``/metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=30).text
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        labels = frozenset(k for sample in family.samples for k in sample.labels if k != "le")
        out[family.name] = (family.type, labels)
    return out
