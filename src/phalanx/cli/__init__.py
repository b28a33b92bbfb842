"""The ``phalanx`` command line. No torch here: the launcher starts before its workers and
must not pay torch's import first.

The files:

``command.py``
    :func:`main` and :func:`build_parser`: ``phalanx --version``, ``phalanx run``,
    ``phalanx bench``, ``phalanx checkpoint``, one-line errors for bad input.
``run.py``
    ``phalanx run``: its manual (the module docstring is ``phalanx run -h``), its options and
    :func:`config_from_args`, which turns them into a :class:`~phalanx.launcher.LaunchConfig`.
``torchrun.py``
    torchrun's options that are not phalanx's own: mapped onto them, or refused with what
    phalanx does instead.
``torchrun_env.py``
    torchrun's ``PET_<OPTION>`` variables (Kubernetes' training operator): the defaults of
    ``phalanx run``'s options, checked naming the variable.
``bench.py``
    ``phalanx bench``: starts the benchmark's ranks through the launcher and prints its table.
``checkpoint.py``
    ``phalanx checkpoint info|verify|export``: its parser here; the work, which needs torch, in
    :mod:`phalanx.checkpoint.contents`, imported when the command runs.
``text.py``
    Docstrings made readable in a terminal (reST markup taken out).
"""

from .command import build_parser, main
from .run import config_from_args

__all__ = ["build_parser", "config_from_args", "main"]
