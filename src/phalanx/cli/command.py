"""``phalanx ...``: the top-level parser, its subcommands, and :func:`main`."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from .. import __version__
from .bench import add_bench
from .run import add_run

# Subcommands: each adds its parser and sets `handler(namespace) -> exit status`.
COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (add_run, add_bench)


class _Parser(argparse.ArgumentParser):
    """argparse's parser with one-line errors: ``PROG: error: MESSAGE (PROG -h: ...)``, not a
    screenful of usage before it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments: "):
            unknown = message.removeprefix("unrecognized arguments: ")
            message = (f"unrecognized arguments: {unknown}; not an option of phalanx's nor of "
                       "torchrun's (phalanx run -h lists them all)")
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} -h` for help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="phalanx", description="phalanx: data-parallel training for PyTorch",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)
    for add_command in COMMANDS:
        add_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``phalanx ...``; returns the exit status (2 for bad options)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed the error (or --help, --version)
        return e.code if isinstance(e.code, int) else 2
    if not hasattr(args, "handler"):
        parser.print_help(sys.stderr)
        return 2
    return args.handler(args)
