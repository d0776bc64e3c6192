"""The simulator's KV cache events (gateway/sim/vllm_v1.py makes them, kv_publisher.py sends
them in vLLM 0.32's wire): the pure model, then a real replica on loopback sockets read raw
and by the gateway's own subscriber."""

from __future__ import annotations

import asyncio
import time

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from gateway.engines.vllm import decode_kv_batch
from gateway.kvcache.events import BlockRemoved, BlockStored, EventBatch
from gateway.kvcache.index import PromptKeys, ReplicaBlocks
from gateway.kvcache.subscriber import EventSubscriber
from gateway.sim.metrics import make_meter
from gateway.sim.profiles import Profile
from gateway.sim.scheduler import Sequence, block_hashes
from gateway.sim.vllm_v1 import V1Scheduler, external_hash
from tests.support import KV_EVENTS_PORT_OFFSET, KV_REPLAY_PORT_OFFSET, sim, wait_until_async

BS = 16
V1 = Profile(name="v1-test", kind="vllm-v1", summary="test", step_base_s=0.010,
             per_token_s=0.0001, per_seq_s=0.001, max_batched_tokens=64,
             kv_capacity_tokens=BS * 12, max_running_seqs=8, block_size=BS)
END = (-1).to_bytes(8, "big", signed=True)


def request(ids: list[int], out: int = 3, lora: str | None = None,
            salt: str | None = None) -> Sequence:
    return Sequence(len(ids), out, block_hashes=block_hashes(ids, BS, lora, salt),
                    prompt_ids=tuple(ids), lora_name=lora, cache_salt=salt)


def run(s: V1Scheduler, seqs: list[Sequence], events: list, now: float = 0.0) -> float:
    for q in seqs:
        s.add(q, now)
    for _ in range(1000):
        if s.idle():
            return now
        d, _ = s.step(now)
        now += d
        events.extend(s.take_kv_events())
    raise AssertionError("the requests did not finish")


def test_v1_model_announces_prompt_blocks_and_evictions_the_index_agrees() -> None:
    s = V1Scheduler(V1, make_meter("vllm", 4096), prefix_cache=True, kv_events=True)
    system = list(range(1000, 1040))  # 2.5 blocks shared by the first prompts
    prompts = [(system + list(range(i * 100, i * 100 + 30)), None, None) for i in range(3)]
    prompts += [(system + [7] * 20, "ada", None), (system + [7] * 20, None, "s1"),
                (list(range(5000, 5100)), None, None), (system + [9] * 17, None, None)]
    known: dict[int, tuple[int | None, tuple[int, ...], tuple | None]] = {}
    events: list = []
    now = 0.0
    for ids, lora, salt in prompts:
        hashes = block_hashes(ids, BS, lora, salt)
        for k, h in enumerate(hashes):
            extra = tuple(x for x in (lora, salt if k == 0 else None) if x) or None
            known[external_hash(h)] = (external_hash(hashes[k - 1]) if k else None,
                                       tuple(ids[k * BS:(k + 1) * BS]), extra)
        now = run(s, [request(ids, 20, lora, salt)], events, now)  # 20: output blocks too

    announced: set[int] = set()
    removed = 0
    for e in events:
        if isinstance(e, BlockStored):
            assert e.block_size == BS and e.medium == "GPU" and len(e.extra_keys) == len(e.block_hashes)
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                assert h in known, "only prompt blocks are announced"
                assert h not in announced
                want_parent, tokens, extra = known[h]
                assert parent == want_parent  # parents chain, within and across events
                assert e.token_ids[i * BS:(i + 1) * BS] == tokens
                assert e.extra_keys[i] == extra
                assert e.lora_name == (extra[0] if extra and extra[0] == "ada" else None)
                announced.add(h)
                parent = h
        else:
            assert isinstance(e, BlockRemoved) and e.medium == "GPU"
            (h,) = e.block_hashes
            assert h in announced, "only announced blocks are removed"
            announced.discard(h)
            removed += 1
    assert removed > 0, "the small cache evicted"
    assert announced == {external_hash(h) for h in s.pool.cached} & set(known)

    index = ReplicaBlocks(clock=lambda: now)
    index.apply(EventBatch(0.0, tuple(events)))
    queries = [p for p in prompts] + [(system + [1] * 40, None, None), (system, "ada", None),
                                      (system + [7] * 20, "bob", None)]
    for ids, lora, salt in queries:
        hashes = block_hashes(ids, BS, lora, salt)
        engine = len(s.pool.longest_hit(hashes, len(hashes)))
        assert index.matched(PromptKeys(ids, lora, salt), now) == engine, (ids[:3], lora, salt)
    assert any(index.matched(PromptKeys(ids, lora, salt), now) for ids, lora, salt in queries)


