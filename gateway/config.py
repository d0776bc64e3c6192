"""Gateway settings: a YAML file plus ``GATEWAY_*`` environment variables.

Environment wins over the file (``GATEWAY_BALANCER=round_robin``; nested keys with ``__``,
lists as JSON: ``GATEWAY_MODELS='[...]'``). Unknown keys anywhere are an error naming the key.
A replica is either ``{url, engine}``, the one-engine-per-GPU shorthand
``{host, gpus, base_port, engine}``, which expands to one replica per GPU, or
``{dns, port, engine}``: one replica per address the name resolves to, kept up to date
(``gateway/fleet/dns_discovery.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import (BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict,
                               YamlConfigSettingsSource)

from gateway.autoscale.config import AutoscaleConfig
from gateway.balance import POLICIES
from gateway.canary.config import CanaryConfig
from gateway.engines import NAMES as ENGINE_NAMES
from gateway.fleet.dns_config import DnsConfig
from gateway.fleet.role import Role
from gateway.migrate.config import MigrationConfig

Engine = Literal[ENGINE_NAMES]  # type: ignore[valid-type]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReplicaConfig(_Strict):
    url: str | None = None
    host: str | None = None
    gpus: int = Field(1, ge=1, le=1024)
    base_port: int | None = Field(None, ge=1, le=65535)
    dns: str | None = Field(None, min_length=1, description="a name resolving to one address "
                            "per replica (a Kubernetes headless Service)")
    port: int | None = Field(None, ge=1, le=65535, description="the replicas' port, with `dns`")
    engine: Engine = "vllm"
    max_model_len: int | None = Field(None, ge=1)
    name: str | None = None
    kv_events: str | None = Field(None, description="with `url`: the engine's KV event "
                                  "publisher, e.g. tcp://10.0.0.5:5557 (else the `kv_events` "
                                  "section's port rule)")
    kv_replay: str | None = Field(None, description="with `kv_events`: its replay socket")
    role: Role = Field("both", description="disaggregated serving: `prefill` engines only "
                       "prefill prompts, `decode` engines stream the answer from the KV a "
                       "prefill engine made; `both` serves whole requests (docs/disaggregation.md)")

    @model_validator(mode="after")
    def _url_or_host_or_dns(self) -> "ReplicaConfig":
        if [self.url, self.host, self.dns].count(None) != 2:
            raise ValueError("give one of `url`, `host` (+ `gpus`, `base_port`) or `dns` "
                             "(+ `port`)")
        if self.host is not None and self.base_port is None:
            raise ValueError("`host` needs `base_port` (the port of GPU 0)")
        if (self.dns is None) != (self.port is None):
            raise ValueError("`dns` and `port` go together")
        if self.dns is not None and "gpus" in self.model_fields_set:
            raise ValueError("`dns` gives one replica per address: no `gpus`")
        if self.url is None and self.kv_events is not None:
            raise ValueError("`kv_events` names one engine's publisher: only with `url` (a "
                             "`host` or `dns` entry uses the `kv_events` section's port rule)")
        if self.kv_replay is not None and self.kv_events is None:
            raise ValueError("`kv_replay` goes with `kv_events`")
        return self

    def expand(self) -> list["ReplicaConfig"]:
        """One replica per GPU: ports base_port, base_port+1, ... (none for ``dns``: those
        come from resolving the name, at run time)."""
        if self.dns is not None:
            return []
        if self.url is not None:
            return [self]
        return [ReplicaConfig(url=f"http://{self.host}:{self.base_port + gpu}", engine=self.engine,
                              max_model_len=self.max_model_len, role=self.role,
                              name=f"{self.name}-gpu{gpu}" if self.name else None)
                for gpu in range(self.gpus)]


class PoolConfig(_Strict):
    name: str = "default"
    weight: float = Field(100.0, ge=0, description="share of the model's primary traffic; "
                          "ignored for a shadow pool")
    replicas: list[ReplicaConfig] = Field(default_factory=list, description="none: scaled to "
                                          "zero until the admin API adds one "
                                          "(autoscale.scale_from_zero)")
    shadow_of: str | None = Field(None, description="canary: this pool gets a copy of a sample "
                                  "of that pool's requests, and no primary traffic")
    sample: float = Field(0.1, ge=0, le=1, description="with shadow_of: share of the requests "
                          "copied")


class ObjectiveConfig(_Strict):
    """Defaults for a request that sends no ``x-gateway-priority`` / ``x-slo-*`` headers
    (gateway/flow/objective.py; a key's come before its model's)."""

    priority: int | None = Field(None, ge=-100, le=100, description="band; negative = "
                                 "sheddable at saturation")
    ttft_ms: float | None = Field(None, gt=0, description="time to first token wanted")
    tpot_ms: float | None = Field(None, gt=0, description="time per output token wanted")

    def set_or_none(self) -> "ObjectiveConfig | None":
        """Itself, or None when nothing is set (requests then skip resolving it)."""
        return None if self == ObjectiveConfig() else self


class ModelConfig(_Strict):
    name: str = Field(min_length=1)
    objective: ObjectiveConfig = ObjectiveConfig()
    aliases: list[str] = Field(default_factory=list, description="more names the model's "
                               "engines serve it under (vLLM `--served-model-name a b`): "
                               "routed to every replica of the entry, forwarded as sent")
    discover_names: bool = Field(True, description="also route every name a replica lists on "
                                 "its /v1/models (aliases, LoRA adapters with `parent`) to the "
                                 "replicas that list it; false = only the configured names")
    load_adapters: dict[str, str] = Field(default_factory=dict, description="LoRA adapters "
                                          "loaded at run time when no replica serves one yet: "
                                          "name -> path on the engines' disk; loaded on the "
                                          "least-loaded vLLM replica (POST "
                                          "/v1/load_lora_adapter; the engine needs "
                                          "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); empty = never")
    tokenizer: str | None = None
    token_cache_mb: float = Field(64.0, ge=0, description="the prefix token cache: prompt "
                                  "segments' token ids kept, in MB (0 = off)")
    max_model_len: int | None = Field(None, ge=1)
    # Output tokens expected of a request that sets no max_tokens (for balancing only).
    default_output_tokens: int = Field(256, ge=1)
    # A prompt that fits the window but asks for more output than is left: `reject` answers
    # 400 context_length_exceeded (OpenAI's rule); `cap` serves it with max_tokens lowered
    # to what the window holds (what vLLM does by itself since 0.x). Needs `tokenizer`.
    output_past_window: Literal["reject", "cap"] = "reject"
    pools: list[PoolConfig] | None = None
    replicas: list[ReplicaConfig] | None = None

    @model_validator(mode="after")
    def _pools_or_replicas(self) -> "ModelConfig":
        if (self.pools is None) == (self.replicas is None):
            raise ValueError("give either `pools` or a plain `replicas` list")
        if self.replicas is not None:
            self.pools, self.replicas = [PoolConfig(name="default", replicas=self.replicas)], None
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        shadows = {p.name: p.shadow_of for p in self.pools if p.shadow_of is not None}
        for pool, target in shadows.items():
            if target not in names or target == pool:
                raise ValueError(f"pool {pool!r}: shadow_of {target!r} is not another pool "
                                 f"of the model ({names})")
            if target in shadows:
                raise ValueError(f"pool {pool!r}: shadow_of {target!r}, itself a shadow pool "
                                 "(no chains)")
        if len(shadows) == len(names):
            raise ValueError("every pool is a shadow pool: one must take primary traffic")
        return self


class TimeoutsConfig(_Strict):
    connect: float = Field(5.0, gt=0)
    first_token: float = Field(300.0, gt=0, description="request sent -> first byte of answer")
    between_tokens: float = Field(60.0, gt=0, description="gap between streamed chunks")
    total: float = Field(1800.0, gt=0, description="whole request")


class HealthConfig(_Strict):
    interval: float = Field(5.0, gt=0)
    timeout: float = Field(2.0, gt=0)
    unhealthy_after: int = Field(2, ge=1, description="consecutive failed probes")
    healthy_after: int = Field(1, ge=1, description="consecutive passed probes")
    names_interval: float = Field(10.0, gt=0, description="seconds between reads of each "
                                  "OpenAI-dialect replica's /v1/models: the names it serves "
                                  "(adapters loaded at run time, engines restarted)")


class OutlierConfig(_Strict):
    """Passive outlier ejection: a replica failing requests in a row sits out, for longer
    each time it is ejected again (base * 2^n, capped)."""

    consecutive_failures: int = Field(3, ge=1, description="connect errors, 5xx, timeouts")
    base_ejection: float = Field(5.0, gt=0, description="seconds out on the first ejection")
    max_ejection: float = Field(120.0, gt=0)
    max_ejected_percent: float = Field(50.0, ge=0, le=100,
                                       description="never eject more of a model's replicas")


class RetryConfig(_Strict):
    """Retry on another replica when nothing reached the client yet; a budget (Finagle/Envoy
    style) caps retries at a share of recent requests so they cannot multiply an outage."""

    max_attempts: int = Field(3, ge=1, description="attempts per request, the first included")
    budget_ratio: float = Field(0.2, ge=0, description="retries per request, over 10 s")
    min_retries_per_second: float = Field(5.0, ge=0, description="always allowed")


class BackpressureConfig(_Strict):
    """Per-replica in-flight limits and the bounded queue in front of them."""

    max_in_flight_per_replica: int = Field(
        1024, ge=1, description="or the engine's own limit where it reports a lower one (TGI); "
        "with queue_size, bounds what the gateway holds in memory")
    queue_size: int = Field(1024, ge=0, description="requests waiting for a slot, per model")
    queue_timeout: float = Field(30.0, gt=0, description="seconds a request may wait")
    queueing: Literal["fair", "fifo"] = Field(
        "fair", description="order of the waiting requests: fair = weighted fair queueing "
        "across API keys, priced in tokens (one flow without keys); fifo = arrival order")
    max_queued_per_key: int = Field(256, ge=1, description="requests one API key may have "
                                    "waiting per model; past it a 429 (queue_full)")


class FlowControlConfig(_Strict):
    """Saturation-aware flow control and latency objectives (docs/flow-control.md)."""

    saturation: bool = Field(True, description="a replica whose engine signals or tokens pass "
                             "a threshold takes no more requests: they wait at the gateway in "
                             "priority order; sheddable ones are refused (429)")
    max_waiting: int = Field(5, ge=1, description="engine's waiting requests (as scraped, plus "
                             "those placed since, minus those ended) that saturate it")
    max_kv_usage: float = Field(0.95, gt=0, le=1, description="engine's KV-cache use that "
                                "saturates it")
    max_outstanding_tokens: int | None = Field(None, ge=1, description="ledger tokens that "
                                               "saturate a replica; unset = no limit")
    max_prefill_tokens: int | None = Field(8192, ge=1, description="ledger prompt tokens not "
                                           "yet prefilled that saturate a replica (a new "
                                           "prompt's first token waits for them); vLLM's "
                                           "token budget per step; unset = no limit")
    ageing_seconds: float = Field(10.0, ge=0, description="a waiting band's priority rises by "
                                  "one per this many seconds its first waiter waited; 0 = "
                                  "strict order")
    predict: bool = Field(True, description="requests with a latency objective go to a replica "
                          "predicted to meet it (TTFT and TPOT fitted online)")


class SchedulingConfig(_Strict):
    """Weights of the default balancer, least_expected_work (docs/performance.md "Scheduling"). Scores
    are in output-token equivalents; every default works without tuning."""

    prefill_weight: float = Field(1.0, ge=0, description="one prompt token still to prefill, "
                                  "in output tokens still to generate")
    prefix_weight: float = Field(3.0, ge=0, le=10, description="output tokens a replica's "
                                 "score drops per prompt token it has cached; 0 = no prefix "
                                 "affinity")
    prefix_cache_tokens: int = Field(65536, ge=1, description="per replica: prompt tokens of "
                                     "recent prefixes remembered (at most the engine's cache)")
    request_tokens: float = Field(1024.0, ge=0, description="output tokens each in-flight "
                                  "request adds to its replica's score beyond its remaining "
                                  "ones (a batched engine's step time grows per sequence); "
                                  "0 = none")
    churn_weight: float = Field(1.0, ge=0, le=10, description="with KV events: output tokens "
                                "each prompt token a replica would newly cache costs, times "
                                "how fast its cache turns over (blocks stored in the last ~10 s "
                                "over its blocks, at most 1); 0 = off")
    session_tokens: float = Field(1024.0, ge=0, description="head start of a session's last "
                                  "replica; 0 = no stickiness")
    signals_weight: float = Field(1.0, ge=0, description="engine load signals; 0 = ignore")
    kv_pressure_from: float = Field(0.99, ge=0, lt=1, description="KV use above which a "
                                    "replica looks up to twice as busy (about to preempt)")
    signals_interval: float = Field(1.0, gt=0, description="seconds between /metrics scrapes")
    signals_timeout: float = Field(0.5, gt=0, description="seconds per scrape")
    signals_max_age: float = Field(3.0, gt=0, description="scrape intervals after which "
                                   "signals are stale and ignored")
    learn_output_lengths: bool = Field(True, description="reserve in the ledger the output "
                                       "completed requests of the model actually generated "
                                       "for a like max_tokens, not the whole ask (any "
                                       "token-based policy); false = the ask")


class KvEventsConfig(_Strict):
    """Precise prefix-cache routing from the engines' KV-cache events (vLLM
    ``--kv-events-config``; docs/kv-events.md). Every gateway instance subscribes to every
    engine. A replica's publisher is its own ``kv_events`` endpoint, else its host and a
    port: ``port`` (the same on every replica: one engine per pod) or the replica's HTTP
    port + ``port_offset`` (one engine per GPU on a host)."""

    enabled: bool = Field(False, description="subscribe to the events of every vLLM replica")
    port: int | None = Field(None, ge=1, le=65535, description="the publisher's port on every "
                             "replica's host; unset = HTTP port + port_offset")
    port_offset: int = Field(1000, ge=-65535, le=65535)
    replay_port: int | None = Field(None, ge=1, le=65535, description="the replay socket's "
                                    "port; unset = HTTP port + replay_port_offset")
    replay_port_offset: int | None = Field(2000, ge=-65535, le=65535, description="null = "
                                           "the engines have no replay socket")
    topic: str = Field("kv", description="the engines' `topic`")
    stale_after: float = Field(5.0, gt=0, description="seconds after blocks were sent to a "
                               "replica with no event since, when its events count as stopped "
                               "(it falls back to the approximate index)")
    pending_seconds: float = Field(2.0, ge=0, description="seconds the blocks of a request "
                                   "just sent count as held there, before the engine "
                                   "announces them")


class ResponsesConfig(_Strict):
    """The Responses API: where each stored response lives (gateway/fleet/
    response_homes.py)."""

    remembered: int = Field(100_000, ge=1, description="stored responses whose replica this "
                            "instance remembers in process (oldest forgotten first)")
    ttl: float = Field(86400.0, gt=0, description="with redis_url: seconds the shared record "
                       "of a response's replica lives")


KEY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # a metric label value: kept plain


class KeyLimits(_Strict):
    """Per-key limits (docs/keys-and-limits.md "API keys and limits"); unset = unlimited. The "minute" is
    ``auth.window`` seconds (60 unless shortened, e.g. for tests)."""

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1, description="prompt + output tokens; a "
                                          "request reserves prompt + max_tokens at admission, "
                                          "settled to real usage when it ends")
    concurrent_requests: int | None = Field(None, ge=1)


class ApiKeyConfig(_Strict):
    name: str = Field(pattern=KEY_NAME_PATTERN, description="the only part of a key that may "
                      "become a metric label")
    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$", description="hex SHA-256 of the secret "
                        "(`llm-gateway keys hash`)")
    models: list[str] | None = Field(None, description="allowlist; unset = every model")
    weight: float = Field(1.0, gt=0, le=1000, description="share under fair queueing")
    limits: KeyLimits = KeyLimits()
    objective: ObjectiveConfig = ObjectiveConfig()
    max_priority: int | None = Field(None, ge=-100, le=100, description="highest priority its "
                                     "requests may ask for; unset = its objective's (or 0)")


class AuthConfig(_Strict):
    """API keys: with an ``auth`` section every generation request needs
    ``Authorization: Bearer KEY``; without one, nothing changes."""

    keys: list[ApiKeyConfig] = Field(default_factory=list)
    window: float = Field(60.0, gt=0, le=3600, description="seconds of the limits' \"minute\"")
    fail_closed: bool = Field(False, description="with redis_url: refuse limited keys' requests "
                              "(503) while Redis is unreachable, instead of limiting each "
                              "instance on its own")
    ops_token: str | None = Field(None, min_length=1, description="bearer token for /health, "
                                  "/ready and /metrics; unset = open")
    refresh_interval: float = Field(1.0, gt=0, le=60, description="with redis_url: seconds "
                                    "between re-reads of admin-created keys (revocations are "
                                    "also announced at once on pub/sub)")

    @model_validator(mode="after")
    def _unique(self) -> "AuthConfig":
        names = [k.name for k in self.keys]
        if len(set(names)) != len(names):
            raise ValueError(f"key names must be unique, got {names}")
        hashes = [k.sha256.lower() for k in self.keys]
        if len(set(hashes)) != len(hashes):
            raise ValueError("two keys have the same sha256 (the same secret)")
        return self


class TracingConfig(_Strict):
    """OpenTelemetry traces over OTLP/HTTP (``gateway/observe/tracing.py``). Unset fields
    follow the SDK's environment variables, then the SDK's defaults."""

    enabled: bool = Field(False, description="export a trace of each request")
    endpoint: str | None = Field(None, min_length=1, description="OTLP/HTTP traces URL, e.g. "
                                 "http://otel-collector:4318/v1/traces; unset: "
                                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or "
                                 "OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces, or "
                                 "http://localhost:4318/v1/traces")
    sampling: float | None = Field(None, ge=0, le=1, description="share of traces started "
                                   "here that are recorded (a client's traceparent decides "
                                   "for its own); unset: OTEL_TRACES_SAMPLER_ARG, or 1.0")
    service_name: str | None = Field(None, min_length=1, description="unset: "
                                     "OTEL_SERVICE_NAME, or llm-gateway")


class AccessLogConfig(_Strict):
    """One JSON line per client request when it ends (``gateway/observe/access_log.py``)."""

    enabled: bool = False
    path: str = Field("-", min_length=1, description="'-' for stdout, else a file appended to")
    sampling: float = Field(1.0, ge=0, le=1, description="share of requests logged")
    flush_interval: float = Field(0.5, gt=0, le=60, description="seconds lines may wait in "
                                  "memory before they are written")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", env_nested_delimiter="__",
                                      extra="forbid")

    models: list[ModelConfig] = Field(min_length=1)
    default_model: str | None = None
    balancer: str = "least_expected_work"
    scheduling: SchedulingConfig = SchedulingConfig()
    kv_events: KvEventsConfig = KvEventsConfig()
    redis_url: str | None = None
    # Shared state (with redis_url; docs/deploy.md "Several instances"): every key under the prefix.
    redis_key_prefix: str = Field("llm-gateway:", min_length=1)
    redis_sync_interval: float = Field(0.1, gt=0, le=10, description="seconds between syncs "
                                       "(a request placed or ended is announced at once)")
    redis_peer_ttl: float = Field(1.0, gt=0, le=60, description="seconds after which a silent "
                                  "instance (crashed, or Redis down) stops counting")
    redis_timeout: float = Field(0.5, gt=0, le=10, description="seconds one sync may take")
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    timeouts: TimeoutsConfig = TimeoutsConfig()
    health: HealthConfig = HealthConfig()
    max_connections_per_replica: int = Field(1024, ge=1)
    # Below the engines' own idle timeout (vLLM, SGLang: uvicorn's 5 s; llama.cpp: 5 s), so
    # the gateway never reuses a connection the engine is closing (a 502 for nothing).
    upstream_keepalive: float = Field(4.0, gt=0, description="seconds an idle upstream "
                                      "connection stays open")
    outlier: OutlierConfig = OutlierConfig()
    retries: RetryConfig = RetryConfig()
    migration: MigrationConfig = MigrationConfig()
    backpressure: BackpressureConfig = BackpressureConfig()
    flow_control: FlowControlConfig = FlowControlConfig()
    objectives: dict[str, ObjectiveConfig] = Field(
        default_factory=dict, description="named objectives (llm-d's InferenceObjectives): a "
        "request's x-llm-d-inference-objective header names one for its defaults")
    autoscale: AutoscaleConfig = AutoscaleConfig()
    drain_timeout: float = Field(30.0, ge=0, description="SIGTERM: seconds to finish streams")
    client_body_timeout: float = Field(30.0, gt=0, description="seconds to receive a body")
    admin_token: str | None = Field(None, description="bearer token of /admin; unset = off")
    metrics: bool = Field(True, description="false: no Prometheus metrics (/metrics is empty)")
    dns: DnsConfig = DnsConfig()
    auth: AuthConfig | None = Field(None, description="API keys and per-key limits; unset = "
                                    "open, as without keys")
    canary: CanaryConfig = CanaryConfig()
    responses: ResponsesConfig = ResponsesConfig()
    tracing: TracingConfig = TracingConfig()
    access_log: AccessLogConfig = AccessLogConfig()

    @model_validator(mode="after")
    def _check(self) -> "Settings":
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        every = [n for m in self.models for n in (m.name, *m.aliases, *m.load_adapters)]
        twice = sorted({n for n in every if every.count(n) > 1})
        if twice:
            raise ValueError(f"model names and aliases must be unique across models: {twice} "
                             "given twice")
        if self.default_model is not None and self.default_model not in names:
            raise ValueError(f"default_model {self.default_model!r} is not one of {names}")
        if self.balancer not in POLICIES:
            raise ValueError(f"balancer {self.balancer!r} is not one of {sorted(POLICIES)}")
        for key in self.auth.keys if self.auth else ():
            unknown = sorted(set(key.models or ()) - set(names))
            if unknown:
                raise ValueError(f"key {key.name!r} allows unknown models {unknown}")
        return self

    @model_validator(mode="after")
    def _redis_timing(self) -> "Settings":
        if self.redis_peer_ttl < 3 * self.redis_sync_interval:
            raise ValueError("redis_peer_ttl must be at least 3 x redis_sync_interval, or live "
                             "instances would flicker in and out of each other's view")
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, YamlConfigSettingsSource(settings_cls)


class ConfigError(ValueError):
    """A bad configuration, with every offending key named."""


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"]) or "(top level)"
        lines.append(f"  {key}: {err['msg']}")
    return "invalid gateway configuration:\n" + "\n".join(lines)


def load_settings(path: str | Path | None = None, **overrides: object) -> Settings:
    """Settings from a YAML file (if given), the environment and explicit overrides."""
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"config file not found: {path}")

    class FileSettings(Settings):
        model_config = SettingsConfigDict(**{**Settings.model_config, "yaml_file": path})

    try:
        return FileSettings(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
