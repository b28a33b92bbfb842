"""A benchmark's two ranks on two "machines": one in each network namespace of a veth pair
limited by ``tc`` (:func:`phalanx.bench.netns.veth_namespaces`), started by
``phalanx run --nnodes 2`` as on two hosts (no torch).

The script plays both parts, as with :func:`phalanx.bench.ranks.launch_ranks`: started by
hand it calls :func:`launch_on_namespaces`, which runs it again under a launcher in each
namespace with ``--rank-result PATH`` added; its workers :func:`~phalanx.bench.ranks.serve`
and rank 0 writes ``PATH``, returned here. Needs root (``ip netns``, ``tc``). The namespaces
go when the run ends, also on Ctrl-C, on SIGTERM or SIGHUP (:func:`raise_on_signals`) and on
a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..gate.secret import new_secret
from .netns import NamespaceError, veth_namespaces
from .ranks import RESULT_FLAG

# How long the launchers get to stop after SIGTERM before SIGKILL: a launcher still in its
# rendezvous can otherwise wait out the rendezvous timeout (seen: 120 s) for its store.
STOP_GRACE_S = 20.0
# How long the other node gets to finish after one node's launcher failed: its worker is
# then waiting on a peer that is gone, up to Gloo's timeout (30 min), unless stopped.
PEER_GRACE_S = 10.0
# The rendezvous timeout given to each node's launcher, seconds: the two start within a
# second of each other here, so a node that is not there in 2 minutes failed (the launcher's
# default, 600 s, is for machines that start apart).
RDZV_TIMEOUT_S = 120
# The master's port, in node 0's namespace (a fresh network stack: nothing else listens).
MASTER_PORT = 29500
# The src directory phalanx is imported from, for the launchers' PYTHONPATH.
_SRC = str(Path(__file__).resolve().parents[2])


class NodesFailed(RuntimeError):
    """The namespaces could not be made, or a node's launcher failed (exit statuses in
    ``codes``; empty when the namespaces were the failure)."""

    def __init__(self, message: str, codes: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.codes = list(codes)


def raise_on_signals() -> None:
    """SIGTERM and SIGHUP end the run as Ctrl-C does (``KeyboardInterrupt``), so every
    ``finally`` removes what it made."""
    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def launch_on_namespaces(entrypoint: str, argv: Sequence[str], rate: str | None, prefix: str,
                         subnet: str) -> Any:
    """Run ``entrypoint argv --rank-result PATH`` as node 0 and node 1 of a two-node job, one
    rank each, in two namespaces whose link ``rate`` limits each way; return the JSON rank 0
    wrote to ``PATH``.

    Args:
        entrypoint: the script (its launchers run ``python -m phalanx run ... entrypoint``).
        argv: its arguments.
        rate: ``tc``'s rate for each end (``"1gbit"``); ``None``: no limit.
        prefix, subnet: the namespaces' names and /24 (:func:`~phalanx.bench.netns.veth_namespaces`).

    Raises:
        NodesFailed: not root, an ``ip``/``tc`` command failed, or a node failed (its
            launcher has printed the rank and its traceback).
    """
    if os.geteuid() != 0:
        raise NodesFailed("network namespaces and tc need root")
    try:
        with veth_namespaces(prefix, subnet, rate) as nodes, tempfile.TemporaryDirectory() as scratch:
            result = Path(scratch) / "result.json"
            codes = run_nodes(nodes, [sys.executable, "-m", "phalanx", "run"],
                              [entrypoint, *argv, RESULT_FLAG, str(result)])
            if any(codes):
                raise NodesFailed(f"the nodes failed (exit {codes}); their output is above", codes)
            return json.loads(result.read_text())
    except NamespaceError as e:
        raise NodesFailed(str(e)) from None


def run_nodes(nodes: Sequence[tuple[str, str, str]], launcher: Sequence[str], worker: Sequence[str],
              stdout: Any = None, environ: Mapping[str, str] | None = None) -> list[int]:
    """``launcher`` (``phalanx run``'s or torchrun's command) as node 0 and node 1 of a two-node
    job, one rank each running ``worker``, one node per namespace of ``nodes``; their exit
    statuses (:func:`wait_nodes`). ``stdout``: the launchers' (``Popen``'s; default: ours);
    ``environ``: their environment (default: ours), to which each node's variables are added."""
    environ = os.environ if environ is None else environ
    # launchers of several nodes share a job secret (the gate keeps the store to the job)
    secret = environ.get("PHALANX_JOB_SECRET") or new_secret()
    pythonpath = os.pathsep.join(filter(None, [_SRC, environ.get("PYTHONPATH")]))
    phalanx_run = list(launcher[-2:]) == ["phalanx", "run"]
    procs: list[subprocess.Popen] = []
    try:
        for node, (ns, dev, _) in enumerate(nodes):
            cmd = ["ip", "netns", "exec", ns, *launcher, "--nnodes", "2", "--node-rank", str(node),
                   "--master-addr", nodes[0][2], "--master-port", str(MASTER_PORT), "--nproc-per-node", "1",
                   *(["--rdzv-timeout", str(RDZV_TIMEOUT_S)] if phalanx_run else []), *worker]
            env = {**environ, "GLOO_SOCKET_IFNAME": dev, "PYTHONPATH": pythonpath,
                   "PHALANX_JOB_SECRET": secret}
            procs.append(subprocess.Popen(cmd, env=env, stdout=stdout))
        return wait_nodes(procs)
    finally:
        stop(procs)


def wait_nodes(procs: Sequence[subprocess.Popen], peer_grace_s: float = PEER_GRACE_S) -> list[int]:
    """The nodes' exit statuses. Once one has failed, the others get ``peer_grace_s`` to end,
    then are stopped (:func:`stop`): a worker whose peer died can wait out Gloo's timeout."""
    deadline = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        if deadline is None and any(codes):
            deadline = time.monotonic() + peer_grace_s
        if deadline is not None and time.monotonic() > deadline:
            stop(procs)
            return [p.wait() for p in procs]
        time.sleep(0.1)


def stop(procs: Sequence[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """Stop the launchers still running: SIGTERM (each stops its worker), then, after
    ``grace_s``, SIGKILL (its guardian still takes its worker down)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
