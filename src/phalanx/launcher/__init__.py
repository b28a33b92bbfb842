"""``phalanx run``'s machinery: a validated :class:`LaunchConfig`, and :func:`launch`.

The files, in the order a launch goes through them:

``config.py``
    :class:`LaunchConfig`: the request, validated (options, the script, stream choices, the
    job secret of several nodes).
``environment.py``
    What the machine offers (usable cores, GPUs: ``--nproc-per-node``) and each worker's
    environment: the :mod:`phalanx.env` contract plus the launcher's defaults.
``rendezvous.py``
    How launchers and workers meet: listening sockets bound to one interface, this launcher's
    store helper (:class:`~phalanx.launcher.rendezvous.StoreHost`), node 0's gate or the check
    of the secret with it, and the board.
``storehost.py``
    The helper process: doors for this launcher and its workers, node 0's gate, the launchers'
    store and a fresh workers' store per round (torch's ``TCPStore`` on locked loopback, see
    :mod:`phalanx.gate`); node 0's outlives its launcher until every node has checked out.
``membership.py``
    Several nodes: the store's keys, :class:`~phalanx.launcher.membership.Node`,
    :class:`~phalanx.launcher.membership.Layout` (this node's place in a round).
``board.py``
    The verbs the agent meets the other nodes with: one node alone, a follower, or node 0
    (the leader), which admits launchers and decides each round's nodes.
``workers.py``
    Starting workers so that none outlives the launcher (parent-death signal, guardian),
    signalling them, killing their process trees.
``events.py``
    The one thread's wake-ups: signals (``STOP_SIGNALS``, ``FORWARD_SIGNALS``) and the
    workers' output pipes.
``output.py``
    Workers' output: rank-prefixed console lines, log files, the traceback that ended a worker.
``agent.py``
    :func:`launch`: rounds of workers, watched until they end; meet again, restart or report.
``outcome.py``
    :class:`RoundEnd`: how a round ended, the record every node acts on.

Only :mod:`phalanx.env`, :mod:`phalanx.errors`, :mod:`phalanx.gate` and the standard library
are imported here; torch is imported only to host or reach a store of several nodes (in the
helper, and by the launcher's own client) and to count GPUs.
"""

from .agent import launch
from .config import LaunchConfig, StreamChoice
from .environment import resolve_nproc

__all__ = ["LaunchConfig", "StreamChoice", "launch", "resolve_nproc"]
