"""LoRA adapter affinity: vLLM's lora_requests_info read from its /metrics text, and the
replicas preferred for an adapter (running it, then a free adapter slot, else all)."""

from __future__ import annotations

import time

from gateway.balance.adapter_affinity import prefer_adapter
from gateway.engines import vllm
from gateway.engines.vllm import parse_lora_info
from gateway.fleet.replica import EngineSignals, Replica

TEXT = """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql, chat",waiting_lora_adapters="fin"} 1.8e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.75e+09
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def test_the_newest_lora_info_sample_counts() -> None:
    assert parse_lora_info(TEXT) == (frozenset({"sql", "chat"}), frozenset({"fin"}), 2)
    signals = vllm.ENGINE.parse_signals(TEXT)
    assert signals.running == 3 and signals.max_lora == 2
    assert signals.lora_running == {"sql", "chat"} and signals.lora_waiting == {"fin"}


def test_no_lora_info_or_garbage_is_none() -> None:
    assert parse_lora_info("vllm:num_requests_running 1\n") is None
    assert parse_lora_info('vllm:lora_requests_info{max_lora="x"} nope\n') is None
    assert vllm.ENGINE.parse_signals("").lora_running is None
    idle = parse_lora_info('vllm:lora_requests_info{max_lora="1",running_lora_adapters="",'
                           'waiting_lora_adapters=""} 5\n')
    assert idle == (frozenset(), frozenset(), 1)


def _replica(name: str, running: set[str] | None, max_lora: int | None = 1,
             age: float = 0.0) -> Replica:
    replica = Replica(name, f"http://{name}", "vllm", "m", "default")
    if running is not None:
        replica.signals = EngineSignals(scraped_at=time.monotonic() - age,
                                        lora_running=frozenset(running),
                                        lora_waiting=frozenset(), max_lora=max_lora)
    return replica


def test_running_first_then_a_free_slot_then_all() -> None:
    has, free, full, silent = (_replica("has", {"sql"}), _replica("free", set()),
                               _replica("full", {"x"}), _replica("silent", None))
    assert prefer_adapter([has, free, full, silent], "sql", 3.0) == [has]
    assert prefer_adapter([free, full, silent], "sql", 3.0) == [free, silent]
    full2 = _replica("full2", {"y"})
    assert prefer_adapter([full, full2], "sql", 3.0) == [full, full2]  # every slot taken
    unlimited = _replica("unlimited", {"x", "y"}, max_lora=None)
    assert prefer_adapter([full, unlimited], "sql", 3.0) == [unlimited]
    # not an adapter, or stale signals: no preference
    assert prefer_adapter([has, full], None, 3.0) == [has, full]
    stale = _replica("stale", {"sql"}, age=10.0)
    assert prefer_adapter([stale, full], "sql", 3.0) == [stale]  # stale counts as silent