def test_v1_model_an_equal_block_computed_twice_is_announced_once() -> None:
    s = V1Scheduler(V1, make_meter("vllm", 4096), prefix_cache=True, kv_events=True)
    ids = list(range(40))
    events: list = []
    run(s, [request(ids), request(ids)], events)  # admitted in one step, both compute it
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert sorted(stored) == sorted(external_hash(h) for h in block_hashes(ids, BS))


def test_v1_model_without_events_builds_none() -> None:
    s = V1Scheduler(V1, make_meter("vllm", 4096), prefix_cache=True)
    assert s.pool.events is None
    run(s, [Sequence(40, 3, block_hashes=block_hashes(range(40), BS))], [])
    assert s.take_kv_events() == []
    with pytest.raises(ValueError):
        V1Scheduler(V1, make_meter("vllm", 4096), kv_events=True)  # needs the prefix cache


SIM = ("--profile", "llama3-8b-h100-vllm-v1", "--prefix-cache", "--speed", "50",
       "--mean-output-tokens", "4")


def _ports(base: str) -> tuple[str, str]:
    port = int(base.rsplit(":", 1)[1])
    return (f"tcp://127.0.0.1:{port + KV_EVENTS_PORT_OFFSET}",
            f"tcp://127.0.0.1:{port + KV_REPLAY_PORT_OFFSET}")


