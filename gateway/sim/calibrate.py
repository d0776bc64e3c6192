"""Closed-loop load on the pure batching model in virtual time (no sockets, no sleeping).

Used to calibrate profiles against published figures and by the timing-model tests:

    python -m gateway.sim.calibrate --profile llama3-8b-a100 --users 10 50 100
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from dataclasses import dataclass

from gateway.sim.engine import make_scheduler
from gateway.sim.scheduler import Sequence, block_hashes
from gateway.sim.metrics import make_meter
from gateway.sim.profiles import PROFILES, SCHEDULED_KINDS, Profile


@dataclass
class LoadResult:
    users: int
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_mean_s: float
    completed: int


def closed_loop(profile: Profile, users: int, prompt_tokens: int = 512, output_tokens: int = 256,
                duration_s: float = 120.0, warmup_s: float = 20.0, shared_prefix: int = 0,
                prefix_cache: bool = False, think_s: float = 0.0, seed: int = 0) -> LoadResult:
    """``users`` clients, each sending its next request ``think_s`` after the last one ended."""
    sched = make_scheduler(profile, make_meter("vllm", 1 << 20), prefix_cache)
    now, user_of, serial = 0.0, {}, 0
    # Users start spread over the warm-up, as real benchmark clients drift apart.
    rng = random.Random(seed)
    arrivals: list[tuple[float, int]] = sorted((rng.uniform(0, warmup_s / 2), u) for u in range(users))
    ttfts: list[float] = []
    tokens_in_window = 0
    completed = 0

    def new_sequence(user: int) -> Sequence:
        nonlocal serial
        serial += 1
        ids = list(range(shared_prefix)) + [10_000 + serial * 7 + k for k in range(prompt_tokens - shared_prefix)]
        return Sequence(prompt_tokens, output_tokens, "length", block_hashes(ids, profile.block_size))

    while now < warmup_s + duration_s:
        while arrivals and arrivals[0][0] <= now:
            _, user = heapq.heappop(arrivals)
            seq = new_sequence(user)
            user_of[id(seq)] = (user, seq)
            sched.add(seq, now)
        if sched.idle():
            now = arrivals[0][0]
            continue
        duration, emitted = sched.step(now)
        if duration == 0.0:
            now = arrivals[0][0] if arrivals else now
            continue
        now += duration
        for s in emitted:
            if now > warmup_s:
                tokens_in_window += 1
            if s.generated == 1 and now > warmup_s:
                ttfts.append(s.first_token_at - s.arrived)
            if s.finished:
                completed += 1
                user, _ = user_of.pop(id(s))
                heapq.heappush(arrivals, (now + think_s, user))
    return LoadResult(users, tokens_in_window / duration_s,
                      statistics.median(ttfts) if ttfts else 0.0,
                      statistics.fmean(ttfts) if ttfts else 0.0, completed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="llama3-8b-a100", choices=[p for p, v in PROFILES.items()
                                                                       if v.kind in SCHEDULED_KINDS])
    parser.add_argument("--users", type=int, nargs="+", default=[1, 10, 50, 100, 200])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    args = parser.parse_args()
    profile = PROFILES[args.profile]
    print(f"{profile.name}: prompt {args.prompt}, output {args.output}, closed loop, simulated time")
    print(f"{'users':>6} {'output tok/s':>13} {'TTFT p50 ms':>12} {'TTFT mean ms':>13}")
    for users in args.users:
        r = closed_loop(profile, users, args.prompt, args.output)
        print(f"{users:>6} {r.output_tokens_per_s:>13.0f} {r.ttft_p50_s * 1000:>12.1f} {r.ttft_mean_s * 1000:>13.1f}")


if __name__ == "__main__":
    main()
