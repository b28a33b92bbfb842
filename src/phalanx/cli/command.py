"""``phalanx ...``: the top-level parser, its subcommands, and :func:`main`."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
from typing import Any, Callable

from .. import __version__
from .bench import add_bench
from .checkpoint import add_checkpoint
from .run import add_run

# Subcommands: each adds its parser and sets `handler(namespace) -> exit status`.
COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (add_run, add_bench,
                                                                       add_checkpoint)


class _Parser(argparse.ArgumentParser):
    """argparse's parser with one-line errors: ``PROG: error: MESSAGE`` and one pointer to
    ``PROG -h``, not a screenful of usage before it. An argument it does not know is refused
    by the parser that knows the options (``phalanx run``, not ``phalanx``), with the closest
    option (``did you mean --standalone?``) or else ``unknown_note``.

    Args:
        unknown_note (str): said of an unknown option that resembles none. Default ``""``.
    """

    def __init__(self, *args: Any, unknown_note: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unknown_note = unknown_note

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} -h` for help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:  # here, not in the top-level parser: this one knows which options exist
            self.error(self._unrecognized(extras))
        return namespace, extras

    def _unrecognized(self, extras: list[str]) -> str:
        # compared without their dashes, which every option shares ("--bogus" is not "--out")
        options = {name[2:]: name for action in self._actions for name in action.option_strings
                   if name.startswith("--")}
        guesses = [options[match] for arg in extras if arg.startswith("-")
                   for match in difflib.get_close_matches(
                       arg.split("=", 1)[0].lstrip("-"), list(options), n=1)]
        message = f"unrecognized arguments: {' '.join(extras)}"
        if guesses:
            return f"{message}; did you mean {' or '.join(dict.fromkeys(guesses))}?"
        return f"{message}; {self._unknown_note}" if self._unknown_note else message


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
    """``phalanx ...``; returns the exit status (2 for bad options). Without ``argv`` (the
    program's own command line), the launcher's deadlines count from this process's start."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed the error (or --help, --version)
        return e.code if isinstance(e.code, int) else 2
    if not hasattr(args, "handler"):
        parser.print_help(sys.stderr)
        return 2
    if argv is None:
        args.started = process_start()
    return args.handler(args)


def process_start() -> float:
    """When this process started, on :func:`time.monotonic`'s clock (Linux's
    ``/proc/self/stat``; elsewhere: now). The interpreter's start and phalanx's import take a
    second or more of ``--rdzv-timeout`` on a loaded machine: they count, as they do for the
    user who waits."""
    try:
        with open("/proc/self/stat") as f:  # field 22, starttime: clock ticks after boot
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()
    return time.monotonic() - min(max(age, 0.0), 60.0)  # 60: a clock gone wrong, not a start
