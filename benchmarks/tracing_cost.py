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
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchmarks.metrics_cost import gateways, measure, parse_side_by_side, side_by_side_parser
from benchmarks.overhead import HOST


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
    args = parse_side_by_side(parser, argv)
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
