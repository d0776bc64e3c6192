"""LoRA adapter affinity: among the replicas that may take a request for an adapter, prefer
those whose engine has it in its running batch, then those with a free adapter slot
(``--max-loras``), as vLLM reports them (``vllm:lora_requests_info``, gateway/fleet/
engine_signals.py); the balancing policy then picks among the preferred as usual. A replica
whose engine says nothing (fresh) counts as having a free slot. Loading an adapter into a
full batch makes its requests wait inside the engine, where the balancer cannot see them.
"""

from __future__ import annotations

import time

from gateway.fleet.replica import Replica


def prefer_adapter(candidates: list[Replica], adapter: str | None,
                   signals_max_age: float) -> list[Replica]:
    if adapter is None or len(candidates) < 2:
        return candidates
    now = time.monotonic()
    loaded, free = [], []
    for replica in candidates:
        signals = replica.signals
        if (signals is None or signals.lora_running is None
                or not signals.fresh(now, signals_max_age)):
            free.append(replica)
        elif adapter in signals.lora_running:
            loaded.append(replica)
        elif signals.max_lora is None or len(signals.lora_running) < signals.max_lora:
            free.append(replica)
    return loaded or free or candidates