def _subscribed(context: zmq.Context, endpoint: str, topic: bytes = b"kv") -> zmq.Socket:
    """A SUB socket connected (and given a moment for its subscription to reach the PUB)."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
    sub.connect(endpoint)
    assert monitor.poll(5000), "the publisher is not there"
    sub.disable_monitor()
    monitor.close(0)
    time.sleep(0.2)
    return sub


def _tokens(base: str, prompt: str) -> list[int]:
    return httpx.post(f"{base}/tokenize", json={"model": "sim-model", "prompt": prompt}).json()["tokens"]


def _complete(base: str, prompt: str, **extra) -> None:
    r = httpx.post(f"{base}/v1/completions", timeout=30,
                   json={"model": "sim-model", "prompt": prompt, "max_tokens": 3, **extra})
    assert r.status_code == 200, r.text


def test_replica_publishes_vllm_batches_and_replays_them() -> None:
    with sim("vllm", "sim-model", 4096, *SIM, kv_events=True) as base:
        events_at, replay_at = _ports(base)
        context = zmq.Context()
        sub = _subscribed(context, events_at)
        try:
            first = "The quick brown fox jumps over the lazy dog. " * 6
            second = first + "And then it ran far away into the forest, never seen again."
            received = []
            for prompt in (first, second):
                _complete(base, prompt)
                assert sub.poll(5000), "no batch published"
                received.append(sub.recv_multipart())
            assert not sub.poll(300), "one batch per step with events"
            assert [len(m) for m in received] == [3, 3]
            assert [m[0] for m in received] == [b"kv", b"kv"]
            assert [int.from_bytes(m[1], "big") for m in received] == [0, 1]
            a, b = (decode_kv_batch(m[2]) for m in received)
            assert a.rank == 0 and not a.dropped and abs(a.ts - time.time()) < 30
            (stored_a,), (stored_b,) = a.events, b.events
            ids_a, ids_b = _tokens(base, first), _tokens(base, second)
            assert stored_a.parent_block_hash is None and stored_a.medium == "GPU"
            assert list(stored_a.token_ids) == ids_a[:len(ids_a) // 16 * 16]
            assert len(stored_a.block_hashes) == len(ids_a) // 16
            # the second prompt's new blocks chain from the first one's last
            assert stored_b.parent_block_hash == stored_a.block_hashes[-1]
            done = len(stored_a.block_hashes) * 16
            assert list(stored_b.token_ids) == ids_b[done:len(ids_b) // 16 * 16]

            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(replay_at)
            replies = []
            for start in (0, 1, 5):
                dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
                while True:
                    assert dealer.poll(5000), "no replay answer"
                    frames = dealer.recv_multipart()
                    replies.append((start, frames))
                    if frames[2] == END:
                        break
            dealer.close(0)
            assert [(s, f[2]) for s, f in replies] == [
                (0, received[0][1]), (0, received[1][1]), (0, END), (1, received[1][1]),
                (1, END), (5, END)]
            assert replies[0][1] == [b"", b"kv", received[0][1], received[0][2]]  # vLLM 0.32
            assert replies[2][1] == [b"", b"", END, b""]
            state = httpx.get(f"{base}/sim/state").json()["kv_events"]
            assert state["next_seq"] == 2 and state["buffered"] == 2
        finally:
            sub.close(0)
            context.term()


def test_positional_encoding_still_decodes() -> None:
    with sim("vllm", "sim-model", 4096, *SIM, "--kv-events-positional", "--kv-events-topic",
             "kv@7", kv_events=True) as base:
        context = zmq.Context()
        sub = _subscribed(context, _ports(base)[0], b"kv@7")
        try:
            prompt = "Once upon a time there was a simulated engine. " * 4
            _complete(base, prompt, model="sim-model")
            assert sub.poll(5000)
            topic, seq, payload = sub.recv_multipart()
            raw = msgpack.unpackb(payload, raw=False)
            assert topic == b"kv@7" and seq == bytes(8)
            assert isinstance(raw[1][0], list) and raw[1][0][0] == "BlockStored"
            (stored,) = decode_kv_batch(payload).events
            ids = _tokens(base, prompt)
            assert list(stored.token_ids) == ids[:len(ids) // 16 * 16]
        finally:
            sub.close(0)
            context.term()


def test_flags_that_cannot_publish_are_refused() -> None:
    import subprocess
    import sys

    for flags in (["--kv-events-port", "9"], ["--prefix-cache", "--kv-events-port", "9"],
                  ["--profile", "llama3-8b-h100-vllm-v1", "--kv-events-port", "9"],
                  ["--profile", "llama3-8b-h100-vllm-v1", "--prefix-cache", "--kv-replay-port", "9"]):
        out = subprocess.run([sys.executable, "-m", "gateway", "sim", "--dialect", "vllm", *flags],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "--kv-" in out.stderr, (flags, out.stderr)


async def test_gateway_subscriber_follows_the_replica_through_garbage_and_a_gap() -> None:
    with sim("vllm", "sim-model", 4096, *SIM, kv_events=True) as base:
        events_at, replay_at = _ports(base)
        context = zmq.asyncio.Context()
        blocks = ReplicaBlocks()
        subscriber = EventSubscriber("sim", events_at, replay_at, "kv", decode_kv_batch, blocks,
                                     context)
        task = asyncio.create_task(subscriber.run())
        stats = subscriber.stats
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:

            async def send(prompt: str, seq: int | None = None) -> list[int]:
                r = await client.post("/v1/completions", json={
                    "model": "sim-model", "prompt": prompt, "max_tokens": 2})
                assert r.status_code == 200, r.text
                if seq is not None:
                    await wait_until_async(lambda: stats.last_seq == seq, 5,
                                           lambda: f"seq {seq}; {stats}")
                return (await client.post("/tokenize", json={
                    "model": "sim-model", "prompt": prompt})).json()["tokens"]

            def held(ids: list[int]) -> int:
                return blocks.matched(PromptKeys(ids), time.monotonic())

            try:
                await wait_until_async(lambda: blocks.connected, 5, "connected")
                await asyncio.sleep(0.2)  # the subscription reaches the publisher
                ids = await send("Precise prefix routing needs the engine's own word. " * 5, 0)
                assert blocks.live(time.monotonic()) and held(ids) == len(ids) // 16 > 0

                r = await client.post("/sim/faults", json={"kv_garbage": 3})
                assert r.status_code == 200 and r.json()["kv_garbage"] == 3
                # each batch: a two-frame message before it; a numbered non-batch before
                # it (seq 2, the batch is 3); an unknown event inside it (seq 4)
                garbled = [await send(f"Garbage round {i}: " + "words and more words " * 6, seq)
                           for i, seq in ((1, 1), (2, 3), (3, 4))]
                assert stats.dropped["malformed message"] == 1
                assert stats.dropped["malformed batch"] == 1
                assert stats.dropped["unknown"] == 1
                assert all(held(g) == len(g) // 16 for g in garbled), "the good events applied"

                await client.post("/sim/faults", json={"kv_skip": 1})
                missed = await send("This batch never goes out live, only on replay. " * 5)
                assert held(missed) == 0
                after = await send("The next one shows the gap. " * 8, 6)
                assert stats.dropped["gap"] == 1 and stats.replays["ok"] == 1
                assert not stats.cleared, stats.cleared
                assert held(missed) == len(missed) // 16 and held(after) == len(after) // 16
                assert held(ids) == len(ids) // 16  # nothing was lost on the way
                state = (await client.get("/sim/state")).json()["kv_events"]
                assert state["garbage_sent"] == 3 and state["skipped"] == 1
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                context.term()
