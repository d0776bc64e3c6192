"""LMDeploy (``lmdeploy serve api_server``): OpenAI's /v1/models, /v1/completions and
/v1/chat/completions.

From its sources (InternLM/lmdeploy ``lmdeploy/serve/openai/api_server.py``, ``protocol.py``,
``lmdeploy/metrics/loggers.py``) and its docs (``docs/en/advance/metrics.md``):

- ``/v1/models`` lists the model and its LoRA adapters (``--adapters``) as cards
  ``{id, object, created, owned_by: "lmdeploy", root, parent: null, permission}``: no window
  (configure ``max_model_len``; it is ``--session-len``), and adapters without ``parent``.
- A request names an adapter by ``model``.
- ``/metrics`` (``--enable-metrics`` in older versions): ``lmdeploy:num_requests_running``,
  ``lmdeploy:num_requests_waiting``, ``lmdeploy:gpu_cache_usage_perc`` (0-1), labelled
  ``model_name`` and ``engine`` (the DP rank).
- ``/v1/completions`` takes top_k, repetition_penalty and seed; not frequency_penalty, not
  ``n`` > 1; logprobs come as token texts without ids (so no TGI streams or details), and a
  stop word ends the text without being reported (so no TGI ``stop``). ``/v1/embeddings``
  answers "Unsupported".
"""

from __future__ import annotations

from types import MappingProxyType

from gateway.engines.base import Engine
from gateway.engines.signals import SignalMetrics


class LMDeploy(Engine):
    name = "lmdeploy"
    title = "LMDeploy"
    signal_metrics = SignalMetrics(("lmdeploy:num_requests_running",),
                                   ("lmdeploy:num_requests_waiting",),
                                   ("lmdeploy:gpu_cache_usage_perc",))
    tgi_parameters = MappingProxyType({
        "inputs": "prompt",
        "max_new_tokens": "max_tokens",
        "do_sample": "temperature",
        "temperature": "temperature",
        "top_p": "top_p",
        "top_k": "top_k",
        "repetition_penalty": "repetition_penalty",
        "seed": "seed",
        "return_full_text": "(the gateway prepends inputs)",
        "adapter_id": "model",
    })
    adapter_field = "model"


ENGINE = LMDeploy()
