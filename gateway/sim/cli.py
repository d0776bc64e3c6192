"""Run one simulated GPU engine replica (one process = one replica = one GPU).

It speaks the wire format of a real engine (vLLM, TGI, SGLang or llama.cpp: routes, JSON
shapes, SSE bytes, error wording, Prometheus names), counts prompt tokens exactly with the
model's tokenizer and chat template, and paces tokens with a continuous-batching model of one
GPU (KV capacity, running-sequence limit, chunked prefill, optional prefix cache).

profiles (--profile):
  llama3-8b-a100       Llama-3-8B on one A100-80GB, vLLM-like (default; ~2,400 tok/s at 100 users)
  llama3-8b-a100-fast  same GPU, the fastest engine of the same benchmark (~4,000 tok/s)
  llama3-8b-h100-kvpoor  H100 steps with a sixth of the KV cache (a second shape)
  llama3-8b-h100-vllm-v1 vLLM V1's own scheduler (token budget, KV blocks, prefix hashes,
                       recompute), step time fitted on a real vLLM CPU engine
  paced                fixed TTFT (--ttft-ms) and inter-token delay (--itl-ms), no batching
  instant              no delays, least CPU per token (for measuring a gateway's own overhead)

simulator-only endpoints:
  GET  /sim/state    {"running", "waiting", "kv_used_tokens", "kv_capacity_tokens",
                      "completed_total", "aborted_total", "errors_injected_total", "in_flight", ...}
  GET  /sim/faults   the current faults
  POST /sim/faults   change faults at run time, e.g. {"fail_health": true} or
                     {"error_rate": 0.5, "error_status": 503} or {"stall_after": null}
                     (names as the fault flags below, with _ for -); with KV events also
                     {"kv_garbage": N} (N malformed messages among the next batches) and
                     {"kv_skip": N} (the next N batches left out of the live stream only)

Times in the engine's metrics are simulated seconds (wall seconds x --speed).

examples:
  llm-gateway sim --dialect vllm --port 8001 --model llama-3-8b --max-model-len 8192
  llm-gateway sim --dialect tgi --port 8002 --model llama-3-8b --max-model-len 8192 --profile paced
  llm-gateway sim --dialect vllm --port 8003 --model m --max-model-len 2048 --speed 20 \\
      --kv-capacity-tokens 4096 --prefix-cache
  llm-gateway sim --dialect vllm --port 8004 --profile llama3-8b-h100-vllm-v1 --prefix-cache \\
      --kv-events-port 9004 --kv-replay-port 10004     # KV cache events, as vLLM publishes them
  llm-gateway sim --dialect vllm --port 8005 --role prefill   # disaggregated: a prefill engine
  llm-gateway sim --dialect vllm --port 8006 --role decode    # ... and a decode engine
"""

from __future__ import annotations

import argparse

from gateway.sim.kv_connector import ROLES, KvConnector
from gateway.sim.profiles import DEFAULT_PROFILE, PROFILES, Profile

