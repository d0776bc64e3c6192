"""What tracing and the access log cost on the hot path: one gateway worker with each off,
with tracing at sampling 1.0 and 0.01, and with the access log on, side by side.

    python -m benchmarks.tracing_cost [--duration S] [--rounds N] [--baseline CHECKOUT]
                                      [--out FILE.json]

One simulated vLLM replica (``--profile instant``) and a gateway per variant in front of it,
identical but for their ``tracing``/``access_log`` sections, all pinned to core 0 (only one
is loaded at a time), replica and load generator on core 1. Spans go to a loopback OTLP/HTTP
sink in this process (it answers 200 and counts bytes; it does not decode). ``--baseline``
adds the gateway of another checkout (e.g. a worktree of main, before tracing existed) with
the same config: "off" against it is what the outcome records cost when nothing listens.
Figures: requests/s and tokens/s, and the gateway's CPU per request and per token.

``--hooks N`` measures instead, in this one process, what the observers' hooks cost per
request with nothing else around them: N requests' records (one attempt, streamed) told to
no observer, to tracing at 1.0 and 0.01 (the real SDK, batch processor and OTLP/HTTP
exporter to the sink) and to the access log; process CPU time, the export thread included.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gateway.config import AccessLogConfig, TracingConfig
from gateway.dataplane.outcome import Attempt, Outcomes, RequestRecord
from gateway.fleet.replica import Replica
from gateway.observe.access_log import AccessLog
from gateway.protocol.errors import Api
from gateway.protocol.request import GenerationRequest
from gateway.protocol.usage import Usage

from benchmarks.metrics_cost import gateways, measure, parse_side_by_side, side_by_side_parser
from benchmarks.harness import HOST


class Sink:
    """An OTLP/HTTP endpoint that takes every export and answers 200."""

    def __init__(self) -> None:
        self.bytes = self.exports = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                sink.bytes += len(self.rfile.read(int(self.headers.get("content-length", 0))))
                sink.exports += 1
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def variants(sink: str, tmp: Path) -> dict[str, dict[str, Any]]:
    return {"off": {},
            "traced_1.0": {"tracing": {"enabled": True, "endpoint": sink, "sampling": 1.0}},
            "traced_0.01": {"tracing": {"enabled": True, "endpoint": sink, "sampling": 0.01}},
            "access_log": {"access_log": {"enabled": True, "path": str(tmp / "access.log")}}}


def _one_request(outcomes: Any, placement: Any) -> None:
    """A streamed request's record and its one attempt, told to ``outcomes`` as the edge
    and the relay tell them."""
    t = time.perf_counter()
    record = RequestRecord(os.urandom(16).hex(), Api.OPENAI, "/v1/completions", t)
    if outcomes.starts:
        outcomes.request_started(record)
    record.request = GenerationRequest(api=Api.OPENAI, path="/v1/completions", body={},
                                       raw=b"{}", model="m", stream=True, max_tokens=16)
    record.model, record.admitted_at = "m", t + 1e-4
    attempt = Attempt(record.request, placement, t)
    record.attempts.append(attempt)
    attempt.sent_at = t + 2e-4
    if outcomes.sends:
        outcomes.sending(attempt, record)
    attempt.answered, attempt.first_at, attempt.last_at = True, t + 0.01, t + 0.1
    attempt.usage = Usage(5, 16, "length")
    outcomes.first_token(attempt)
    attempt.end(200)
    outcomes.ended(attempt)
    record.status, record.ended_at = 200, t + 0.11
    if outcomes.ends:
        outcomes.request_ended(record)


async def hooks_cost(n: int, sink: str, tmp: Path) -> dict[str, float]:
    """CPU µs per request of each observer's hooks (export included), in this process."""
    from gateway.observe.tracing import from_config  # OpenTelemetry: only here

    # Room for every span of the run: none dropped, so all of them are exported and counted
    # (a tight loop outruns the processor's thread; a server's requests would not).
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(max(2048, 4 * n + 1000))

    placement = SimpleNamespace(replica=Replica(name="r0", url=f"http://{HOST}:8000",
                                                engine="vllm", model="m", pool="default"),
                                queued_for=0.0)
    out = {}
    for name, make in [
            ("off", lambda: None),
            ("traced_1.0", lambda: from_config(TracingConfig(enabled=True, endpoint=sink,
                                                             sampling=1.0))),
            ("traced_0.01", lambda: from_config(TracingConfig(enabled=True, endpoint=sink,
                                                              sampling=0.01))),
            ("access_log", lambda: AccessLog(AccessLogConfig(
                enabled=True, path=str(tmp / "hooks-access.log"))))]:
        observer = make()
        outcomes = Outcomes([observer] if observer is not None else [])
        for _ in range(min(n, 200)):  # warm up
            _one_request(outcomes, placement)
        started = time.process_time()
        for i in range(n):
            _one_request(outcomes, placement)
            if i % 256 == 255:
                await asyncio.sleep(0)  # the access log's flush timer, as under a server
        if observer is not None:
            await observer.aclose()  # what is left is exported (tracing) or written
        out[name] = (time.process_time() - started) / n * 1e6
    return out


