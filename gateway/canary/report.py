"""The canary report: the verdict for a model's baseline and canary pools, and its CLI.

  llm-gateway canary report --model M [--baseline POOL --canary POOL --reference POOL]
                            [--gateway URL] [--admin-token T] [--window 30m] [--json]
  llm-gateway canary report --prometheus URL --model M --baseline POOL --canary POOL
                            [--config gateway.yaml] [--window 30m] [--json]

reads ``GET /admin/canary/{model}`` of a running gateway (its admin token: --admin-token or
$LLM_GATEWAY_ADMIN_TOKEN), or, with --prometheus, judges from the gateways' histograms and
counters in Prometheus alone (bucket-level statistics: what that gives up is in
gateway/canary/prometheus_report.py and each metric's resolution), and prints each metric
side by side: baseline and canary medians,
the relative change with its confidence interval, the p-value and the class, then the score
and the verdict. Exit code: 0 pass, 1 fail, 2 insufficient data, 3 marginal (a rollout or CI
job can gate on it).

The baseline is, by default, the primary pool the config weighs heaviest; the canary, the
other pool (a shadow pool too: its copies are judged like any request, and its greedy
output agreement with the pool it shadows as well).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from gateway.canary.agreement_metric import AGREEMENT_METRICS


# --- the CLI ---------------------------------------------------------------------------------

def parse_window(text: str) -> float:
    """``30m``, ``2h``, ``90s`` or plain seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30m, 2h, 90s)")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the gateway's admin API is, and its token."""
    parser.add_argument("--gateway", default="http://127.0.0.1:8080",
                        help="the gateway's base URL (default http://127.0.0.1:8080)")
    parser.add_argument("--admin-token", default=os.environ.get("LLM_GATEWAY_ADMIN_TOKEN"),
                        help="the gateway's admin_token (default $LLM_GATEWAY_ADMIN_TOKEN)")


def add_arguments(report: argparse.ArgumentParser) -> None:
    report.add_argument("--model", required=True)
    report.add_argument("--baseline", help="baseline pool (default: the primary pool the "
                        "config weighs heaviest)")
    report.add_argument("--canary", help="canary pool (default: the other pool)")
    add_gateway_arguments(report)
    report.add_argument("--reference", help="agreement reference pool: a shadow of the same "
                        "pool as the canary (default: canary.judge.agreement.reference)")
    report.add_argument("--window", type=parse_window, help="recent period judged, e.g. 30m "
                        "(default: the gateway's canary.judge.window)")
    report.add_argument("--json", action="store_true", help="print the JSON judgment")
    report.add_argument("--prometheus", metavar="URL", help="judge from Prometheus alone "
                        "(the gateways' histograms and counters; needs --baseline and "
                        "--canary); no gateway is asked")
    report.add_argument("--config", metavar="FILE", help="with --prometheus: the gateway's "
                        "config file, for its canary.judge settings (default: the defaults)")


def fetch(args: argparse.Namespace) -> dict[str, Any]:
    query = {k: v for k, v in (("baseline", args.baseline), ("canary", args.canary),
                               ("reference", args.reference), ("window", args.window))
             if v is not None}
    url = (f"{args.gateway.rstrip('/')}/admin/canary/{urllib.parse.quote(args.model)}"
           + (f"?{urllib.parse.urlencode(query)}" if query else ""))
    headers = {"authorization": f"Bearer {args.admin_token}"} if args.admin_token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as r:
        return json.loads(r.read())


def _figure(value: float | None, metric: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.1f}" if metric == "tokens_per_s" else f"{value * 1000:,.1f} ms"


def text(result: dict[str, Any]) -> str:
    lines = [f"canary report: model {result['model']}, baseline `{result['baseline']}` vs "
             f"canary `{result['canary']}`, last {result['window_s']:g} s; requests "
             f"{result['requests']['baseline']} / {result['requests']['canary']}",
             *_samples_line(result), "",
             f"{'metric':18s} {'baseline':>12s} {'canary':>12s} {'change':>9s} "
             f"{'95% interval':>18s} {'p':>8s}  class"]
    for m in result["metrics"]:
        name = m["metric"] + (" *" if m["critical"] else "")
        if m["class"] == "insufficient data":
            what = "pairs" if m["metric"] in AGREEMENT_METRICS else "samples"
            base = "floor" if m["baseline_n"] is None else str(m["baseline_n"])
            lines.append(f"{name:18s} {base:>12s} {m['canary_n']:>12d} "
                         f"{'':>9s} {'':>18s} {'':>8s}  insufficient data ({what})")
        elif m["metric"] in AGREEMENT_METRICS:
            lines.append(_agreement_row(name, m))
        elif m["metric"] == "error_rate":
            lines.append(f"{name:18s} {m['baseline_rate']:>11.2%} {m['canary_rate']:>11.2%} "
                         f"{m['change_points']:>+8.2f}p {'':>18s} {m['p_value']:>8.3g}  "
                         f"{m['class']}")
        else:
            low, high = m["change_ci"]
            lines.append(f"{name:18s} {_figure(m['baseline_median'], m['metric']):>12s} "
                         f"{_figure(m['canary_median'], m['metric']):>12s} "
                         f"{m['change']:>+8.1%} {f'[{low:+.1%}, {high:+.1%}]':>18s} "
                         f"{m['p_value']:>8.3g}  {m['class']}")
    score = "n/a" if result["score"] is None else f"{result['score']:g}"
    lines += ["", "* critical: failing it fails the canary"]
    lines += _agreement_notes(result)
    lines += _resolution_notes(result)
    lines += ["",
              f"verdict: {result['verdict'].upper()} (score {score})"]
    return "\n".join(lines)


