"""Gateway settings: a YAML file plus ``GATEWAY_*`` environment variables.

Environment wins over the file (``GATEWAY_BALANCER=round_robin``; nested keys with ``__``,
lists as JSON: ``GATEWAY_MODELS='[...]'``). Unknown keys anywhere are an error naming the key.
A replica is either ``{url, engine}`` or the one-engine-per-GPU shorthand
``{host, gpus, base_port, engine}``, which expands to one replica per GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import (BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict,
                               YamlConfigSettingsSource)

Engine = Literal["vllm", "tgi", "sglang", "llamacpp", "openai"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ReplicaConfig(_Strict):
    url: str | None = None
    host: str | None = None
    gpus: int = Field(1, ge=1, le=1024)
    base_port: int | None = Field(None, ge=1, le=65535)
    engine: Engine = "vllm"
    max_model_len: int | None = Field(None, ge=1)
    name: str | None = None

    @model_validator(mode="after")
    def _url_or_host(self) -> "ReplicaConfig":
        if (self.url is None) == (self.host is None):
            raise ValueError("give either `url` or `host` (+ `gpus`, `base_port`)")
        if self.host is not None and self.base_port is None:
            raise ValueError("`host` needs `base_port` (the port of GPU 0)")
        return self

    def expand(self) -> list["ReplicaConfig"]:
        """One replica per GPU: ports base_port, base_port+1, ..."""
        if self.url is not None:
            return [self]
        return [ReplicaConfig(url=f"http://{self.host}:{self.base_port + gpu}", engine=self.engine,
                              max_model_len=self.max_model_len,
                              name=f"{self.name}-gpu{gpu}" if self.name else None)
                for gpu in range(self.gpus)]


class PoolConfig(_Strict):
    name: str = "default"
    weight: float = Field(100.0, ge=0)
    replicas: list[ReplicaConfig] = Field(min_length=1)


class ModelConfig(_Strict):
    name: str = Field(min_length=1)
    tokenizer: str | None = None
    max_model_len: int | None = Field(None, ge=1)
    # Output tokens expected of a request that sets no max_tokens (for balancing only).
    default_output_tokens: int = Field(256, ge=1)
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


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", env_nested_delimiter="__",
                                      extra="forbid")

    models: list[ModelConfig] = Field(min_length=1)
    default_model: str | None = None
    balancer: str = "least_outstanding_tokens"
    redis_url: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    timeouts: TimeoutsConfig = TimeoutsConfig()
    health: HealthConfig = HealthConfig()
    max_connections_per_replica: int = Field(1024, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "Settings":
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        if self.default_model is not None and self.default_model not in names:
            raise ValueError(f"default_model {self.default_model!r} is not one of {names}")
        from gateway.balance.policy import POLICIES
        if self.balancer not in POLICIES:
            raise ValueError(f"balancer {self.balancer!r} is not one of {sorted(POLICIES)}")
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
