"""What a migration adds to a stream's gap, against the new replica's prefill, at long contexts.

    python -m benchmarks.migration_gap [--prompt-tokens 8000] [--break-after 96]
                                       [--output 192] [--rounds 5] [--out FILE.json]

Two simulated vLLM replicas with vLLM V1's timing (``--profile llama3-8b-h100-vllm-v1``: its
scheduler, chunked prefill and step time, no prefix cache) behind one gateway. A streamed
completion with a prompt of ``--prompt-tokens`` tokens goes to the first replica, which drops
its connection after ``--break-after`` tokens; the gateway continues it on the second. The
client times every token: the **gap** is from the last token before the break to the first
after it. Beside it, in the same round, the second replica is sent the continuation's own
prompt (the prompt and the tokens so far, as ids) directly, and its TTFT is the **prefill**
the continuation had to pay. Each round: gap, prefill, the gap less the prefill (what the
gateway added: detection, placement, the request) and the stream's usual inter-token gap.
Rounds alternate which replica breaks. Loopback only; every request has a timeout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from benchmarks.harness import HOST, free_port, machine_info, start, stop, wait_ready

PROFILE = "llama3-8b-h100-vllm-v1"
WINDOW = 16384


def chunk_times(client: httpx.Client, url: str, body: dict
                ) -> tuple[list[float], list[int], list[int], str]:
    """A streamed completion (``return_token_ids``): each chunk with ids, its arrival and how
    many ids it held (a real vLLM merges tokens when it falls behind); all the ids; the
    replica the gateway named."""
    times, counts, ids = [], [], []
    with client.stream("POST", url, json=body) as response:
        replica = response.headers.get("x-gateway-replica", "")
        pending = b""
        for data in response.iter_bytes():
            now = time.perf_counter()
            pending += data
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: {"):
                    for choice in json.loads(event[6:]).get("choices") or ():
                        if choice.get("token_ids"):
                            times.append(now)
                            counts.append(len(choice["token_ids"]))
                            ids += choice["token_ids"]
    return times, counts, ids, replica


def one_round(client: httpx.Client, gateway: str, replicas: dict[str, str], prompt: str,
              break_after: int, output: int) -> dict[str, float]:
    body = {"model": "m", "prompt": prompt, "max_tokens": output, "stream": True,
            "temperature": 0, "return_token_ids": True}
    for url in replicas.values():
        client.post(url + "/sim/faults", json={"drop_after": break_after}).raise_for_status()
    try:
        times, _, ids, first = chunk_times(client, gateway + "/v1/completions", body)
    finally:
        for url in replicas.values():
            client.post(url + "/sim/faults", json={"drop_after": None}).raise_for_status()
    assert len(times) == output, f"{len(times)} of {output} tokens"
    gap = times[break_after] - times[break_after - 1]
    usual = statistics.median(b - a for a, b in zip(times[1:break_after], times[2:break_after]))
    # The continuation's own prompt, straight to the replica that took it over (the other).
    other = next(url for name, url in replicas.items() if name != first)
    prompt_ids = client.post(other + "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": 1, "return_token_ids": True}).json()
    ids_in = prompt_ids["choices"][0]["prompt_token_ids"] + ids[:break_after]
    sent = time.perf_counter()
    direct, _, _, _ = chunk_times(client, other + "/v1/completions", {
        "model": "m", "prompt": ids_in, "max_tokens": 2, "stream": True, "temperature": 0,
        "return_token_ids": True})
    prefill = direct[0] - sent
    return {"gap_s": gap, "prefill_s": prefill, "added_s": gap - prefill,
            "usual_itl_s": usual, "broke_on": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--break-after", type=int, default=96)
    parser.add_argument("--output", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="migration-gap-") as scratch:
        tmp = Path(scratch)
        ports = {name: free_port() for name in ("a", "b")}
        sims = {name: start(["sim", "--dialect", "vllm", "--port", str(port), "--model", "m",
                             "--max-model-len", str(WINDOW), "--profile", PROFILE],
                            None, tmp / f"sim-{name}.log") for name, port in ports.items()}
        replicas = {name: f"http://{HOST}:{port}" for name, port in ports.items()}
        gateway_port = free_port()
        config = tmp / "gateway.yaml"
        config.write_text(yaml.safe_dump({
            "models": [{"name": "m", "replicas": [{"url": url, "engine": "vllm", "name": name}
                                                  for name, url in replicas.items()]}],
            "balancer": "round_robin", "outlier": {"consecutive_failures": 1000}}))
        gateway = start(["serve", "--config", str(config), "--port", str(gateway_port)], None,
                        tmp / "gateway.log")
        try:
            for name, proc in sims.items():
                wait_ready(replicas[name] + "/health", proc)
            wait_ready(f"http://{HOST}:{gateway_port}/ready", gateway)
            words = "the quick brown fox jumps over a lazy dog ".split()
            prompt = " ".join(words[i % len(words)] for i in range(args.prompt_tokens))
            with httpx.Client(timeout=120) as client:
                rounds = [one_round(client, f"http://{HOST}:{gateway_port}", replicas, prompt,
                                    args.break_after, args.output) for _ in range(args.rounds)]
        finally:
            for proc in (gateway, *sims.values()):
                stop(proc)
    print(f"prompt {args.prompt_tokens} tokens, break after {args.break_after}, profile {PROFILE}")
    print("| round | gap ms | new replica's prefill ms | gap - prefill ms | usual ITL ms |")
    print("|---|---|---|---|---|")
    for i, r in enumerate(rounds, 1):
        print(f"| {i} | {r['gap_s'] * 1000:.0f} | {r['prefill_s'] * 1000:.0f} | "
              f"{r['added_s'] * 1000:.1f} | {r['usual_itl_s'] * 1000:.1f} |")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "rounds": rounds, "machine": machine_info()}, indent=1))


if __name__ == "__main__":
    main()
