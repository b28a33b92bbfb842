"""``phalanx run``'s machinery: a validated :class:`LaunchConfig`, and :func:`launch`.

Only ``phalanx.env``, ``phalanx.errors`` and the standard library are imported here; torch is
imported when a store must be hosted or reached, after a single node's workers have started.
"""

from .agent import launch
from .config import LaunchConfig, StreamChoice, resolve_nproc

__all__ = ["LaunchConfig", "StreamChoice", "launch", "resolve_nproc"]
