"""Options the benchmark engine shares with the ``phalanx bench`` command (no torch)."""

from __future__ import annotations

from typing import Any, Callable

# phalanx.comm_hooks.HOOK_NAMES, spelled out here: importing comm_hooks would import torch.
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


def add_comm_hook_option(add: Callable[..., Any]) -> None:
    """Add ``--comm-hook`` through ``add`` (an ``ArgumentParser.add_argument``)."""
    add("--comm-hook", "--comm_hook", default="none", choices=COMM_HOOKS,
        help="gradient compression for both DDPs: phalanx.comm_hooks' hook on phalanx's, torch's hook "
             "of that name on torch's (its PowerSGD with a single bucket: the only way it runs on Gloo; "
             "both start compressing at the 3rd step, rank 4); default none")
