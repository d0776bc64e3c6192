"""SGLang (``sglang.launch_server``): OpenAI routes with embeddings and rerank, LoRA adapters by
``lora_path``, token ids on request, the matched stop string in ``matched_stop``.

Load signals: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import orjson

from gateway.engines.base import OPENAI_TGI_PARAMETERS, Engine
from gateway.engines.signals import SignalMetrics


class SGLang(Engine):
    name = "sglang"
    title = "SGLang"
    signal_metrics = SignalMetrics(("sglang:num_running_reqs",), ("sglang:num_queue_reqs",),
                                   ("sglang:token_usage",))
    pooling_routes = frozenset({"/v1/embeddings", "/v1/rerank"})

    tgi_parameters = MappingProxyType({
        **OPENAI_TGI_PARAMETERS,
        "top_k": "top_k",
        "repetition_penalty": "repetition_penalty",
        "stop": "stop + no_stop_trim",
        "best_of": "n + logprobs",
        "details": "logprobs + return_token_ids",
        "grammar": "json_schema / regex",
        "adapter_id": "lora_path",
    })
    tgi_stream_fields = "logprobs + return_token_ids"
    tgi_stop_fields = MappingProxyType({"no_stop_trim": True})
    asks_token_ids = True
    reports_matched_stop = True  # matched_stop

    def grammar_fields(self, kind: str, value: Any) -> dict[str, Any]:
        if kind == "json":  # SGLang takes the schema as a JSON string
            return {"json_schema": orjson.dumps(value).decode()}
        return {"regex": value}


ENGINE = SGLang()
