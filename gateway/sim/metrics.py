"""What a simulated engine measures (``Meter``), and each dialect's Prometheus exposition of it.

The engine records raw facts once, in simulated seconds; the per-dialect tables below give them
the names, labels and buckets the real engine uses. The text is written by hand rather than
through prometheus_client because TGI (metrics-rs) and llama.cpp expose counters without
prometheus_client's ``_total`` rewriting of HELP/TYPE lines, and because observing a whole
response's inter-token latencies in one call keeps the ``instant`` profile cheap.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable, Iterable

# vLLM (vllm/v1/metrics/loggers.py)
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0]
VLLM_REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# SGLang (srt/observability/metrics_collector.py)
SGLANG_TTFT = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
SGLANG_ITL = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
              0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000]
SGLANG_E2E = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
              1200, 1800, 2400]
# TGI: 35 geometric buckets 0.0001 * 1.5^k for durations
TGI_DURATION = [0.0001 * 1.5 ** k for k in range(35)]


def one_two_five(limit: int) -> list[float]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to ``limit``."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > limit:
                return out
            out.append(float(value))
        exponent += 1


def linear(limit: int, n: int = 100) -> list[float]:
    return [limit * (k + 1) / n for k in range(n)]


class Hist:
    """A Prometheus histogram without locks; ``observe(v, n)`` records ``n`` equal samples."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n


@dataclass
class Meter:
    """Raw counts of one replica (times in simulated seconds)."""

    ttft: Hist
    itl: Hist
    e2e: Hist
    queue: Hist
    prompt_len: Hist
    gen_len: Hist
    time_per_token: Hist
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_received: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    failures: dict[str, int] = field(default_factory=dict)   # by TGI err label
    errors_injected: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    # context tokens computed (prompts, and what a preempted request recomputes), not the
    # decodes' one token each: what disaggregation moves to the prefill engines (not exported)
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    busy_slots: int = 0

    def first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def request_done(self, reason: str, prompt: int, generated: int, e2e: float, queued: float,
                     prefill: float) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.prompt_tokens += prompt
        self.generation_tokens += generated
        self.e2e.observe(e2e)
        self.queue.observe(queued)
        self.prompt_len.observe(prompt)
        self.gen_len.observe(generated)
        self.prefill_seconds += prefill
        self.decode_seconds += max(0.0, e2e - queued - prefill)
        if generated > 1:
            self.time_per_token.observe((e2e - queued - prefill) / (generated - 1))

    def failure(self, err: str) -> None:
        self.failures[err] = self.failures.get(err, 0) + 1


def make_meter(dialect: str, max_model_len: int) -> Meter:
    """A meter whose histograms use the buckets of ``dialect``'s real engine."""
    if dialect == "tgi":
        d, toks = TGI_DURATION, linear(max_model_len)
        return Meter(Hist(d), Hist(d), Hist(d), Hist(d), Hist(toks), Hist(toks), Hist(d))
    if dialect == "sglang":
        toks = one_two_five(max_model_len)
        return Meter(Hist(SGLANG_TTFT), Hist(SGLANG_ITL), Hist(SGLANG_E2E), Hist(SGLANG_E2E),
                     Hist(toks), Hist(toks), Hist(SGLANG_ITL))
    toks = one_two_five(max_model_len)
    return Meter(Hist(VLLM_TTFT), Hist(VLLM_ITL), Hist(VLLM_REQUEST), Hist(VLLM_REQUEST),
                 Hist(toks), Hist(toks), Hist(VLLM_ITL))


@dataclass
class Gauges:
    running: int
    waiting: int
    kv_used: int
    kv_capacity: int
    batch_tokens: int = 0


