"""The ``llm-gateway`` command: serve | epp | demo | sim | bench | keys | canary.

Each subcommand's module owns its arguments (``add_arguments(parser)``) and its work
(``run(args)``); this file only wires them together, importing lazily so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "serve": ("gateway.serve", "run the gateway from a config file"),
    "demo": ("gateway.sim.demo", "simulated GPU replicas + the gateway on embedded defaults (no GPU, no Redis)"),
    "epp": ("gateway.epp.cli", "the gateway as an Endpoint Picker for Envoy (ext_proc gRPC, "
            "Gateway API Inference Extension)"),
    "sim": ("gateway.sim.cli", "one simulated engine replica (vllm, tgi, sglang or llamacpp dialect)"),
    "bench": ("gateway.bench.cli", "load-test an OpenAI or TGI endpoint (the gateway or an engine)"),
    "keys": ("gateway.access.cli", "make API key secrets and their sha256 for `auth.keys`"),
    "canary": ("gateway.canary.cli", "the canary verdict of a running gateway (report; exit 0 "
               "pass, 1 fail, 2 insufficient data, 3 marginal) and a step-by-step rollout"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-gateway",
        description="LLM-aware HTTP gateway in front of one-engine-per-GPU replicas.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_commands(sub, SUBCOMMANDS, "run", chosen(argv, SUBCOMMANDS))
    return parser


def chosen(argv: list[str] | None, commands: dict[str, tuple[str, str]]) -> str | None:
    """The subcommand ``argv`` names (its first word), if any."""
    words = sys.argv[1:] if argv is None else argv
    return words[0] if words and words[0] in commands else None


def add_commands(sub: argparse._SubParsersAction, commands: dict[str, tuple[str, str]],
                 run_attribute: str, only: str | None = None) -> None:
    """One subcommand per module (its docstring the description, its ``add_arguments``
    and ``run``); ``run`` is set as ``args.<run_attribute>``. With ``only``, the other
    commands are listed (for ``--help``) without importing their modules: ``llm-gateway
    sim`` does not load the gateway's web stack."""
    for name, (module_name, help_text) in commands.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
        command.set_defaults(**{run_attribute: module.run})


def main(argv: list[str] | None = None) -> None:
    args = build_parser(argv).parse_args(argv)
    sys.exit(args.run(args) or 0)