DIALECTS = ("vllm", "tgi", "sglang", "llamacpp", "lmdeploy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("replica")
    server.add_argument("--dialect", required=True, choices=DIALECTS, help="engine wire format to speak")
    server.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    server.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    server.add_argument("--model", default="sim-model", help="served model name (default sim-model)")
    server.add_argument("--alias", action="append", default=[], metavar="NAME",
                        help="vllm: one more served name (as --served-model-name a b); repeatable")
    server.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="vllm: LoRA adapters served, listed on /v1/models with parent = "
                             "--model; each answers with its own text")
    server.add_argument("--max-loras", type=int, default=1,
                        help="vllm: adapters in one batch (vllm:lora_requests_info max_lora)")
    server.add_argument("--runner", choices=("generate", "pooling"), default="generate",
                        help="vllm: pooling = an embedding engine (/v1/embeddings, /pooling, "
                             "/classify, /score, /rerank), no generation routes")
    server.add_argument("--allow-runtime-lora", action="store_true",
                        help="vllm: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                             "(VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    server.add_argument("--max-model-len", type=int, default=8192,
                        help="context window in tokens (vLLM max_model_len, TGI max_total_tokens, "
                             "SGLang context_length, llama.cpp per-slot n_ctx; default 8192)")
    server.add_argument("--tokenizer", metavar="DIR",
                        help="model directory with tokenizer.json and a chat template "
                             "(default: the built-in small model directory)")
    server.add_argument("--text-seed", type=int, default=0,
                        help="mixed into the generated text (not its length): replicas with different "
                             "seeds answer the same prompt differently, as another model version would "
                             "(canary agreement); default 0, the same text as every other replica")
    server.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                        help="uvicorn log level (default warning; access log is always off)")

    timing = parser.add_argument_group("timing model")
    timing.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES),
                        help=f"hardware profile (default {DEFAULT_PROFILE})")
    timing.add_argument("--speed", type=float, default=1.0,
                        help="run the simulated clock X times faster than real time (default 1)")
    timing.add_argument("--mean-output-tokens", type=int,
                        help="mean output length when a request sets no max_tokens (profile default 128)")
    timing.add_argument("--eos-before-max", action="store_true",
                        help="end at a natural length (around --mean-output-tokens) even when "
                             "max_tokens is set, which then only caps it, as with real models "
                             "(default: exactly max_tokens)")
    timing.add_argument("--kv-capacity-tokens", type=int, help="override the KV-cache size in tokens")
    timing.add_argument("--max-running-seqs", type=int,
                        help="override the max running sequences (vLLM max_num_seqs, llama.cpp slots)")
    timing.add_argument("--max-batched-tokens", type=int, help="override the per-step token budget")
    timing.add_argument("--step-base-ms", type=float, help="override the fixed cost of one engine step")
    timing.add_argument("--decode-per-seq-ms", type=float, help="override the step cost per decoding sequence")
    timing.add_argument("--prefill-per-token-ms", type=float, help="override the step cost per prefill token")
    timing.add_argument("--per-token-ms", type=float,
                        help="vllm-v1 profiles: override the step cost per token scheduled")
    timing.add_argument("--per-seq-ms", type=float,
                        help="vllm-v1 profiles: override the step cost per request scheduled")
    timing.add_argument("--ttft-ms", type=float, help="paced profile: time to first token")
    timing.add_argument("--itl-ms", type=float, help="paced profile: delay between tokens")
    timing.add_argument("--prefix-cache", action="store_true",
                        help="cache prompt blocks (LRU, bounded by KV capacity); cached prefixes skip prefill")

    kv = parser.add_argument_group(
        "KV cache events (vLLM --kv-events-config; with --dialect vllm, a vllm-v1 profile and "
        "--prefix-cache)")
    kv.add_argument("--kv-events-port", type=int, metavar="P",
                    help="publish the blocks the prefix cache stores and evicts on a ZMQ PUB "
                         "socket bound on tcp://HOST:P, in vLLM 0.32's wire (topic, sequence "
                         "number, msgpack batch); one batch per engine step with events. "
                         "Fleet helpers use HTTP port + 1000 (the gateway's kv_events.port_offset)")
    kv.add_argument("--kv-replay-port", type=int, metavar="R",
                    help="with --kv-events-port: a ROUTER socket on tcp://HOST:R answering "
                         "replay requests from the last 10,000 batches (HTTP port + 2000 by "
                         "the gateway's replay_port_offset)")
    kv.add_argument("--kv-events-topic", default="kv",
                    help="the topic frame of every message (default kv)")
    kv.add_argument("--kv-events-positional", action="store_true",
                    help="the older event encoding: each event a positional array "
                         "[\"BlockStored\", ...] instead of a map with \"type\"")

    pd = parser.add_argument_group(
        "disaggregated prefill/decode (vLLM --kv-transfer-config with NixlConnector; "
        "--dialect vllm)")
    pd.add_argument("--role", choices=ROLES,
                    help="prefill (kv_producer): a request with kv_transfer_params."
                         "do_remote_decode answers, after its one token, where its KV waits; "
                         "decode (kv_consumer): a request with the kv_transfer_params a prefill "
                         "answered loads the prompt's KV instead of computing it; both "
                         "(kv_both). Default: no KV connector (kv_transfer_params ignored)")
    pd.add_argument("--kv-transfer-ms-per-block", type=float, default=0.08, metavar="MS",
                    help="with --role: simulated time to load one KV block from the prefill "
                         "engine (default 0.08: 16 tokens of an 8B model's KV, ~2 MB, at "
                         "~25 GB/s)")

    wire = parser.add_argument_group("wire variants")
    wire.add_argument("--vllm-flat-errors", action="store_true",
                      help="vLLM <= 0.10.0: flat error body {\"object\":\"error\",...} and the old "
                           "context-length wording")
    wire.add_argument("--tgi-sse-no-space", action="store_true", help="TGI < 2.1: SSE lines 'data:{...}'")
    wire.add_argument("--tgi-version",
                      help="TGI: the version to emulate and report in /info (default 3.3.6); older ones "
                           "lack what they lacked: /v1/completions (< 1.4.4), /v1/chat/completions "
                           "(< 1.4.0), the space in 'data: ' (< 2.1.0), details.input_length in "
                           "streams (< 2.3.0)")
    wire.add_argument("--no-stream-usage", action="store_true",
                      help="ignore stream_options.include_usage: OpenAI streams carry no usage "
                           "(as engines without it do)")
    wire.add_argument("--event-writes", action="store_true",
                      help="write each SSE event on its own, as vLLM does (usage chunk and [DONE] "
                           "after the last token, separately); default: all ready events in one write")
    wire.add_argument("--event-gap-ms", type=float, default=0.0,
                      help="with --event-writes: pause between two writes (default 0: just yield)")
    wire.add_argument("--stream-interval", type=int, default=1,
                      help="vLLM: a streamed chunk every N tokens after the first (the request's "
                           "stream_interval can raise it), several tokens to a chunk as vLLM "
                           "writes them (default 1)")
    wire.add_argument("--max-concurrent-requests", type=int, default=128,
                      help="TGI: 429 'Model is overloaded' past this many requests in flight (default 128)")
    wire.add_argument("--max-input-tokens", type=int,
                      help="TGI: max_input_tokens (default --max-model-len minus 1)")

    faults = parser.add_argument_group("faults (also settable at run time: POST /sim/faults)")
    faults.add_argument("--fail-health", action="store_true", help="/health answers 503 in the dialect's shape")
    faults.add_argument("--error-rate", type=float, default=0.0,
                        help="share of generation requests answered with --error-status (0..1)")
    faults.add_argument("--error-status", type=int, default=500, choices=(500, 503),
                        help="status of injected errors (default 500)")
    faults.add_argument("--stall-after", type=int, metavar="N",
                        help="stop emitting after N tokens and keep the connection open")
    faults.add_argument("--drop-after", type=int, metavar="N", help="close the connection abruptly after N tokens")
    faults.add_argument("--error-after", type=int, metavar="N",
                        help="end each stream with the engine's error event after N tokens")
    faults.add_argument("--break-rate", type=float, default=0.0, metavar="P",
                        help="break this share of streams at a random point, a random way "
                             "(dropped, stalled or an error event)")
    faults.add_argument("--slowdown", type=float, default=1.0, help="multiply every simulated delay by X")
    faults.add_argument("--fault-seed", type=int, default=0, help="seed of the --error-rate coin (default 0)")


