"""The rollout driver: raise a canary's weight step by step while its verdict passes.

  llm-gateway canary rollout --model M --canary P --steps 5,25,50,100 --hold 10m
                             [--baseline B] [--check-every 30s] [--max-hold 40m]
                             [--gateway URL] [--admin-token T] [--redis-url URL]

At each step the canary gets the step's weight and the baseline the rest of 100 (through the
admin API: every instance sharing Redis follows). The driver then asks for the verdict over
the step's own traffic (window: since the step began) every ``--check-every``:

- ``fail`` at any check: the canary's weight goes to 0 (the baseline's to 100), exit 1;
- after ``--hold``, ``pass`` moves to the next step; ``marginal`` or ``insufficient data``
  holds the step, up to ``--max-hold`` (default 4 x hold), then the driver stops with exit 3
  or 2, the weights left as they are (a rerun resumes the step);
- a last step of 100 is applied without a hold: the baseline then serves nothing to compare
  against. Exit 0 when the last step is reached.

The guard's automatic rollback stays in charge: a canary whose weight someone else set (the
guard sets 0 on a failing verdict) is never raised again; the driver sees it at its next
check and stops, exit 1 for 0 (rolled back), else 4.

State lives in Redis (``{p}canary:rollout:{model}``): a restarted driver with the same
arguments resumes its step where it was, hold included. A lock (``{p}canary:rollout-lock:
{model}``, renewed every few seconds, expiring after ``--lock-ttl``) keeps a second driver
for the same model from running: it exits 5 at once if the holder is alive; a killed
driver's lock expires, and a new one takes over. Exit codes follow ``canary report``'s: 0
pass, 1 fail, 2 insufficient data, 3 marginal, 4 the gateway or Redis could not be asked
(or the weights changed by hand), 5 refused (another driver runs, or a recorded rollout of
the model has other settings: ``--restart`` discards it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

import redis

from gateway.canary.verdict import EXIT_CODES
from gateway.shared.redis_keys import SharedKeys

log = logging.getLogger("llm-gateway.rollout")

REFUSED = 5
UNREACHABLE = 4
HTTP_TIMEOUT = 10.0
# Extends the lock's life only while this driver holds it.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class Stop(Exception):
    """The rollout ends here with this exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Gateway:
    """The admin API of a running gateway (weights and verdicts)."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url.rstrip("/")
        self.headers = {"authorization": f"Bearer {token}"} if token else {}

    def _call(self, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {**self.headers, **({"content-type": "application/json"} if data else {})}
        request = urllib.request.Request(self.url + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise Stop(UNREACHABLE, f"{method} {path}: {exc.code} {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise Stop(UNREACHABLE, f"cannot reach {self.url}: {exc}") from None

    def weights(self, model: str) -> dict[str, float]:
        for served in self._call("GET", "/admin/models")["models"]:
            if served["name"] == model:
                return {p["pool"]: p["weight"] for p in served["pools"]}
        raise Stop(UNREACHABLE, f"the gateway has no model {model!r}")

    def set_weight(self, model: str, pool: str, weight: float) -> None:
        quote = urllib.parse.quote
        self._call("PUT", f"/admin/models/{quote(model, safe='')}/pools/{quote(pool, safe='')}",
                   {"weight": weight})

    def baseline(self, model: str, canary: str) -> str:
        """The baseline the verdict chooses by default, asked of the gateway itself."""
        query = urllib.parse.urlencode({"canary": canary})
        return self._call("GET", f"/admin/canary/{urllib.parse.quote(model, safe='')}?{query}"
                          )["baseline"]

    def verdict(self, model: str, baseline: str, canary: str, window: float) -> dict[str, Any]:
        query = urllib.parse.urlencode({"baseline": baseline, "canary": canary,
                                        "window": f"{max(window, 1.0):.3f}"})
        return self._call("GET", f"/admin/canary/{urllib.parse.quote(model, safe='')}?{query}")


@dataclass
class Settings:
    model: str
    canary: str
    baseline: str
    steps: list[float]
    hold: float
    check_every: float
    max_hold: float
    lock_ttl: float

    @property
    def signature(self) -> str:
        """What a resumed driver must agree on with the recorded rollout."""
        return json.dumps({"canary": self.canary, "baseline": self.baseline,
                           "steps": self.steps})


class Lock:
    """One driver per model: a Redis key holding the driver's id, renewed while it runs."""

    def __init__(self, client: redis.Redis, key: str, ttl: float) -> None:
        self.client, self.key, self.ttl_ms = client, key, int(ttl * 1000)
        self.id = f"{socket.gethostname()}:{os.getpid()}:{time.time():.0f}"
        self._renew = client.register_script(_RENEW)
        self.renewed = 0.0

    def acquire(self) -> None:
        """Take the lock; a holder that renews it within its TTL is alive: Stop(5)."""
        deadline = time.monotonic() + self.ttl_ms / 1000 + 1.0
        last = None
        while True:
            if self.client.set(self.key, self.id, nx=True, px=self.ttl_ms):
                self.renewed = time.monotonic()
                return
            holder, left = self.client.get(self.key), self.client.pttl(self.key)
            if last is not None and left > last[1] and holder is not None:
                raise Stop(REFUSED, f"another driver runs this rollout: {holder}")
            if time.monotonic() > deadline:
                raise Stop(REFUSED, f"the rollout lock is held by {holder}")
            last = (holder, left)
            time.sleep(0.2)

    def renew(self) -> None:
        if not self._renew(keys=[self.key], args=[self.id, self.ttl_ms]):
            raise Stop(REFUSED, "lost the rollout lock (it expired and another driver took it)")
        self.renewed = time.monotonic()

    def release(self) -> None:
        if self.client.get(self.key) == self.id:
            self.client.delete(self.key)


