"""The `bullet` command: one module per subcommand, each with `add_parser` and `run`."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand name -> module under bulletserve.cli. Modules are imported lazily so that
# `bullet bench` does not pay for torch and `bullet --help` stays fast.
SUBCOMMANDS = {
    "generate": "bulletserve.cli.generate",
    "bench": "bulletserve.cli.bench",
    "profile": "bulletserve.cli.profile",
    "serve": "bulletserve.cli.serve",
    "simulate": "bulletserve.cli.simulate",
}


class CLIError(Exception):
    """A user error: printed as one line, exit code 2, no stack trace."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bullet", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        importlib.import_module(module_name).add_parser(subparsers, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except CLIError as exc:
        print(f"bullet {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
