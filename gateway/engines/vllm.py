"""vLLM (``vllm serve``): every OpenAI route plus pooling, score, tokenize and Responses; LoRA
adapters listed on /v1/models and loaded at run time; the richest TGI mapping (token ids,
prompt logprobs, its own truncation). Home of vLLM-only features: the wire of its KV-cache
events (``decode_kv_batch``, ``encode_kv_batch``; gateway/kvcache subscribes to them) and
disaggregated prefill's ``kv_transfer_params`` (``prefill_body``, ``handoff``,
``decode_body``; gateway/dataplane/prefill.py drives them).

Load signals: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before 0.9); with LoRA also
``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}``
(comma-joined adapter names; the value is when it was set, and older label sets linger: the
newest counts), read for adapter-aware placement.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import msgpack
import orjson

from gateway.engines.base import OPENAI_TGI_PARAMETERS, Engine
from gateway.engines.signals import EngineSignals, SignalMetrics
from gateway.kvcache.events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
                                    KvEvent, MalformedBatch)

# A prefill's request: keep the KV for a remote decode (NixlConnector answers with where it is).
PREFILL_PARAMS = MappingProxyType({"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None})
LORA_INFO = "vllm:lora_requests_info"
CACHE_INFO = "vllm:cache_config_info"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _names(value: str) -> frozenset[str]:
    return frozenset(n.strip() for n in value.split(",") if n.strip())


def parse_lora_info(text: str) -> tuple[frozenset[str], frozenset[str], int | None] | None:
    """(running adapters, waiting adapters, max_lora) of the newest ``vllm:lora_requests_info``
    sample, or None when there is none."""
    newest: tuple[float, dict[str, str]] | None = None
    at = text.find(LORA_INFO + "{")
    while at != -1:
        end = text.find("\n", at)
        line = text[at:end if end != -1 else len(text)]
        close = line.rfind("}")
        try:
            value = float(line[close + 1:].split()[0])
        except (ValueError, IndexError):
            value = math.nan
        if close != -1 and math.isfinite(value) and (newest is None or value >= newest[0]):
            newest = value, dict(_LABEL.findall(line[len(LORA_INFO) + 1:close]))
        at = text.find(LORA_INFO + "{", at + 1)
    if newest is None:
        return None
    labels = newest[1]
    max_lora = labels.get("max_lora", "")
    return (_names(labels.get("running_lora_adapters", "")),
            _names(labels.get("waiting_lora_adapters", "")),
            int(max_lora) if max_lora.isdigit() else None)


# --- KV-cache events (vllm/distributed/kv_events.py; ENGINE-WIRE.md "vLLM 0.32 KV cache events")
# A batch is ``[ts, [events...], data_parallel_rank]``. Since 2026 each event is a map with a
# ``type`` key; before, a positional array led by its type name, fields in declaration order
# (``lora_name`` and what follows were appended over releases, so trailing ones may be absent).
_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


class _UnknownEvent(ValueError):
    """An event of a type this gateway does not know (a newer vLLM's)."""


def _hash(value: Any) -> int | bytes:
    if isinstance(value, (int, bytes)) and not isinstance(value, bool):
        return value
    raise ValueError(f"block hash {value!r}")


def _frozen(value: Any) -> Any:
    """msgpack arrays as tuples, so extra keys can be hashed."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _kv_event(raw: Any) -> KvEvent:
    """One event in either encoding; ValueError (or a TypeError/KeyError) when unreadable."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        fields = dict(zip(_POSITIONAL.get(kind, ()), raw[1:]))
    elif isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    else:
        raise ValueError("not an event")
    if kind == "BlockStored":
        hashes = tuple(_hash(h) for h in fields["block_hashes"])
        parent = fields.get("parent_block_hash")
        tokens = tuple(fields["token_ids"])
        size = fields["block_size"]
        if (not isinstance(size, int) or size < 1 or len(tokens) != size * len(hashes)
                or not all(isinstance(t, int) for t in tokens)):
            raise ValueError("token ids do not fill the blocks")
        extra = fields.get("extra_keys")
        if extra is not None and len(extra) != len(hashes):
            raise ValueError("extra keys do not match the blocks")
        lora = fields.get("lora_name")
        return BlockStored(hashes, None if parent is None else _hash(parent), tokens, size,
                           lora if isinstance(lora, str) else None,
                           None if extra is None else tuple(_frozen(e) for e in extra),
                           fields.get("medium"))
    if kind == "BlockRemoved":
        return BlockRemoved(tuple(_hash(h) for h in fields["block_hashes"]), fields.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise _UnknownEvent(kind)


def decode_kv_batch(payload: bytes) -> EventBatch:
    """A published payload: MalformedBatch when it is no batch; events that cannot be read
    are left out and named in ``dropped``."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        ts, events = float(raw[0]), raw[1]
        rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
        if not isinstance(events, list):
            raise TypeError("events")
    except Exception as exc:  # anything msgpack or the shape can raise
        raise MalformedBatch(f"not an event batch: {type(exc).__name__}") from None
    good, dropped = [], []
    for raw_event in events:
        try:
            good.append(_kv_event(raw_event))
        except (ValueError, TypeError, KeyError) as exc:
            kind = raw_event.get("type") if isinstance(raw_event, dict) else (
                raw_event[0] if isinstance(raw_event, list) and raw_event else None)
            dropped.append("unknown" if isinstance(exc, _UnknownEvent)
                           else f"malformed {kind}" if isinstance(kind, str) else "malformed")
    return EventBatch(ts, tuple(good), rank, tuple(dropped))


def _event_map(event: KvEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        fields = {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                  "parent_block_hash": event.parent_block_hash,
                  "token_ids": list(event.token_ids), "block_size": event.block_size,
                  "lora_id": None, "medium": event.medium, "lora_name": event.lora_name}
        if event.extra_keys is not None:  # (msgspec's omit_defaults leaves None out)
            fields["extra_keys"] = [list(e) if e is not None else None for e in event.extra_keys]
        return {**fields, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes),
                "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def _event_array(event: KvEvent) -> list[Any]:
    fields = _event_map(event)
    kind = fields["type"]
    return [kind, *(fields.get(name) for name in _POSITIONAL[kind])]


def encode_kv_batch(ts: float, events: list[KvEvent], rank: int | None = 0,
                    positional: bool = False) -> bytes:
    """The payload vLLM 0.32 publishes for these events (``positional``: the older array
    encoding). The simulator publishes with it; tests build recorded-style samples."""
    encode = _event_array if positional else _event_map
    return msgpack.packb([ts, [encode(e) for e in events], rank], use_bin_type=True)


def parse_cache_config(text: str) -> tuple[int | None, int | None]:
    """The engine's KV blocks (GPU and offloaded CPU) and block size, from
    ``vllm:cache_config_info`` (None where it does not say)."""
    at = text.find(CACHE_INFO + "{")
    if at == -1:
        return None, None
    end = text.find("}", at)
    labels = dict(_LABEL.findall(text[at + len(CACHE_INFO) + 1:end]))
    blocks = [int(labels[k]) for k in ("num_gpu_blocks", "num_cpu_blocks")
              if labels.get(k, "").isdigit()]
    size = labels.get("block_size", "")
    return sum(blocks) or None, int(size) if size.isdigit() and int(size) > 0 else None


class VLLM(Engine):
    name = "vllm"
    title = "vLLM"
    signal_metrics = SignalMetrics(("vllm:num_requests_running",), ("vllm:num_requests_waiting",),
                                   ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
    # Needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True on the engine.
    adapter_load_path = "/v1/load_lora_adapter"
    pooling_routes = frozenset({"/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score",
                                "/rerank", "/v1/rerank", "/tokenize", "/detokenize"})
    serves_responses = True
    serves_messages = True  # vLLM >= 0.32 (vllm/entrypoints/anthropic/)
    decode_kv_events = staticmethod(decode_kv_batch)  # with --kv-events-config

    tgi_parameters = MappingProxyType({
        **OPENAI_TGI_PARAMETERS,
        "top_k": "top_k",
        "repetition_penalty": "repetition_penalty",
        "stop": "stop + include_stop_str_in_output",
        "truncate": "truncate_prompt_tokens",
        "best_of": "n + logprobs",
        "details": "logprobs + return_token_ids",
        "decoder_input_details": "prompt_logprobs + return_token_ids",
        "top_n_tokens": "logprobs + return_tokens_as_token_ids",
        "grammar": "structured_outputs",
        "adapter_id": "model",
    })
    tgi_stream_fields = "logprobs + return_token_ids"
    tgi_stop_fields = MappingProxyType({"include_stop_str_in_output": True})  # TGI keeps it
    asks_token_ids = True
    top_tokens_as_ids = True  # `return_tokens_as_token_ids`: top tokens' ids, not their text
    truncates_prompt = True  # keeps the last N tokens, as TGI does
    adapter_field = "model"  # vLLM serves a LoRA adapter under its own name
    stop_reason_key = "stop_reason"
    reports_matched_stop = True

    def grammar_fields(self, kind: str, value: Any) -> dict[str, Any]:
        return {"structured_outputs": {kind: value}}

    def parse_signals(self, text: str, scraped_at: float = 0.0,
                      ledger_in_flight: int = 0) -> EngineSignals:
        signals = super().parse_signals(text, scraped_at, ledger_in_flight)
        if CACHE_INFO in text:
            kv_blocks, block_size = parse_cache_config(text)
            signals = replace(signals, kv_blocks=kv_blocks, kv_block_size=block_size)
        lora = parse_lora_info(text) if LORA_INFO in text else None
        if lora is None:
            return signals
        return replace(signals, lora_running=lora[0], lora_waiting=lora[1], max_lora=lora[2])

    def adapter_loaded(self, status: int, text: str) -> bool:
        # vLLM answers 400 "already been loaded" to a second load: it is there.
        return status == 200 or "already been loaded" in text

    continues = True  # return_token_ids (>= 0.10.2) and a prompt of ids on /v1/completions

    # Disaggregated prefill, as vLLM's own P/D proxy drives it
    # (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py; ENGINE-WIRE.md).
    disaggregates = True

    def prefill_body(self, body: bytes) -> bytes | None:
        fields = orjson.loads(body)
        if fields.get("prompt_logprobs") is not None or fields.get("echo"):
            return None  # the prompt's logits: only an engine that computes it has them
        fields.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
        if "max_completion_tokens" in fields:
            fields["max_completion_tokens"] = 1
        for name in ("stream_options", "min_tokens", "min_completion_tokens"):
            fields.pop(name, None)  # a one-token prefill refuses a longer minimum
        return orjson.dumps(fields)

    def handoff(self, answer: bytes) -> dict[str, Any] | None:
        try:
            params = orjson.loads(answer).get("kv_transfer_params")
        except (orjson.JSONDecodeError, AttributeError):
            raise ValueError("the prefill's answer is not a JSON object") from None
        if params is not None and not isinstance(params, dict):
            raise ValueError("kv_transfer_params is not an object")
        return params or None  # a connector that needs none (ExampleConnector) answers none

    def decode_body(self, body: bytes, handoff: Any) -> bytes:
        if handoff is None:
            return body
        return orjson.dumps({**orjson.loads(body), "kv_transfer_params": handoff})


ENGINE = VLLM()