class Exposition:
    """Prometheus text format 0.0.4, written line by line."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    @staticmethod
    def _labels(labels: dict[str, str]) -> str:
        if not labels:
            return ""
        return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"

    def _head(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, kind: str, help_text: str, value: float,
               labels: dict[str, str] | None = None) -> None:
        self._head(name, kind, help_text)
        self.lines.append(f"{name}{self._labels(labels or {})} {float(value)}")

    def samples(self, name: str, kind: str, help_text: str,
                rows: Iterable[tuple[dict[str, str], float]]) -> None:
        self._head(name, kind, help_text)
        for labels, value in rows:
            self.lines.append(f"{name}{self._labels(labels)} {float(value)}")

    def histogram(self, name: str, help_text: str, hist: Hist,
                  labels: dict[str, str] | None = None) -> None:
        self._head(name, "histogram", help_text)
        base = dict(labels or {})
        cumulative = 0
        for bound, count in zip(hist.bounds, hist.counts):
            cumulative += count
            self.lines.append(f"{name}_bucket{self._labels({**base, 'le': repr(float(bound))})} {float(cumulative)}")
        self.lines.append(f"{name}_bucket{self._labels({**base, 'le': '+Inf'})} {float(hist.count)}")
        self.lines.append(f"{name}_count{self._labels(base)} {float(hist.count)}")
        self.lines.append(f"{name}_sum{self._labels(base)} {hist.sum}")

    def text(self) -> bytes:
        return ("\n".join(self.lines) + "\n").encode()


def _vllm(m: Meter, g: Gauges, model: str, x: Exposition) -> None:
    lab = {"model_name": model, "engine": "0"}
    x.sample("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", g.running, lab)
    x.sample("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", g.waiting, lab)
    # vLLM 0.32: why they wait (the simulated ones all wait for capacity)
    x.samples("vllm:num_requests_waiting_by_reason", "gauge", "Number of requests waiting by reason.",
              (({**lab, "reason": "capacity"}, g.waiting), ({**lab, "reason": "deferred"}, 0)))
    x.sample("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             g.kv_used / max(1, g.kv_capacity), lab)
    # The KV cache's size (the engine's real info metric has some forty labels; these matter)
    block = 16
    x.sample("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", 1.0,
             {"block_size": str(block), "enable_prefix_caching": "True", "engine": "0",
              "kv_cache_size_tokens": str(g.kv_capacity), "num_gpu_blocks": str(g.kv_capacity // block)})
    x.sample("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", m.prefix_queries, lab)
    x.sample("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", m.prefix_hits, lab)
    x.sample("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", m.preemptions, lab)
    x.sample("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", m.prompt_tokens, lab)
    x.sample("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", m.generation_tokens, lab)
    x.samples("vllm:request_success_total", "counter", "Count of successfully processed requests.",
              (({**lab, "finished_reason": r}, n) for r, n in m.finished.items()))
    x.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", m.ttft, lab)
    x.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", m.itl, lab)
    x.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", m.e2e, lab)
    x.histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", m.queue, lab)
    x.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", m.prompt_len, lab)
    x.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", m.gen_len, lab)


def _sglang(m: Meter, g: Gauges, model: str, x: Exposition) -> None:
    lab = {"model_name": model, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
    x.sample("sglang:num_running_reqs", "gauge", "The number of running requests.", g.running, lab)
    x.sample("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", g.waiting, lab)
    x.sample("sglang:token_usage", "gauge", "The token usage.", g.kv_used / max(1, g.kv_capacity), lab)
    x.sample("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.",
             m.prefix_hits / m.prefix_queries if m.prefix_queries else 0.0, lab)
    x.sample("sglang:gen_throughput", "gauge", "The generation throughput (token/s).",
             m.generation_tokens / m.decode_seconds if m.decode_seconds else 0.0, lab)
    x.sample("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.", m.prompt_tokens, lab)
    x.sample("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.", m.generation_tokens, lab)
    x.sample("sglang:num_requests_total", "counter", "Number of requests processed.", sum(m.finished.values()), lab)
    x.histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", m.ttft, lab)
    x.histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", m.itl, lab)
    x.histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", m.e2e, lab)


def _tgi(m: Meter, g: Gauges, model: str, x: Exposition) -> None:
    done = m.finished.get("stop", 0) + m.finished.get("length", 0)
    x.sample("tgi_request_count", "counter", "", m.requests_received)
    x.sample("tgi_request_success", "counter", "", done)
    x.samples("tgi_request_failure", "counter", "", (({"err": e}, n) for e, n in m.failures.items()))
    x.sample("tgi_queue_size", "gauge", "", g.waiting)
    x.sample("tgi_batch_current_size", "gauge", "", g.running)
    x.sample("tgi_batch_current_max_tokens", "gauge", "", g.kv_used)
    x.sample("tgi_batch_max_total_tokens", "gauge", "", g.kv_capacity)
    x.sample("tgi_batch_inference_count", "counter", "", m.steps, {"method": "decode"})
    x.histogram("tgi_request_duration", "", m.e2e)
    x.histogram("tgi_request_queue_duration", "", m.queue)
    x.histogram("tgi_request_mean_time_per_token_duration", "", m.time_per_token)
    x.histogram("tgi_request_input_length", "", m.prompt_len)
    x.histogram("tgi_request_generated_tokens", "", m.gen_len)


def _llamacpp(m: Meter, g: Gauges, model: str, x: Exposition) -> None:
    x.sample("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", m.prompt_tokens)
    x.sample("llamacpp:prompt_seconds_total", "counter", "Prompt process time", m.prefill_seconds)
    x.sample("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.", m.generation_tokens)
    x.sample("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time", m.decode_seconds)
    x.sample("llamacpp:n_decode_total", "counter", "Total number of llama_decode() calls", m.steps)
    x.sample("llamacpp:n_busy_slots_per_decode", "counter", "Average number of busy slots per llama_decode() call",
             m.busy_slots / m.steps if m.steps else 0.0)
    x.sample("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
             m.prompt_tokens / m.prefill_seconds if m.prefill_seconds else 0.0)
    x.sample("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
             m.generation_tokens / m.decode_seconds if m.decode_seconds else 0.0)
    x.sample("llamacpp:requests_processing", "gauge", "Number of requests processing.", g.running)
    x.sample("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", g.waiting)


def _lmdeploy(m: Meter, g: Gauges, model: str, x: Exposition) -> None:
    # lmdeploy/metrics/loggers.py (PrometheusStatLogger), the names and help texts it registers
    lab = {"model_name": model, "engine": "0"}
    x.sample("lmdeploy:num_requests_running", "gauge", "Number of requests in model execution batches.", g.running, lab)
    x.sample("lmdeploy:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", g.waiting, lab)
    x.sample("lmdeploy:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage.",
             g.kv_used / max(1, g.kv_capacity), lab)
    x.sample("lmdeploy:prompt_tokens_total", "counter", "Number of prefill tokens processed.", m.prompt_tokens, lab)
    x.sample("lmdeploy:generation_tokens_total", "counter", "Number of generation tokens processed.", m.generation_tokens, lab)
    x.histogram("lmdeploy:time_to_first_token_seconds", "Histogram of time to first token in seconds.", m.ttft, lab)
    x.histogram("lmdeploy:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", m.e2e, lab)
    x.histogram("lmdeploy:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", m.queue, lab)
    x.histogram("lmdeploy:request_prompt_tokens", "Number of prefill tokens processed.", m.prompt_len, lab)
    x.histogram("lmdeploy:request_generation_tokens", "Number of generation tokens processed.", m.gen_len, lab)


RENDERERS: dict[str, Callable[[Meter, Gauges, str, Exposition], None]] = {
    "vllm": _vllm, "sglang": _sglang, "tgi": _tgi, "llamacpp": _llamacpp, "lmdeploy": _lmdeploy,
}


def render(dialect: str, meter: Meter, gauges: Gauges, model: str,
           lora_info: Iterable[tuple[dict[str, str], float]] = ()) -> bytes:
    x = Exposition()
    RENDERERS[dialect](meter, gauges, model, x)
    rows = list(lora_info)
    if rows:  # vLLM with --enable-lora (gateway.sim.lora)
        x.samples("vllm:lora_requests_info", "gauge", "Running stats on lora requests.", rows)
    return x.text()
