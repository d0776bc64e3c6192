"""Text Generation Inference: the TGI dialect natively (OpenAI clients are translated, or use
its own ``/v1`` routes where its version has them: gateway/protocol/translate); one model;
window, prompt limit, in-flight limit and version from ``GET /info``.

Load signals: ``tgi_batch_current_size``, ``tgi_queue_size``, and KV use as
``tgi_batch_current_max_tokens / tgi_batch_max_total_tokens``.
"""

from __future__ import annotations

from typing import Any

from gateway.engines.base import Engine, EngineInfo, positive_int
from gateway.engines.signals import SignalMetrics
from gateway.protocol.errors import Api


class TGI(Engine):
    name = "tgi"
    title = "TGI"
    api = Api.TGI
    lists_models = False
    info_path = "/info"
    signal_metrics = SignalMetrics(("tgi_batch_current_size",), ("tgi_queue_size",),
                                   ("tgi_batch_current_max_tokens",), "tgi_batch_max_total_tokens")
    tgi_routes = frozenset({"/tokenize"})  # TGI's own (a GenerateRequest body, `inputs`)

    def read_info(self, info: Any) -> EngineInfo:
        # max_input_length before v2.1. Beyond max_concurrent_requests TGI answers 429, so the
        # gateway queues instead; the version says which /v1 routes it has.
        version = info.get("version")
        return EngineInfo(
            max_model_len=positive_int(info.get("max_total_tokens")),
            max_input_tokens=positive_int(info.get("max_input_tokens")
                                          or info.get("max_input_length")),
            max_concurrent_requests=positive_int(info.get("max_concurrent_requests")),
            version=version if isinstance(version, str) else None)


ENGINE = TGI()