def build_config(args: argparse.Namespace):
    """The replica's configuration from parsed flags (raises ValueError on inconsistent flags)."""
    import random

    from gateway.sim.model_dir import builtin_model_dir
    from gateway.sim.sim_config import VERSION, SimConfig
    from gateway.sim.faults import Faults, check
    from gateway.sim.profiles import SCHEDULED_KINDS, get_profile
    from gateway.tokens import load_tokenizer

    ms = lambda v: None if v is None else v / 1000.0  # noqa: E731
    profile = get_profile(args.profile).with_overrides(
        mean_output_tokens=args.mean_output_tokens, kv_capacity_tokens=args.kv_capacity_tokens,
        max_running_seqs=args.max_running_seqs, max_batched_tokens=args.max_batched_tokens,
        step_base_s=ms(args.step_base_ms), decode_per_seq_s=ms(args.decode_per_seq_ms),
        prefill_per_token_s=ms(args.prefill_per_token_ms), per_token_s=ms(args.per_token_ms),
        per_seq_s=ms(args.per_seq_ms), ttft_s=ms(args.ttft_ms), itl_s=ms(args.itl_ms))
    if args.max_model_len < 2:
        raise ValueError("--max-model-len must be at least 2")
    if args.speed <= 0:
        raise ValueError("--speed must be > 0")
    if profile.kind in SCHEDULED_KINDS and profile.kv_capacity_tokens < args.max_model_len + 1:
        raise ValueError("--kv-capacity-tokens must be at least --max-model-len + 1 "
                         "(one full-length sequence must fit)")
    if profile.max_running_seqs < 1 or profile.max_batched_tokens < 1:
        raise ValueError("--max-running-seqs and --max-batched-tokens must be >= 1")
    faults = Faults(fail_health=args.fail_health, error_rate=args.error_rate, error_status=args.error_status,
                    stall_after=args.stall_after, drop_after=args.drop_after,
                    error_after=args.error_after, break_rate=args.break_rate, slowdown=args.slowdown,
                    rng=random.Random(args.fault_seed))
    check(faults.as_dict())
    kv_events = _kv_events(args, profile.kind)
    tokenizer_dir = str(args.tokenizer or builtin_model_dir())
    return SimConfig(
        dialect=args.dialect, model=args.model, max_model_len=args.max_model_len, profile=profile,
        tokenizer=load_tokenizer(tokenizer_dir), tokenizer_dir=tokenizer_dir, speed=args.speed,
        prefix_cache=args.prefix_cache, faults=faults, vllm_flat_errors=args.vllm_flat_errors,
        tgi_sse_no_space=args.tgi_sse_no_space, max_concurrent_requests=args.max_concurrent_requests,
        max_input_tokens=args.max_input_tokens, no_stream_usage=args.no_stream_usage,
        eos_before_max=args.eos_before_max,
        event_writes=args.event_writes, event_gap_s=max(args.event_gap_ms, 0.0) / 1000.0,
        stream_interval=max(args.stream_interval, 1),
        tgi_version=args.tgi_version or VERSION["tgi"], text_seed=args.text_seed,
        aliases=args.alias, lora_modules=_lora_modules(args.lora_modules), max_loras=args.max_loras,
        runtime_lora=args.allow_runtime_lora, runner=args.runner, kv_events=kv_events,
        kv_connector=_kv_connector(args, profile))


