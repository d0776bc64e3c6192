"""vLLM (``vllm serve``): every OpenAI route plus pooling, score, tokenize and Responses; LoRA
adapters listed on /v1/models and loaded at run time; the richest TGI mapping (token ids,
prompt logprobs, its own truncation). Home of vLLM-only features (KV events,
``kv_transfer_params``) as they come.

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

from gateway.engines.base import OPENAI_TGI_PARAMETERS, Engine
from gateway.engines.signals import EngineSignals, SignalMetrics

LORA_INFO = "vllm:lora_requests_info"
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

    def grammar_fields(self, kind: str, value: Any) -> dict[str, Any]:
        return {"structured_outputs": {kind: value}}

    def parse_signals(self, text: str, scraped_at: float = 0.0,
                      ledger_in_flight: int = 0) -> EngineSignals:
        signals = super().parse_signals(text, scraped_at, ledger_in_flight)
        lora = parse_lora_info(text) if LORA_INFO in text else None
        if lora is None:
            return signals
        return replace(signals, lora_running=lora[0], lora_waiting=lora[1], max_lora=lora[2])

    def adapter_loaded(self, status: int, text: str) -> bool:
        # vLLM answers 400 "already been loaded" to a second load: it is there.
        return status == 200 or "already been loaded" in text


ENGINE = VLLM()
