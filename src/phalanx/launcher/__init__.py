"""``phalanx run``'s machinery: a validated :class:`LaunchConfig`, and :func:`launch`.

The files, in the order a launch goes through them:

``config.py``
    :class:`LaunchConfig`: the request, validated (options, the script, stream choices).
``environment.py``
    What the machine offers (usable cores, GPUs: ``--nproc-per-node``) and each worker's
    environment: the :mod:`phalanx.env` contract plus the launcher's defaults.
``rendezvous.py``
    How launchers and workers meet: listening sockets bound to the master's interface, the
    workers' store (fresh every round, served by ``storehost.py``), and the nodes' board.
``workers.py``
    Starting workers so that none outlives the launcher (parent-death signal, guardian),
    signalling them, killing their process trees.
``events.py``
    The one thread's wake-ups: signals (``STOP_SIGNALS``, ``FORWARD_SIGNALS``) and the
    workers' output pipes.
``output.py``
    Workers' output: rank-prefixed console lines, log files, the traceback that ended a worker.
``agent.py``
    :func:`launch`: rounds of workers, watched until they end; restart or report.
``outcome.py``
    :class:`RoundEnd`: how a round ended, the record every node acts on.

Only :mod:`phalanx.env`, :mod:`phalanx.errors` and the standard library are imported here; torch
is imported only to host or reach a store of several nodes and to count GPUs.
"""

from .agent import launch
from .config import LaunchConfig, StreamChoice
from .environment import resolve_nproc

__all__ = ["LaunchConfig", "StreamChoice", "launch", "resolve_nproc"]
