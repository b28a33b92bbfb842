"""Options the benchmark engine shares with the ``phalanx bench`` command (no torch): the
``--comm-hook`` choice, and the checks of its counts, made when the command line is read so a
bad value is refused (exit 2) before any rank starts."""

from __future__ import annotations

import argparse
from typing import Any, Callable

# phalanx.comm_hooks.HOOK_NAMES, spelled out here: importing comm_hooks would import torch.
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


def add_comm_hook_option(add: Callable[..., Any]) -> None:
    """Add ``--comm-hook`` through ``add`` (an ``ArgumentParser.add_argument``)."""
    add("--comm-hook", "--comm_hook", default="none", choices=COMM_HOOKS,
        help="gradient compression for both DDPs: phalanx.comm_hooks' hook on phalanx's, torch's hook "
             "of that name on torch's (its PowerSGD with a single bucket: the only way it runs on Gloo; "
             "both start compressing at the 3rd step, rank 4); default none")


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= low``; anything else is refused by the parser
    (``argument --steps: expected an integer >= 1, got 0``, exit 2).

    Example::

        >>> parser.add_argument("--steps", type=at_least(1), default=10)
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"  # what argparse would call the type in its messages
    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a number ``> 0`` (``--bucket-mb``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value
