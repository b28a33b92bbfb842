"""Loggers whose records carry the rank, and a filter that keeps only rank 0's.

Usage::

    log = get_logger(__name__)
    log.info("bucket plan: %d buckets", n)          # "[rank1] phalanx.ddp: bucket plan: 3 buckets"
    log0 = get_logger(__name__, rank_zero_only=True)  # silent on ranks other than 0
"""

from __future__ import annotations

import logging

_FORMAT = "[rank%(rank)s] %(source)s: %(message)s"
# Under `phalanx run` the launcher already starts every line with "[rankN]: ".
_FORMAT_PREFIXED = "%(source)s: %(message)s"
_RANK_ZERO_SUFFIX = ".rank0"


def _current_rank() -> str:
    # Imported lazily: loggers are created at import time, before torch.distributed is set up.
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except Exception:  # logging must never raise
        pass
    from . import env

    try:
        return str(env.detect().rank)
    except ValueError:
        return "?"


class _AddRank(logging.Filter):
    """Adds ``record.rank`` and ``record.source`` (the logger's name) for the formatter."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _current_rank()
        record.source = record.name.removesuffix(_RANK_ZERO_SUFFIX)
        return True


class _RankZeroOnly(logging.Filter):
    """Drops records on every rank but 0 (installed on ``rank_zero_only`` loggers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _current_rank() in ("0", "?")


def get_logger(name: str, rank_zero_only: bool = False) -> logging.Logger:
    """A logger under ``phalanx`` that prefixes each line with ``[rankN]``."""
    logger = logging.getLogger(name if name.startswith("phalanx") else f"phalanx.{name}")
    if rank_zero_only:
        logger = logging.getLogger(logger.name + _RANK_ZERO_SUFFIX)
        if not any(isinstance(f, _RankZeroOnly) for f in logger.filters):
            logger.addFilter(_RankZeroOnly())
    root = logging.getLogger("phalanx")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.addFilter(_AddRank())
        from . import env

        prefixed = env.launcher_prefixes_output()
        handler.setFormatter(logging.Formatter(_FORMAT_PREFIXED if prefixed else _FORMAT))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return logger