class Rollout:
    def __init__(self, settings: Settings, gateway: Gateway, client: redis.Redis,
                 keys: SharedKeys, say: Callable[[str], None] = print) -> None:
        self.s = settings
        self.gateway = gateway
        self.client = client
        self.key = keys.canary_rollout(settings.model)
        self.lock = Lock(client, keys.canary_rollout_lock(settings.model), settings.lock_ttl)
        self.say = say
        self.mismatch = 0  # consecutive checks that saw a weight the driver did not set

    def _save(self, **fields: Any) -> None:
        self.client.hset(self.key, mapping={k: str(v) for k, v in
                                            {**fields, "updated": time.time()}.items()})

    def _start_or_resume(self, restart: bool) -> tuple[int, float | None]:
        """(step index, when it started or None) from the recorded state."""
        state = self.client.hgetall(self.key)
        if state.get("state") in ("running", "paused") and not restart:
            if state.get("signature") != self.s.signature:
                raise Stop(REFUSED, f"a rollout of {self.s.model} with other settings is "
                           f"recorded ({state.get('signature')}); --restart discards it")
            step = int(state["step"])
            started = float(state["step_started"]) if state.get("step_started") else None
            if state["state"] == "paused":
                started = None  # a fresh hold for the step
            self.say(f"resuming step {step + 1}/{len(self.s.steps)} "
                     f"({self.s.steps[step]:g}%)")
            return step, started
        return 0, None

    def _sleep(self, seconds: float) -> None:
        """Sleep, renewing the lock on the way."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, self.s.lock_ttl / 4))
            self.lock.renew()

    def _set(self, canary_weight: float) -> None:
        self.gateway.set_weight(self.s.model, self.s.canary, canary_weight)
        self.gateway.set_weight(self.s.model, self.s.baseline, 100.0 - canary_weight)

    def _check_weight(self, expected: float) -> None:
        """Someone else changed the canary's weight (the guard rolls back to 0): stop, never
        fight it. A 0 at once (the driver never sets one but to roll back); another value
        when seen twice in a row, since instances adopt a change within a second."""
        weight = self.gateway.weights(self.s.model).get(self.s.canary)
        if weight == expected:
            self.mismatch = 0
            return
        self.mismatch += 1
        if self.mismatch < 2 and weight != 0:
            return
        if weight == 0:
            self._save(state="rolled_back", reason="weight set to 0 outside the driver")
            raise Stop(EXIT_CODES["fail"], "the canary's weight was set to 0 outside the "
                       "driver (the guard's rollback?): stopping")
        raise Stop(UNREACHABLE, f"the canary's weight is {weight:g}, not {expected:g}: changed "
                   "outside the driver; stopping")

    def _hold(self, index: int, started: float) -> None:
        """Check the step's verdict until it passes after the hold (returns) or Stop."""
        weight = self.s.steps[index]
        while True:
            self._sleep(self.s.check_every)
            self._check_weight(weight)
            now = time.time()
            result = self.gateway.verdict(self.s.model, self.s.baseline, self.s.canary,
                                          now - started)
            held = now - started
            verdict = result["verdict"]
            self.say(f"step {index + 1}/{len(self.s.steps)} ({weight:g}%): {verdict} after "
                     f"{held:.0f}s (requests {result['requests']['baseline']} / "
                     f"{result['requests']['canary']})")
            if verdict == "fail":
                failed = [m["metric"] for m in result["metrics"] if m["class"] == "fail"]
                self.gateway.set_weight(self.s.model, self.s.canary, 0.0)
                self.gateway.set_weight(self.s.model, self.s.baseline, 100.0)
                self._save(state="rolled_back", reason=f"failed: {', '.join(failed)}")
                raise Stop(EXIT_CODES["fail"], f"rolled back at {weight:g}%: "
                           f"{', '.join(failed)} failed (score {result['score']})")
            if held >= self.s.hold and verdict == "pass":
                return
            if held >= self.s.max_hold:
                self._save(state="paused", reason=f"{verdict} after {held:.0f}s")
                raise Stop(EXIT_CODES[verdict], f"held {weight:g}% for {held:.0f}s: still "
                           f"{verdict}; weights left as they are (a rerun resumes)")

    def run(self, restart: bool = False) -> int:
        self.lock.acquire()
        try:
            index, started = self._start_or_resume(restart)
            self._save(state="running", signature=self.s.signature, driver=self.lock.id,
                       model=self.s.model)
            while index < len(self.s.steps):
                weight = self.s.steps[index]
                if started is None:
                    self._set(weight)
                    started = time.time()
                    self._save(step=index, step_started=started)
                    self.say(f"step {index + 1}/{len(self.s.steps)}: canary `{self.s.canary}` "
                             f"at {weight:g}%")
                if weight >= 100:
                    break  # nothing left to compare against
                self._hold(index, started)
                index, started = index + 1, None
            self._save(state="done", reason=f"at {self.s.steps[-1]:g}%")
            self.say(f"rollout of `{self.s.canary}` done: {self.s.steps[-1]:g}%")
            return EXIT_CODES["pass"]
        finally:
            self.lock.release()


