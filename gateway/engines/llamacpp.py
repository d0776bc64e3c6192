"""llama.cpp (``llama-server``): one model whatever the request names; its window and slots
from ``GET /props``; tokens reported chat-style (``logprobs.content``), with tokens that end
inside a UTF-8 character merged into the chunk that completes it, so a TGI client is always
served from a stream with per-chunk counts (``timings_per_token``).

Load signals: ``llamacpp:requests_processing``, ``llamacpp:requests_deferred`` (no KV gauge).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from gateway.engines.base import OPENAI_TGI_PARAMETERS, Engine, EngineInfo, positive_int
from gateway.engines.signals import SignalMetrics


class LlamaCpp(Engine):
    name = "llamacpp"
    title = "llama.cpp"
    lists_models = False
    info_path = "/props"
    signal_metrics = SignalMetrics(("llamacpp:requests_processing",),
                                   ("llamacpp:requests_deferred",))

    def read_info(self, info: Any) -> EngineInfo:
        # n_ctx is per slot, which is what a request gets. One request per slot; more wait
        # inside the engine, out of the balancer's sight.
        return EngineInfo(
            max_model_len=positive_int(info.get("default_generation_settings", {}).get("n_ctx")),
            max_concurrent_requests=positive_int(info.get("total_slots")))

    tgi_parameters = MappingProxyType({
        **OPENAI_TGI_PARAMETERS,
        "top_k": "top_k",
        "typical_p": "typical_p",
        "repetition_penalty": "repeat_penalty",
        "details": "logprobs",
        "top_n_tokens": "logprobs",
        "grammar": "json_schema",
    })
    tgi_stream_fields = "logprobs"
    # Always a stream, with its count of generated tokens per chunk: only a chunk's count says
    # how many tokens it holds; a whole answer has no such count
    # (``tgi_response.tgi_body_from_stream``).
    tgi_always_streams = True
    tgi_extra_fields = MappingProxyType({"timings_per_token": True})
    tgi_min_logprobs = 1
    accepts_regex_grammar = False  # JSON schemas and GBNF grammars only
    content_logprobs = True
    serves_messages = True  # llama-server has /v1/messages and /v1/messages/count_tokens


ENGINE = LlamaCpp()
