"""The ``autoscale`` section of the config (docs/autoscaling.md)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ScaleFromZeroConfig(_Strict):
    """A model with no replica registered (scaled to zero) holds its requests at the gateway,
    in priority order, until one appears."""

    enabled: bool = Field(True, description="hold requests for a model with no replica; false "
                          "= refuse them at once (404 unknown model, as before)")
    timeout: float = Field(120.0, gt=0, description="seconds a request is held (long enough "
                           "for an engine to start); past it a 503 with Retry-After")
    retry_after: int = Field(10, ge=1, description="the Retry-After of that 503, in seconds")
    max_held: int = Field(1024, ge=1, description="requests held per model; past it a 503")


class AutoscaleConfig(_Strict):
    """``llm_gateway_desired_replicas``: how many replicas each model's pool (and role) needs
    to keep its latency objectives at the load of the last ``window`` seconds."""

    window: float = Field(60.0, gt=0, description="seconds of arrivals the demand is "
                          "averaged over")
    headroom: float = Field(0.2, ge=0, lt=1, description="share of each replica's capacity "
                            "kept spare (bursts, a replica lost)")
    target_in_flight: int = Field(16, ge=1, description="requests a replica runs at once when "
                                  "no latency objective and fitted latency model bound it")
    scale_down_after: float = Field(300.0, ge=0, description="seconds the signal must have "
                                    "stayed lower before it falls (it rises at once)")
    ttft_ms: float | None = Field(None, gt=0, description="TTFT the fleet is sized for; unset "
                                  "= the model's objective.ttft_ms")
    tpot_ms: float | None = Field(None, gt=0, description="time per output token the fleet is "
                                  "sized for; unset = the model's objective.tpot_ms")
    scale_from_zero: ScaleFromZeroConfig = ScaleFromZeroConfig()