def table(res: dict[str, Any], targets: tuple[str, ...]) -> str:
    rows = ["| one gateway worker | " + " | ".join(targets) + " |",
            "|---|" + "---:|" * len(targets)]
    for key, figure, cpu, unit in [
            ("rps_c64", "requests_per_s", "router_cpu_us_per_request", "non-stream, c=64, 16 tok"),
            ("tps_c64", "tokens_per_s", "router_cpu_us_per_token", "stream, c=64, 256 tok")]:
        per = "request" if key == "rps_c64" else "token"
        off_cpu = res[key]["off"].get(cpu)
        rows.append(f"| {figure.replace('_', ' ')}, {unit} | "
                    + " | ".join(f"{res[key][t][figure]:,.0f}" for t in targets) + " |")
        rows.append(f"| gateway CPU µs per {per} (vs off) | " + " | ".join(
            f"{res[key][t][cpu]:.2f} ({res[key][t][cpu] - off_cpu:+.2f})"
            if res[key][t].get(cpu) and off_cpu else "-" for t in targets) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = side_by_side_parser("tracing_cost", __doc__)
    parser.add_argument("--baseline", type=Path, help="another checkout's gateway, tracing "
                        "unconfigured (it may predate it), beside 'off'")
    parser.add_argument("--hooks", type=int, metavar="N", help="instead: the hooks' CPU per "
                        "request over N requests, in this process (no gateway, no load)")
    args = parse_side_by_side(parser, argv)
    if args.hooks is not None:
        if not 1 <= args.hooks <= 100_000:
            parser.error("--hooks takes 1 to 100000 requests")
        tmp = Path(tempfile.mkdtemp(prefix="gw-tracing-hooks-"))
        res = {"hooks_cpu_us_per_request": asyncio.run(hooks_cost(args.hooks, Sink().url, tmp)),
               "requests": args.hooks, "load_average": os.getloadavg()}
        Path(args.out).write_text(json.dumps(res, indent=2))
        for name, us in res["hooks_cpu_us_per_request"].items():
            print(f"| {name} | {us:.1f} µs CPU per request |")
        print(f"load average {' '.join(f'{x:.2f}' for x in res['load_average'])}; "
              f"written: {args.out}", file=sys.stderr)
        return 0
    if args.baseline is not None and not (args.baseline / "gateway").is_dir():
        parser.error(f"--baseline {args.baseline}: no gateway package there")
    tmp = Path(tempfile.mkdtemp(prefix="gw-tracing-cost-"))
    sink = Sink()
    configs = variants(sink.url, tmp)
    checkouts = {}
    if args.baseline is not None:
        configs["baseline"], checkouts["baseline"] = {}, args.baseline.resolve()
    targets = tuple(configs)
    with gateways(configs, tmp, checkouts) as (ports, pids):
        res = asyncio.run(measure(ports, pids, args.duration, args.rounds, targets))
    res["otlp_sink"] = {"exports": sink.exports, "bytes": sink.bytes}
    res["load_average"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(table(res, targets))
    print(f"\nOTLP sink: {sink.exports} exports, {sink.bytes:,} bytes; load average "
          f"{' '.join(f'{x:.2f}' for x in res['load_average'])}", file=sys.stderr)
    print(f"written: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
