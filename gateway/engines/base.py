"""The one interface every engine module fills in: what the gateway needs to know about one
kind of inference engine.

An engine is a class whose attributes are its answers; its module defines one instance and
``gateway.engines.ENGINES`` maps the config name to it. Callers ask once, when a replica or a
translation plan is built (``Replica.profile``, ``gateway.engines.get``), never per token.
Defaults are the least an OpenAI-compatible server has; each engine declares the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

from gateway.engines.signals import EngineSignals, SignalMetrics, read_signals
from gateway.kvcache.events import EventBatch
from gateway.protocol.errors import Api


def positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and value > 0 else None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine that lists no models says about itself (TGI ``/info``, llama.cpp
    ``/props``): its window, prompt limit, in-flight limit and version, where it reports them."""

    max_model_len: int | None = None
    max_input_tokens: int | None = None
    max_concurrent_requests: int | None = None
    version: str | None = None


# The TGI -> /v1/completions fields every OpenAI-dialect engine shares (the rest of an
# engine's ``tgi_parameters`` column is its own).
OPENAI_TGI_PARAMETERS: Mapping[str, str | None] = MappingProxyType({
    "inputs": "prompt",
    "max_new_tokens": "max_tokens",
    "do_sample": "temperature",  # greedy (do_sample false, no warper) -> temperature 0
    "temperature": "temperature",
    "top_p": "top_p",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "truncate": "prompt (token ids)",
    "return_full_text": "(the gateway prepends inputs)",
})


class Engine:
    """What any OpenAI-compatible server has (completions, chat, ``/v1/models``); engine
    modules add what theirs has and override what differs."""

    name: str  # in config, metrics and messages
    title: str  # as its makers write it
    api: Api = Api.OPENAI  # the dialect it speaks natively

    # --- names and window (gateway/fleet/served_names.py, discovery.py) ---
    # GET /v1/models lists every name it serves (aliases; LoRA adapters with `parent`), and
    # the window (`max_model_len`) where it reports one.
    lists_models: bool = True
    # Else: the route that describes it (window, in-flight limit), read by ``read_info``.
    info_path: str | None = None

    def read_info(self, info: Any) -> EngineInfo:
        """``info_path``'s answer (raises ValueError/AttributeError on one it cannot read)."""
        return EngineInfo()

    # --- load signals from /metrics (gateway/fleet/engine_signals.py) ---
    signal_metrics: SignalMetrics | None = None  # None: nothing worth scraping

    def parse_signals(self, text: str, scraped_at: float = 0.0,
                      ledger_in_flight: int = 0) -> EngineSignals:
        assert self.signal_metrics is not None, f"{self.name} exposes no load signals"
        return read_signals(self.signal_metrics, text, scraped_at, ledger_in_flight)

    # --- LoRA adapters loaded at run time (gateway/fleet/adapter_loader.py) ---
    adapter_load_path: str | None = None  # POST {"lora_name", "lora_path"}; None: cannot

    def adapter_loaded(self, status: int, text: str) -> bool:
        """Whether a load answered with ``status`` and ``text`` left the adapter served."""
        return status == 200

    # --- routes beyond completions and chat (gateway/protocol/pooling.py, responses.py) ---
    pooling_routes: frozenset[str] = frozenset()
    tgi_routes: frozenset[str] = frozenset()  # TGI-protocol routes (TGI's own /tokenize)
    serves_responses: bool = False  # POST /v1/responses
    # Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens); else an
    # Anthropic client's request goes to its chat completions, translated
    # (gateway/protocol/translate/anthropic_chat.py)
    serves_messages: bool = False

    # --- KV-cache events (gateway/kvcache): reads one published payload (raises
    # MalformedBatch); None: the engine publishes none the gateway can read ---
    decode_kv_events: Callable[[bytes], EventBatch] | None = None

    # --- disaggregated serving (gateway/dataplane/prefill.py): a prefill engine computes a
    # prompt's KV cache and a decode engine streams the answer from it ---
    disaggregates: bool = False  # its engines can hand a prompt's KV cache to each other

    def prefill_body(self, body: bytes) -> bytes | None:
        """The body (as planned for this engine) made a prefill: one token, not streamed, the
        KV kept for another engine. None: the request needs what only a whole run gives (the
        prompt's own logprobs), so the decode engine prefills it itself."""
        raise NotImplementedError(f"{self.title} does not disaggregate")

    def handoff(self, answer: bytes) -> Any:
        """What a prefill's answer gives the decode engine (None: nothing; ValueError: not an
        answer)."""
        raise NotImplementedError(f"{self.title} does not disaggregate")

    def decode_body(self, body: bytes, handoff: Any) -> bytes:
        """The body (as planned for this engine) with a prefill's ``handoff``."""
        raise NotImplementedError(f"{self.title} does not disaggregate")

    # --- a broken stream continued on another replica (gateway/migrate) ---
    # It takes a prompt as token ids on /v1/completions and reports the ids of the prompt and
    # of each chunk it streams (``return_token_ids``): a stream cut short goes on, exactly,
    # on another engine of the kind from the ids sent so far.
    continues: bool = False

    # --- a TGI client on this engine (gateway/protocol/translate/tgi_request.py) ---
    # TGI parameter -> the /v1/completions field(s) it becomes; absent or None: no
    # equivalent (the request is refused with a 422 naming it, never sent without it).
    tgi_parameters: Mapping[str, str | None] = OPENAI_TGI_PARAMETERS
    # What TGI's stream events need (token ids); None: it cannot report them.
    tgi_stream_fields: str | None = None
    tgi_always_streams: bool = False  # asked for a stream even for /generate (llama.cpp)
    tgi_extra_fields: Mapping[str, Any] = MappingProxyType({})  # sent with every request
    tgi_stop_fields: Mapping[str, Any] = MappingProxyType({})  # keep the stop string in the text
    tgi_min_logprobs: int = 0  # `logprobs` when only the sampled token's is needed
    asks_token_ids: bool = False  # `return_token_ids`
    top_tokens_as_ids: bool = False  # reports tokens by id: the gateway's tokenizer names them
    truncates_prompt: bool = False  # `truncate_prompt_tokens`; else the gateway truncates
    accepts_regex_grammar: bool = True
    adapter_field: str = "lora_path"  # where a TGI `adapter_id` goes

    def grammar_fields(self, kind: str, value: Any) -> dict[str, Any]:
        """The body fields for a TGI grammar (``kind`` "json" with a schema, or "regex")."""
        return {"json_schema": value}

    # --- its answers (gateway/protocol/translate/tgi_response.py, generated_tokens.py) ---
    stop_reason_key: str = "matched_stop"  # a choice's field naming the stop string matched
    reports_matched_stop: bool = False  # its chat answers carry that field
    content_logprobs: bool = False  # logprobs as chat-style `content` entries (llama.cpp)

    def __repr__(self) -> str:
        return f"<engine {self.name}>"
