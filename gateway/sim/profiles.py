"""Named hardware profiles: how fast one simulated GPU is, and where the numbers come from.

Four kinds of profile:

- ``batched``: the continuous-batching model of ``engine.py`` (step time = base + per running
  decode sequence + per prefill token; KV capacity in tokens; max running sequences).
- ``vllm-v1``: vLLM V1's scheduler as written (``vllm_v1.py``: one token budget shared by
  running and waiting requests, KV in blocks, prefix caching by block hash, preemption by
  recompute; step time = base + per token scheduled + per request scheduled).
- ``paced``: a fixed time to first token and a fixed inter-token delay per request, no batching
  model; cheap, for relay benchmarks that want real-looking pacing without queueing effects.
- ``instant``: no delays at all and the least CPU per token (a whole stream goes out in one
  write); for measuring the gateway's own overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

Kind = Literal["batched", "vllm-v1", "paced", "instant"]
SCHEDULED_KINDS = ("batched", "vllm-v1")  # kinds with a batching scheduler and a KV cache


@dataclass(frozen=True)
class Profile:
    name: str
    kind: Kind
    summary: str
    source: str = ""
    # batched: seconds per engine step = step_base_s + decode_per_seq_s * decoding sequences
    #          + prefill_per_token_s * prompt tokens prefilled in the step
    step_base_s: float = 0.0
    decode_per_seq_s: float = 0.0
    prefill_per_token_s: float = 0.0
    # vllm-v1: seconds per engine step = step_base_s + per_token_s * tokens scheduled in the
    #          step (prefill chunks and decodes alike) + per_seq_s * requests scheduled
    per_token_s: float = 0.0
    per_seq_s: float = 0.0
    max_batched_tokens: int = 8192      # chunked-prefill token budget per step
    kv_capacity_tokens: int = 1 << 30   # KV cache size in tokens
    max_running_seqs: int = 256         # vLLM max_num_seqs / TGI max_batch_size / llama.cpp slots
    block_size: int = 16                # prefix-cache block (vLLM's default block size)
    # paced
    ttft_s: float = 0.0
    itl_s: float = 0.0
    # output length when the request does not fix it (uniform in [mean/2, 3*mean/2])
    mean_output_tokens: int = 128

    def with_overrides(self, **overrides: Any) -> "Profile":
        """This profile with the non-None overrides applied (CLI flags win over the profile)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def kv_tokens(gpu_bytes: float, memory_utilization: float, weight_bytes: float,
              activation_bytes: float, layers: int, kv_heads: int, head_dim: int,
              dtype_bytes: int = 2) -> int:
    """KV-cache capacity in tokens, by vLLM's memory accounting (K and V per layer per token)."""
    per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    return int((gpu_bytes * memory_utilization - weight_bytes - activation_bytes) // per_token)


# Llama-3-8B: 32 layers, 8 KV heads (GQA), head_dim 128, bf16 -> 128 KiB of KV per token.
# A100-80GB at vLLM's gpu_memory_utilization=0.9, 16.06 GB of weights, ~4 GB activations and
# CUDA graphs -> ~434k tokens (vLLM logs ~27k blocks of 16 for this pair).
LLAMA3_8B_A100_KV = kv_tokens(80 * 2**30, 0.9, 16.06e9, 4e9, layers=32, kv_heads=8, head_dim=128)

PROFILES: dict[str, Profile] = {
    "llama3-8b-a100": Profile(
        name="llama3-8b-a100", kind="batched",
        summary="Llama-3-8B (bf16) on one A100-80GB, vLLM-like continuous batching",
        source=(
            "BentoML, 'Benchmarking LLM Inference Backends' (2024-06-05): Llama-3-8B on one "
            "A100-80GB at 10/50/100 concurrent users; vLLM about 2,300-2,500 output tokens/s at "
            "100 users with the lowest TTFT (low tens of ms at 10 users), LMDeploy up to ~4,000. "
            "Single-stream decode ~8-10 ms/token (16 GB of weights read per step at ~2 TB/s). "
            "KV capacity from the memory math above; max_num_seqs 256 and "
            "max_num_batched_tokens 8192 are vLLM V1 defaults. Calibrated with "
            "`python -m gateway.sim.calibrate` (prompt 512, output 256, closed loop)."
        ),
        step_base_s=0.0085, decode_per_seq_s=0.00023, prefill_per_token_s=0.00005,
        max_batched_tokens=8192, kv_capacity_tokens=LLAMA3_8B_A100_KV, max_running_seqs=256,
    ),
    "llama3-8b-a100-fast": Profile(
        name="llama3-8b-a100-fast", kind="batched",
        summary="the same GPU under the fastest engine of the same benchmark (LMDeploy-like)",
        source=(
            "BentoML 2024-06-05 (above): LMDeploy reached ~4,000 output tokens/s at 100 users on "
            "Llama-3-8B / A100-80GB. Same memory math; cheaper per-sequence decode step. Useful "
            "as a canary that is faster than the stable pool."
        ),
        step_base_s=0.0080, decode_per_seq_s=0.00009, prefill_per_token_s=0.00004,
        max_batched_tokens=8192, kv_capacity_tokens=LLAMA3_8B_A100_KV, max_running_seqs=256,
    ),
    "llama3-8b-h100-kvpoor": Profile(
        name="llama3-8b-h100-kvpoor", kind="batched",
        summary="Llama-3-8B (bf16) on one H100-80GB given a third of its memory: faster "
                "steps, a sixth of the A100 profile's KV cache",
        source=(
            "The second timing model of the scheduling benchmark, shaped unlike the first: "
            "H100 HBM3 at ~3.35 TB/s reads the 16 GB of weights in ~4.8 ms (step base 5.5 ms, "
            "A100 8.5), per-sequence decode and per-token prefill ~2-2.5x cheaper (H100 bf16 "
            "~990 TFLOPS vs 312); gpu_memory_utilization 0.35 (a GPU shared with another "
            "model) leaves ~10 GB for KV: ~76k tokens, so long prompts and bursts meet a full "
            "cache. Not calibrated against a published run: a different engine shape on "
            "purpose, so weights tuned on one profile are checked on another."
        ),
        step_base_s=0.0055, decode_per_seq_s=0.00012, prefill_per_token_s=0.00002,
        max_batched_tokens=8192, max_running_seqs=256,
        kv_capacity_tokens=kv_tokens(80 * 2**30, 0.35, 16.06e9, 4e9, layers=32, kv_heads=8,
                                     head_dim=128),
    ),
    "llama3-8b-h100-vllm-v1": Profile(
        name="llama3-8b-h100-vllm-v1", kind="vllm-v1",
        summary="Llama-3-8B (bf16) on one H100-80GB under vLLM V1's own scheduler (token "
                "budget, KV blocks, prefix hashes, recompute): the held-out timing model",
        source=(
            "Scheduling rules from vLLM 0.32's scheduler and KV-cache manager as written "
            "(gateway/sim/vllm_v1.py cites the lines); its H100 defaults for the API server: "
            "max_num_batched_tokens 8192, max_num_seqs 1024 (engine/arg_utils.py), block 16. "
            "Step-time shape fitted on the real vLLM 0.32 CPU engine "
            "(benchmarks/fit_v1_step.py, 2026-11-25, 9 rounds, least over rounds): "
            "5.009 ms + 0.0295 ms per token + 0.1091 ms per request scheduled (RMS relative "
            "residual 12.8%). Speed scaled by one factor (x1.259) so that one sequence's "
            "decode step is 6.48 ms, the TPOT p50 at concurrency 1 of Llama-3.1-8B-Instruct "
            "fp16 under vLLM 0.21 on one H100-80GB-HBM3 (InferenceBench 'concurrency sweep' "
            "recipe, 2026-05-16). KV: the A100-80GB memory math (same 80 GB)."
        ),
        step_base_s=0.006305, per_token_s=0.0000371, per_seq_s=0.0001373,
        max_batched_tokens=8192, kv_capacity_tokens=LLAMA3_8B_A100_KV, max_running_seqs=1024,
    ),
    "paced": Profile(
        name="paced", kind="paced",
        summary="fixed TTFT and inter-token delay per request, no batching (cheap, for relays)",
        source="defaults chosen to look like one A100 stream: 30 ms TTFT, 10 ms per token",
        ttft_s=0.030, itl_s=0.010,
    ),
    "instant": Profile(
        name="instant", kind="instant",
        summary="no delays; whole responses in one write; for measuring the gateway's overhead",
        source="none (a load source, not a model of hardware)",
    ),
}

DEFAULT_PROFILE = "llama3-8b-a100"


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
