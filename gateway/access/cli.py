"""Make and hash API key secrets for the `auth.keys` section of the config.

  llm-gateway keys new             a fresh secret and its sha256 (give the secret to the
                                   client, put the sha256 in the config)
  llm-gateway keys hash SECRET     the sha256 of a secret
  echo -n SECRET | llm-gateway keys hash
                                   the same, read from stdin (keeps it out of shell history)

Keys can also be created at run time through the admin API (POST /admin/keys).
"""

from __future__ import annotations

import argparse
import sys

from gateway.access.secret import hash_secret, new_secret


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    hashing = sub.add_parser("hash", help="print the sha256 of a secret (argument or stdin)")
    hashing.add_argument("secret", nargs="?", help="the secret; omitted: read from stdin "
                         "(one line, surrounding whitespace stripped)")
    sub.add_parser("new", help="generate a strong secret; print it and its sha256")


def run(args: argparse.Namespace) -> int:
    if args.keys_command == "new":
        secret = new_secret()
        print(f"secret: {secret}")
        print(f"sha256: {hash_secret(secret)}")
        return 0
    secret = args.secret if args.secret is not None else sys.stdin.readline().strip()
    if not secret:
        print("llm-gateway keys hash: empty secret", file=sys.stderr)
        return 2
    print(hash_secret(secret))
    return 0
