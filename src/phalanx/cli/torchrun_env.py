"""torchrun's options from the environment: ``phalanx run`` reads ``PET_<OPTION>`` as torchrun
does.

torchrun takes every option its command line does not give from ``PET_`` and the option's
name, upper-cased with underscores (``PET_NPROC_PER_NODE`` for ``--nproc-per-node``, see
:func:`phalanx.env.torchrun_variable`). Kubernetes' training operator configures its pods that
way (``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE``, ``PET_MASTER_ADDR``,
``PET_MASTER_PORT``, ``PET_RDZV_*``, ``PET_MAX_RESTARTS``), so ``phalanx run`` reads the
variable of every torchrun option it accepts, and refuses the variables of the options it
refuses, as it refuses the options:

* a value on the command line wins over the variable;
* an empty variable of an option with a value counts as unset; a flag's variable is an
  integer, ``0`` for off, as torchrun reads it;
* with an endpoint (``--rdzv-endpoint`` or ``PET_RDZV_ENDPOINT``), ``PET_MASTER_ADDR`` and
  ``PET_MASTER_PORT`` go unused, as in torchrun (given on the command line, they conflict);
* a value the option does not take is refused naming the variable, and an error about an
  option a variable set says which variable it was (:func:`blame`).

:func:`add_defaults` makes each variable the default of its option when the parser is built;
:func:`resolve` checks them once the command line is parsed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from .. import env
from ..errors import LaunchConfigError
from . import torchrun

# torchrun 2.13's options that it reads from PET_<DEST> (torch/distributed/run.py, action=env)
# and phalanx run accepts with torchrun's meaning, each with the type phalanx reads it as.
VALUES: dict[str, Callable[[str], Any]] = {
    "nnodes": str, "nproc_per_node": str, "node_rank": int, "master_addr": str,
    "master_port": int, "rdzv_backend": str, "rdzv_endpoint": str, "rdzv_id": str,
    "rdzv_conf": str, "max_restarts": int, "monitor_interval": float, "shutdown_timeout": float,
    "start_method": str, "event_log_handler": str, "role": str, "signals_to_handle": str,
    "log_dir": str, "redirects": str, "tee": str, "local_ranks_filter": str,
}
# ... its flags (action=check_env: int(value), 0 for off)
FLAGS = ("standalone", "module", "no_python", "run_path")
# ... and those of the options phalanx refuses (torchrun.py), True for a flag. --logs-specs and
# --numa-binding have no variable: torchrun reads them from its command line only.
REFUSED = {"local_addr": False, "duplicate_stdout_filters": False,
           "duplicate_stderr_filters": False, "virtual_local_rank": True}
_KINDS = {int: "an integer", float: "a number"}


@dataclass(frozen=True)
class FromEnv:
    """The default torchrun's variable gives option ``dest``: ``raw``, checked by :meth:`value`."""

    dest: str
    raw: str

    @property
    def variable(self) -> str:
        return env.torchrun_variable(self.dest)

    @property
    def option(self) -> str:
        return "--" + self.dest.replace("_", "-")

    def __str__(self) -> str:  # as `phalanx run -h` shows a default
        return f"{self.raw} ({self.variable})"

    def value(self) -> Any:
        """The option's value. Raises LaunchConfigError naming the variable."""
        if self.dest in FLAGS:
            return self._flag()
        if self.dest in REFUSED:
            if REFUSED[self.dest] and not self._flag():
                return False  # a refused flag, off
            raise LaunchConfigError(
                f"torchrun's {self.option} is not supported (set by {self.variable}="
                f"{self.raw!r}: unset it): {torchrun.refusal(self.option)}")
        convert = VALUES[self.dest]
        try:
            value = convert(self.raw.strip() if convert is not str else self.raw)
        except ValueError:
            raise LaunchConfigError(
                f"Invalid {self.variable}={self.raw!r}: torchrun's {self.option} is "
                f"{_KINDS[convert]}") from None
        if self.dest == "start_method" and value not in torchrun.START_METHODS:
            raise LaunchConfigError(
                f"Invalid {self.variable}={self.raw!r}: torchrun's {self.option} is one of "
                f"{', '.join(torchrun.START_METHODS)}")
        return value

    def _flag(self) -> bool:
        try:
            return int(self.raw) != 0
        except ValueError:
            raise LaunchConfigError(
                f"Invalid {self.variable}={self.raw!r}: expected an integer, as torchrun reads "
                f"it (1: {self.option}, 0: without it)") from None


def add_defaults(parser: argparse.ArgumentParser) -> None:
    """Make each torchrun variable set in the environment the default of its option."""
    found = env.torchrun_options([*VALUES, *FLAGS, *REFUSED])
    parser.set_defaults(**{dest: FromEnv(dest, raw) for dest, raw in found.items()
                           if raw != "" or dest in FLAGS or REFUSED.get(dest)})


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the value of each variable that set an option (see :class:`FromEnv`).

    Raises:
        LaunchConfigError: a variable's value is not what its option takes, or it sets an
            option phalanx refuses.
    """
    values = vars(args).copy()
    taken = {dest: found for dest, found in values.items() if isinstance(found, FromEnv)}
    for dest, found in taken.items():
        values[dest] = found.value()
    if values.get("rdzv_endpoint"):  # torchrun: an endpoint, and the master goes unused
        values.update({dest: None for dest in ("master_addr", "master_port") if dest in taken})
    return argparse.Namespace(**values)


def blame(message: str, args: argparse.Namespace) -> str:
    """``message`` (an error about ``args``, before :func:`resolve`), saying which variables
    set the options it names."""
    named = [found for found in vars(args).values() if isinstance(found, FromEnv)
             and found.option in message and found.variable not in message]
    if not named:
        return message
    said = "; ".join(f"{found.option} came from {found.variable}={found.raw!r}" for found in named)
    return f"{message} ({said})"
