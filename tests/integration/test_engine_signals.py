"""Engine load signals: each dialect's real /metrics text parsed; the scraper against real
simulated replicas, from the gateway's own start-up; failures leave signals to go stale."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from gateway.app import Gateway
from gateway.config import load_settings
from gateway import engines
from gateway.fleet.engine_signals import EngineSignals, SignalScraper
from gateway.fleet.replica import Replica
from gateway.sim.metrics import Gauges, make_meter, render
from support import free_port, sim, wait_until_async


@pytest.mark.parametrize("dialect,kv", [("vllm", 0.25), ("sglang", 0.25), ("tgi", 0.25),
                                        ("llamacpp", None)])
def test_each_dialects_exposition_gives_queue_running_and_kv(dialect: str,
                                                            kv: float | None) -> None:
    gauges = Gauges(running=7, waiting=3, kv_used=1000, kv_capacity=4000)
    text = render(dialect, make_meter(dialect, 4096), gauges, "m").decode()
    signals = engines.get(dialect).parse_signals(text, scraped_at=12.5, ledger_in_flight=4)
    assert (signals.running, signals.waiting, signals.kv_usage) == (7, 3, kv)
    assert signals.requests == 10 and signals.unexplained_requests() == 6
    assert signals.scraped_at == 12.5


def test_vllm_data_parallel_engines_add_up_and_old_kv_name_is_read() -> None:
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_running{engine="1",model_name="m"} 6.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0 1700000000000
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:num_requests_running_total{model_name="m"} 99.0
"""
    signals = engines.get("vllm").parse_signals(text)
    assert (signals.running, signals.waiting, signals.kv_usage) == (10, 1, 0.75)


def test_missing_or_garbage_metrics_give_no_signal() -> None:
    for text in ("", "not prometheus at all\n{}\n", "vllm:num_requests_running{x=\"1\"} NaNx\n",
                 "vllm:num_requests_running NaN\nvllm:kv_cache_usage_perc +Inf\n"):
        signals = engines.get("vllm").parse_signals(text)
        assert signals.requests is None and signals.kv_usage is None
        assert signals.unexplained_requests() == 0
    tgi = engines.get("tgi").parse_signals("tgi_batch_current_max_tokens 10\ntgi_batch_max_total_tokens 0\n")
    assert tgi.kv_usage is None  # no capacity, no fraction


def test_engine_counts_below_the_ledgers_never_count() -> None:
    signals = EngineSignals(running=2, waiting=0, scraped_at=0.0, ledger_in_flight=9)
    assert signals.unexplained_requests() == 0


async def _in_flight_on(url: str, session: aiohttp.ClientSession) -> asyncio.Task:
    """A request the simulated engine will hold (paced profile, long TTFT)."""
    body = {"model": "sim-model", "prompt": "hello", "max_tokens": 2, "stream": True}
    task = asyncio.create_task(session.post(f"{url}/v1/completions", json=body))

    async def running() -> bool:
        async with session.get(f"{url}/sim/state") as state:
            return (await state.json())["running"] >= 1

    await wait_until_async(running, 5, "the request running in the engine")
    return task


async def test_scraper_reads_a_real_replica_and_keeps_old_signals_on_failure() -> None:
    with sim("vllm", "sim-model", 4096, "--profile", "paced", "--ttft-ms", "3000") as url:
        replica = Replica(name="r0", url=url, engine="vllm", model="sim-model", pool="default")
        dead = Replica(name="r1", url=f"http://127.0.0.1:{free_port()}", engine="sglang",
                       model="sim-model", pool="default")
        plain = Replica(name="r2", url=url, engine="openai", model="sim-model", pool="default")
        async with aiohttp.ClientSession() as session:
            scraper = SignalScraper(lambda: [replica, dead, plain], session, lambda name: 0,
                                    interval=0.1, timeout=0.5)
            held = await _in_flight_on(url, session)
            before = time.monotonic()
            await scraper.scrape_all()
            assert replica.signals is not None
            assert replica.signals.running == 1 and replica.signals.unexplained_requests() == 1
            assert replica.signals.scraped_at >= before
            assert dead.signals is None and plain.signals is None  # unreachable; not scraped
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)

            old = replica.signals
            replica.url = f"http://127.0.0.1:{free_port()}"  # the engine goes away
            await scraper.scrape_all()
            assert replica.signals is old  # kept, aging: the policy ignores it once stale


async def test_the_gateway_scrapes_its_replicas_from_start_up(tmp_path) -> None:
    with sim("tgi", "sim-model", 4096) as url:
        settings = load_settings(models=[{"name": "sim-model", "replicas": [
            {"url": url, "engine": "tgi"}]}], scheduling={"signals_interval": 0.1})
        gateway = Gateway(settings)
        await gateway.start()
        try:
            replica = gateway.replicas[0]
            await wait_until_async(lambda: replica.signals is not None, 2.5, "the first scrape")
            assert (replica.signals.running, replica.signals.waiting) == (0, 0)
            assert replica.signals.kv_usage == 0.0
        finally:
            await gateway.stop()
