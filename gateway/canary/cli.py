"""``llm-gateway canary``: judge a canary (``report``) or roll one out step by step
(``rollout``). Exit codes: 0 pass, 1 fail, 2 insufficient data, 3 marginal, 4 the gateway
(or Redis) could not be asked, 5 the rollout was refused (another driver runs it)."""

from __future__ import annotations

import argparse

ACTIONS = {
    "report": ("gateway.canary.report", "the verdict: is the canary pool worse?"),
    "rollout": ("gateway.canary.rollout", "raise a canary's weight step by step while its "
                "verdict passes; roll it back on fail"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gateway.cli import add_commands

    sub = parser.add_subparsers(dest="canary_command", metavar="ACTION", required=True)
    add_commands(sub, ACTIONS, "canary_run")


def run(args: argparse.Namespace) -> int:
    return args.canary_run(args)