def _kv_connector(args: argparse.Namespace, profile: Profile) -> KvConnector | None:
    """The disaggregated-serving connector, or None without --role."""
    if args.role is None:
        return None
    if args.dialect != "vllm":
        raise ValueError("--role needs --dialect vllm (its kv_transfer_params)")
    if args.kv_transfer_ms_per_block < 0:
        raise ValueError("--kv-transfer-ms-per-block must be >= 0")
    return KvConnector(args.role, profile.block_size, args.kv_transfer_ms_per_block / 1000.0,
                       host=args.host, port=args.port + 3000)


def _kv_events(args: argparse.Namespace, kind: str):
    """The KV event publisher's configuration, or None without --kv-events-port."""
    from gateway.sim.kv_publisher import PublisherConfig, tcp

    if args.kv_events_port is None:
        if args.kv_replay_port is not None:
            raise ValueError("--kv-replay-port goes with --kv-events-port")
        return None
    if args.dialect != "vllm" or kind != "vllm-v1" or not args.prefix_cache:
        raise ValueError("--kv-events-port needs --dialect vllm, a vllm-v1 --profile (e.g. "
                         "llama3-8b-h100-vllm-v1) and --prefix-cache: the events are vLLM's, "
                         "made by its V1 block pool's prefix cache")
    for flag, port in (("--kv-events-port", args.kv_events_port),
                       ("--kv-replay-port", args.kv_replay_port)):
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"{flag} must be a TCP port (1-65535)")
    if args.kv_replay_port is not None and args.kv_replay_port == args.kv_events_port:
        raise ValueError("--kv-replay-port must differ from --kv-events-port")
    replay = tcp(args.host, args.kv_replay_port) if args.kv_replay_port is not None else None
    return PublisherConfig(tcp(args.host, args.kv_events_port), replay, args.kv_events_topic,
                           args.kv_events_positional)


def _lora_modules(specs: list[str]) -> dict[str, str]:
    """``NAME=PATH`` (vLLM's form) or a bare NAME (its path is then made up)."""
    modules = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not name:
            raise ValueError(f"--lora-modules {spec!r}: NAME=PATH")
        modules[name] = path or f"/adapters/{name}"
    return modules


def run(args: argparse.Namespace) -> int:
    import sys

    import uvicorn

    from gateway.sim.app import SimApp
    from gateway.sim.asgi import quiet_injected_drops
    from gateway.sim.faults import FaultError

    try:
        cfg = build_config(args)
    except (ValueError, FaultError, FileNotFoundError) as exc:
        print(f"llm-gateway sim: error: {exc}", file=sys.stderr)
        return 2
    quiet_injected_drops()
    uvicorn.run(SimApp(cfg), host=args.host, port=args.port, loop="uvloop", http="httptools",
                access_log=False, log_level=args.log_level, lifespan="on")
    return 0