def _resolution_notes(result: dict[str, Any]) -> list[str]:
    """With --prometheus: how far the buckets let each change be known."""
    lines = []
    for m in result["metrics"]:
        if "resolution" in m:
            low, high = m["resolution"]
            (a0, a1), (b0, b1) = m["median_buckets"]["baseline"], m["median_buckets"]["canary"]
            show = lambda v: _figure(v, m["metric"]) if math.isfinite(v) else "+Inf"  # noqa: E731
            lines.append(f"resolution {m['metric']}: medians in buckets ({show(a0)}, "
                         f"{show(a1)}] / ({show(b0)}, {show(b1)}]: the change lies in "
                         f"[{low:+.0%}, {high:+.0%}] whatever happens inside them")
    return lines


def _samples_line(result: dict[str, Any]) -> list[str]:
    source = result.get("samples")
    if not source:
        return []
    return [f"samples: {source['note']}"]


def _agreement_row(name: str, m: dict[str, Any]) -> str:
    """Baseline column: the floor, or the reference pool's agreement; change in points."""
    low, high = m["change_ci"]
    base = (f"floor {m['baseline_rate']:.1%}" if m["reference"] is None
            else f"{m['baseline_rate']:.1%}")
    return (f"{name:18s} {base:>12s} {m['canary_rate']:>11.1%} "
            f"{m['change_points']:>+8.1f}p {f'[{low:+.1f}p, {high:+.1f}p]':>18s} "
            f"{m['p_value']:>8.3g}  {m['class']}")


def _agreement_notes(result: dict[str, Any]) -> list[str]:
    pairs = next((m["pairs"] for m in result["metrics"] if m["metric"] == "agreement"), None)
    if pairs is None:
        return []
    against = (f"reference `{result['agreement_reference']}`"
               if result.get("agreement_reference") else "the floors")
    lines = [f"agreement: greedy pairs of `{result['canary']}` against {against}; "
             f"{pairs['greedy_compared']} compared, {pairs['not_greedy']} not greedy "
             f"(not judged), {pairs['dropped']} dropped, {pairs.get('skipped', 0)} skipped "
             "(copy not sent: no free shadow slot)"]
    if result.get("agreement_note"):
        lines.append(f"agreement: {result['agreement_note']}")
    return lines


def from_prometheus(args: argparse.Namespace) -> dict[str, Any]:
    from gateway.canary.prometheus_report import Prometheus, judge_from_prometheus
    from gateway.canary.config import CanaryJudgeConfig
    from gateway.config import load_settings

    config = load_settings(args.config).canary.judge if args.config else CanaryJudgeConfig()
    return judge_from_prometheus(Prometheus(args.prometheus), args.model, args.baseline,
                                 args.canary, args.window or config.window, config,
                                 args.reference)


def run(args: argparse.Namespace) -> int:
    if args.prometheus:
        from gateway.canary.prometheus_report import PrometheusError

        if not (args.baseline and args.canary):
            print("llm-gateway canary report: --prometheus needs --baseline and --canary (the "
                  "pools' weights are the gateway's, which is not asked)", file=sys.stderr)
            return 4
        try:
            result = from_prometheus(args)
        except PrometheusError as exc:
            print(f"llm-gateway canary report: {exc}", file=sys.stderr)
            return 4
        print(json.dumps(result, indent=2) if args.json else text(result))
        return int(result["exit_code"])
    try:
        result = fetch(args)
    except urllib.error.HTTPError as exc:
        print(f"llm-gateway canary report: {exc.code} {exc.read().decode(errors='replace')}",
              file=sys.stderr)
        return 4
    except (urllib.error.URLError, OSError) as exc:
        print(f"llm-gateway canary report: cannot reach {args.gateway}: {exc}", file=sys.stderr)
        return 4
    print(json.dumps(result, indent=2) if args.json else text(result))
    return int(result["exit_code"])
