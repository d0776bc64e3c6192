"""The ``canary`` section of the config: splits' header, shadow copies, output agreement and
the verdict's judge (docs/canary.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CanaryThresholds(_Strict):
    """How much worse the canary may be before a metric fails (when significantly so)."""

    ttft: float = Field(0.10, ge=0, description="relative rise of the median TTFT")
    itl: float = Field(0.10, ge=0, description="relative rise of the median inter-token latency")
    e2e: float = Field(0.10, ge=0, description="relative rise of the median e2e latency")
    tokens_per_s: float = Field(0.10, ge=0, description="relative drop of the median output "
                                "tokens/s per request")
    error_rate_points: float = Field(0.5, ge=0, description="rise of the error rate, in "
                                     "percentage points")


class CanaryAgreementConfig(_Strict):
    """Output agreement of a shadow pool's greedy pairs, judged
    (gateway/canary/agreement_metric.py): against a floor, or, with ``reference``, as a drop against the agreement of a reference
    shadow pool (the baseline's own engine: its greedy answers are not bit-stable either)."""

    floor: float = Field(0.9, ge=0, le=1, description="greedy agreement below it: fail when "
                         "significantly so, else marginal (without a reference)")
    prefix_floor: float = Field(0.95, ge=0, le=1, description="the same for prefix agreement "
                                "(the first prefix_chars characters identical)")
    prefix_chars: int = Field(64, ge=1, description="characters compared for prefix agreement")
    reference: str | None = Field(None, min_length=1, description="a pool shadowing the same "
                                  "pool as the canary: judge the canary's drop against its "
                                  "agreement instead of the floors")
    max_drop_points: float = Field(5.0, ge=0, le=100, description="with reference: how many "
                                   "points below the reference's agreement the canary may be")


class CanaryJudgeConfig(_Strict):
    """The verdict (gateway/canary/verdict.py; Kayenta's scoring)."""

    significance: float = Field(0.05, gt=0, lt=1, description="p-value below which a "
                                "difference counts")
    min_samples: int = Field(50, ge=2, description="requests per side below which the verdict "
                             "is 'insufficient data'")
    window: float = Field(1800.0, gt=0, description="seconds of recent requests judged "
                          "(default 30 min)")
    thresholds: CanaryThresholds = CanaryThresholds()
    agreement: CanaryAgreementConfig = CanaryAgreementConfig()
    critical: list[Literal["ttft", "itl", "e2e", "tokens_per_s", "error_rate", "agreement",
                           "prefix_agreement"]] = Field(
        default_factory=lambda: ["ttft", "error_rate", "agreement"], description="a failing "
        "critical metric fails the canary")
    pass_score: float = Field(75.0, ge=0, le=100)
    marginal_score: float = Field(50.0, ge=0, le=100)
    samples_per_pool: int = Field(5000, ge=10, description="recent requests kept per pool")
    fleet_samples_per_pool: int = Field(20000, ge=10, description="with redis_url: recent "
                                        "requests of the whole fleet kept per pool in Redis")


class CanaryConfig(_Strict):
    """Canary comparison between pools (docs/canary.md "Canary")."""

    allow_pool_header: bool = Field(True, description="x-gateway-pool: NAME forces a pool "
                                    "(testers); false = the header is ignored")
    max_shadow_in_flight: int = Field(64, ge=0, description="shadow copies in flight per "
                                      "instance; past it a copy is skipped (and counted)")
    agreement_max_chars: int = Field(65536, ge=1, description="generated text kept per side "
                                     "of a shadowed pair; a longer pair is dropped (counted)")
    disagreements_kept: int = Field(50, ge=0, description="disagreeing pairs kept per model "
                                    "for GET /admin/canary/{model}/disagreements")
    weights_sync_interval: float = Field(1.0, gt=0, description="with redis_url: seconds "
                                         "between reads of the shared pool weights")
    samples_sync_interval: float = Field(1.0, gt=0, le=60, description="with redis_url: "
                                         "seconds between sends of this instance's request "
                                         "samples to the fleet's store")
    judge: CanaryJudgeConfig = CanaryJudgeConfig()
    auto_rollback: bool = Field(False, description="a failing canary's weight is set to 0 "
                                "(logged, counted, shown in /admin); never a promotion")
    gate_token: str | None = Field(None, min_length=16, description="a read-only bearer "
                                   "token for the verdict alone (GET /admin/canary/{model}, "
                                   "the Flagger gate; also accepted as the webhook's "
                                   "metadata.token): pipelines need not hold admin_token")
    check_every: float = Field(60.0, gt=0, description="seconds between the guard's verdicts "
                               "(exported as llm_gateway_canary_verdict; rollbacks only with "
                               "auto_rollback)")
