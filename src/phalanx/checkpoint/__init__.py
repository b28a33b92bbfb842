"""Checkpoints of the whole training state, and preemption: nothing lost when a process dies.

The files, in the order data flows through them:

``preemption.py``
    :class:`PreemptionHandler`: SIGTERM/SIGUSR1 to any rank becomes one stop that every rank
    agrees on at a step boundary, then a checkpoint and exit 75.
``checkpointer.py``
    :class:`Checkpointer`: ``save`` and ``load`` as collectives; rank 0 writes, every rank
    reads; ``resume="auto"`` picks the newest usable file.
``state.py``
    What goes into a checkpoint for one process: the unwrapped model, RNG states, the check
    that safe loading can rebuild every value, the check that a state fits a model.
``sharded.py``
    Models sharded by ``fully_shard``: each DTensor gathered whole on the writer one at a
    time, and each rank's ``Shard(0)`` rows taken back out at any world size.
``sync.py``
    How the ranks of a save or load exchange data with the writer (rank 0); their verdicts
    travel through :func:`phalanx.agreement.agree`.
``dcp_checkpoint.py``, ``dcp_engine.py``, ``dcp_layout.py``, ``dcp_plan.py``, ``dcp_items.py``
    ``format="sharded"``: torch's DCP format and planner, every rank writing its part
    (replicated tensors balanced by size, :mod:`dcp_engine`; DCP's plans made once per
    layout, :mod:`dcp_plan`; each tensor's ``torch.save`` bytes written from its memory,
    :mod:`dcp_items`); phalanx adds the checksummed manifest, the atomic commit and
    background saves (:mod:`dcp_checkpoint`), and the names, listing and pruning of both
    formats (:mod:`dcp_layout`).
``dcp_zero.py``
    ``ZeroRedundancyOptimizer`` in that format: each rank offers the state of the parameters
    it owns, named as a plain optimizer's; at load, only those of the ones it owns then.
``contents.py``
    A checkpoint of either format seen from outside a run (``phalanx checkpoint``): what it
    holds, every byte checked, its model's state dict whole, exported.
``file.py``
    One file on disk: header, CRC-32, atomic write (temporary, fsync, rename, directory
    fsync), verified and safe read, pruning, stale temporaries; frames for tensors streamed
    one at a time.
"""

from .checkpointer import Checkpointer, TrainingState
from .file import list_checkpoints, read_checkpoint
from .preemption import PreemptionHandler

__all__ = ["Checkpointer", "PreemptionHandler", "TrainingState", "list_checkpoints", "read_checkpoint"]
