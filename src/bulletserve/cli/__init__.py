"""The `bullet` command: one module per subcommand, each with `add_parser` and `run`."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import sys
import traceback
from typing import NoReturn, TypeVar

# Subcommand name -> module under bulletserve.cli. Modules are imported lazily so that
# `bullet bench` does not pay for torch and `bullet --help` stays fast.
SUBCOMMANDS = {
    "generate": "bulletserve.cli.generate",
    "bench": "bulletserve.cli.bench",
    "perplexity": "bulletserve.cli.perplexity",
    "profile": "bulletserve.cli.profile",
    "serve": "bulletserve.cli.serve",
    "simulate": "bulletserve.cli.simulate",
}


class CLIError(Exception):
    """A user error: printed as one line, exit code 2, no stack trace."""


class _Parser(argparse.ArgumentParser):
    """An unknown flag's error names the closest known one (`--max-num-seq`: did you mean
    `--max-num-seqs`?)."""

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            known = {
                option
                for action in _every_action(self)
                for option in action.option_strings
                if option.startswith("--")
            }
            hints = []
            for given in message[len(prefix) :].split():
                flag = given.split("=", 1)[0]
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
                if flag.startswith("--") and close:
                    hints.append(f"{flag}: did you mean {close[0]}?")
            if hints:
                message += " (" + "; ".join(hints) + ")"
        super().error(message)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--model, --load-format, --device and --dtype, for the commands that load a model outside
    the engine (`bullet profile`, `bullet perplexity`)."""
    parser.add_argument(
        "--model",
        default=None,
        help="HF folder, .gguf file, or a dummy preset (default: embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--load-format", default="auto", choices=("auto", "safetensors", "gguf", "dummy")
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (bf16 on a GPU and on a CPU with native bf16, else float32), "
        "bfloat16, float16, float32",
    )


def _every_action(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's actions and those of its subcommands' parsers."""
    actions = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                actions += _every_action(sub)
    return actions


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every flag's help ends with its default, where it has one a user could not guess (a
    switch that is off unless given has none to show)."""
    for action in _every_action(parser):
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(action, argparse._StoreConstAction | argparse._HelpAction)
            or "default" in (action.help or "")
        ):
            continue
        action.help = f"{action.help or ''} (default: %(default)s)".lstrip()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="bullet", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        importlib.import_module(module_name).add_parser(subparsers, name)
    _show_defaults(parser)
    return parser


T = TypeVar("T")


def settings_of(settings_class: type[T], args: argparse.Namespace, **values: object) -> T:
    """A subcommand's typed settings (a dataclass) from its parsed flags, field by field;
    `values` for the fields that no one flag gives."""
    names = [field.name for field in dataclasses.fields(settings_class)]
    return settings_class(**{n: values[n] if n in values else getattr(args, n) for n in names})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except CLIError as exc:
        if exc.__cause__ is not None and getattr(args, "log_level", None) == "debug":
            traceback.print_exception(exc.__cause__)
        print(f"bullet {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
