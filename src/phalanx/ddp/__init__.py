"""DistributedDataParallel: a full replica per process, gradients averaged during backward.

The files, in the order data flows through them:

``checks.py``
    At construction: the arguments, then one exchange in which every rank learns whether all
    ranks hold the same parameters, buffers and settings (:mod:`phalanx.agreement`).
``wrapper.py``
    :class:`DistributedDataParallel` itself: broadcasts rank 0's parameters and buffers,
    plans the buckets, installs the reducer; each forward runs before / the module / after.
``bucketing.py``
    Pure planning: which parameter's gradient goes where in which flat buffer (no
    communication; testable alone).
``buffer_sync.py``
    Before a forward: rank 0's buffers (BatchNorm statistics...) to every rank.
``graph_walk.py``
    After a forward, with ``find_unused_parameters``: which parameters the outputs can reach.
``reducer.py``
    During backward: grad-ready hooks copy each gradient into its bucket; a full bucket is
    launched, in bucket order; the end of backward waits, writes ``.grad`` back and raises
    every rank's unused-parameter report on every rank.
``bucket_comm.py``
    How one bucket is reduced (the :class:`~phalanx.ddp.bucket_comm.BucketComm` protocol):
    all-reduce of the mean, or ZeRO stage 2's reduce to the owner.
``reference.py``
    A naive per-parameter DDP, the oracle the bucketed one is tested against.
"""

from .wrapper import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
