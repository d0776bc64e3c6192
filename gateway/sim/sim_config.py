"""One simulated replica's settings (``llm-gateway sim``'s flags, as ``gateway.sim.cli`` reads
them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.sim.faults import Faults
from gateway.sim.kv_connector import KvConnector
from gateway.sim.kv_publisher import PublisherConfig
from gateway.sim.profiles import Profile
from gateway.sim.wire import VLLM_VERSION
from gateway.sim.wire_llamacpp import LLAMACPP_BUILD
from gateway.tokens import ModelTokenizer

# The engine versions whose wire each dialect speaks (its /version, /info, /props say them).
VERSION = {"vllm": VLLM_VERSION, "tgi": "3.3.6", "sglang": "0.5.23", "llamacpp": LLAMACPP_BUILD}


@dataclass
class SimConfig:
    dialect: str
    model: str
    max_model_len: int
    profile: Profile
    tokenizer: ModelTokenizer
    tokenizer_dir: str = ""
    speed: float = 1.0
    prefix_cache: bool = False
    faults: Faults = field(default_factory=Faults)
    vllm_flat_errors: bool = False
    tgi_sse_no_space: bool = False
    max_concurrent_requests: int = 128   # TGI's semaphore
    max_input_tokens: int | None = None  # TGI; default max_model_len - 1
    no_stream_usage: bool = False        # ignore stream_options.include_usage
    eos_before_max: bool = False         # end at a natural length below max_tokens
    event_writes: bool = False           # one write per SSE event (as vLLM's generator yields)
    event_gap_s: float = 0.0             # with event_writes: pause between two writes
    stream_interval: int = 1             # vLLM --stream-interval: tokens per chunk after the first
    tgi_version: str = VERSION["tgi"]    # TGI: /info version and what that version serves
    text_seed: int = 0                   # another text for the same prompt (a canary that differs)
    aliases: list[str] = field(default_factory=list)  # vLLM: more --served-model-name names
    lora_modules: dict[str, str] = field(default_factory=dict)  # vLLM: adapter name -> path
    max_loras: int = 1                   # vLLM --max-loras (adapters in one batch)
    runtime_lora: bool = False           # vLLM: POST /v1/load_lora_adapter allowed
    runner: str = "generate"             # vLLM --runner: generate, or pooling (embeddings ...)
    kv_events: PublisherConfig | None = None  # vLLM --kv-events-config: publish KV events
    kv_connector: KvConnector | None = None  # vLLM --kv-transfer-config: disaggregated P/D