# --- the CLI ---------------------------------------------------------------------------------

def parse_steps(text: str) -> list[float]:
    try:
        steps = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of percentages: {text!r}") from None
    if not steps or any(not 0 < s <= 100 for s in steps) or steps != sorted(set(steps)):
        raise argparse.ArgumentTypeError("steps must rise, each in (0, 100], e.g. 5,25,50,100")
    return steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gateway.canary.report import add_gateway_arguments, parse_window

    parser.add_argument("--model", required=True)
    parser.add_argument("--canary", required=True, help="the weighted pool to roll out")
    parser.add_argument("--baseline", help="the pool it replaces (default: the pool the "
                        "gateway's config weighs heaviest)")
    parser.add_argument("--steps", type=parse_steps, default=[5.0, 25.0, 50.0, 100.0],
                        help="the canary's weights in turn, percent (default 5,25,50,100)")
    parser.add_argument("--hold", type=parse_window, default=600.0,
                        help="how long each step must pass before the next (default 10m)")
    parser.add_argument("--check-every", type=parse_window, default=30.0,
                        help="seconds between verdicts during a hold (default 30s)")
    parser.add_argument("--max-hold", type=parse_window, help="how long a step may stay "
                        "marginal or short of data before the driver stops (default 4 x hold)")
    add_gateway_arguments(parser)
    parser.add_argument("--redis-url", default=os.environ.get("LLM_GATEWAY_REDIS_URL"),
                        help="where the rollout's state and lock live (default "
                        "$LLM_GATEWAY_REDIS_URL): the gateway's redis_url")
    parser.add_argument("--redis-key-prefix", default="llm-gateway:",
                        help="the gateway's redis_key_prefix (default llm-gateway:)")
    parser.add_argument("--lock-ttl", type=parse_window, default=30.0,
                        help="seconds a killed driver's lock outlives it (default 30)")
    parser.add_argument("--restart", action="store_true",
                        help="discard a recorded rollout of the model and start at step 1")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    say = lambda line: print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)  # noqa: E731
    if not args.redis_url:
        print("llm-gateway canary rollout: --redis-url (or $LLM_GATEWAY_REDIS_URL) is needed: "
              "the rollout's state and lock live in Redis", file=sys.stderr)
        return UNREACHABLE
    gateway = Gateway(args.gateway, args.admin_token)
    client = redis.Redis.from_url(args.redis_url, decode_responses=True, socket_timeout=5,
                                  socket_connect_timeout=5)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        baseline = args.baseline or gateway.baseline(args.model, args.canary)
        settings = Settings(args.model, args.canary, baseline, args.steps, args.hold,
                            args.check_every, args.max_hold or 4 * args.hold, args.lock_ttl)
        return Rollout(settings, gateway, client, SharedKeys(args.redis_key_prefix),
                       say).run(args.restart)
    except Stop as stop:
        say(str(stop))
        return stop.code
    except redis.RedisError as exc:
        say(f"Redis could not be asked ({type(exc).__name__}: {exc}); weights left as they are")
        return UNREACHABLE
    except KeyboardInterrupt:
        say("stopped; weights left as they are, a rerun resumes")
        return 130
    finally:
        client.close()


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops like Ctrl-C: the lock is released, the state kept (a rerun resumes)."""
    raise KeyboardInterrupt
