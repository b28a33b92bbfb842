"""phalanx's loggers: standard ``logging`` loggers under ``phalanx``, whose records carry the
rank, and which follow the program's own logging set-up.

* Every logger is ``logging.getLogger("phalanx.<concept>")`` and propagates to the root
  logger, so a program's ``logging.basicConfig(...)``/``dictConfig`` handlers format and
  filter phalanx's records like any other. Each record carries ``rank`` (``%(rank)s``).
* **Level.** INFO and above by default. Set it the usual way, e.g.
  ``logging.getLogger("phalanx").setLevel(logging.WARNING)``. Until a level or a handler is
  set there, a program that has configured the root logger gets the root's level for phalanx
  too.
* A program that configured no handler at all still sees phalanx's messages: a handler on
  the ``phalanx`` logger writes them to stderr as ``[rankN] phalanx.ddp: message`` (without
  ``[rankN]`` under ``phalanx run``, which prefixes every line itself), and stands aside as
  soon as the root logger, or ``phalanx`` itself, has a handler of the program's.

Usage::

    log = get_logger(__name__)
    log.info("bucket plan: %d buckets", n)          # "[rank1] phalanx.ddp: bucket plan: 3 buckets"
    log0 = get_logger(__name__, rank_zero_only=True)  # silent on ranks other than 0
"""

from __future__ import annotations

import logging
import sys

_FORMAT = "[rank%(rank)s] %(source)s: %(message)s"
# Under `phalanx run` the launcher already starts every line with "[rankN]: ".
_FORMAT_PREFIXED = "%(source)s: %(message)s"
_RANK_ZERO_SUFFIX = ".rank0"
# The level of the "phalanx" logger until the program sets one: INFO and above pass (INFO is
# 20). One below INFO rather than INFO, so that any level the program sets, INFO included,
# is told apart from this default.
_DEFAULT_LEVEL = logging.INFO - 1


def _current_rank() -> str:
    # No process group can exist before torch.distributed is imported; importing it here
    # would cost seconds.
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except Exception:  # logging must never raise
        pass
    from . import env

    try:
        return str(env.detect().rank)
    except ValueError:
        return "?"


class _AddRank(logging.Filter):
    """Adds ``record.rank`` and ``record.source`` (the logger's name, without ``.rank0``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _current_rank()
        record.source = record.name.removesuffix(_RANK_ZERO_SUFFIX)
        return True


def _configured_by_program(base: logging.Logger) -> bool:
    """Whether the program has set up ``phalanx``'s logger itself: a handler of its own."""
    return any(not isinstance(h, _Fallback) for h in base.handlers)


class _FollowRootLevel(logging.Filter):
    """While ``phalanx`` has its default level and no handler of the program's, and the
    program has configured the root logger, the root's level decides."""

    def filter(self, record: logging.LogRecord) -> bool:
        root, base = logging.getLogger(), logging.getLogger("phalanx")
        if base.level == _DEFAULT_LEVEL and root.handlers and not _configured_by_program(base):
            return record.levelno >= root.getEffectiveLevel()
        return True


class _RankZeroOnly(logging.Filter):
    """Drops records on every rank but 0 (installed on ``rank_zero_only`` loggers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _current_rank() in ("0", "?")


class _Fallback(logging.StreamHandler):
    """phalanx's own stderr handler, for programs that configured no logging."""

    def __init__(self) -> None:
        super().__init__()  # sys.stderr, looked up at each record
        from . import env

        prefixed = env.launcher_prefixes_output()
        self.setFormatter(logging.Formatter(_FORMAT_PREFIXED if prefixed else _FORMAT))

    def filter(self, record: logging.LogRecord) -> bool:
        if logging.getLogger().handlers or _configured_by_program(logging.getLogger("phalanx")):
            return False  # the program's handlers have it
        return super().filter(record)


def get_logger(name: str, rank_zero_only: bool = False) -> logging.Logger:
    """A logger under ``phalanx`` whose records carry the rank (see the module docstring)."""
    logger = logging.getLogger(name if name.startswith("phalanx") else f"phalanx.{name}")
    if rank_zero_only:
        logger = logging.getLogger(logger.name + _RANK_ZERO_SUFFIX)
        if not any(isinstance(f, _RankZeroOnly) for f in logger.filters):
            logger.addFilter(_RankZeroOnly())
    for kind in (_AddRank, _FollowRootLevel):
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
    base = logging.getLogger("phalanx")
    if not any(isinstance(h, _Fallback) for h in base.handlers):
        base.addHandler(_Fallback())
        if base.level == logging.NOTSET:
            base.setLevel(_DEFAULT_LEVEL)
    return logger
