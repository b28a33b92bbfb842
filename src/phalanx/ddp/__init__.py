"""DistributedDataParallel: a full replica per process, gradients averaged during backward.

The files, in the order data flows through them:

``options.py``
    Every constructor argument, checked and resolved in one call into the settings the
    wrapper reads: the group, the module and flags, torch 2.13's arguments (each taken with
    torch's meaning, or refused saying what phalanx does instead), the bucket caps, where
    inputs go; then one exchange in which every rank learns whether all ranks hold the same
    parameters, buffers and settings (:mod:`phalanx.agreement`).
``checks.py``
    What ``shard_gradients`` needs of an optimizer; at each forward, the refusal of
    distributed autograd.
``devices.py``
    Each forward's inputs moved to ``device_ids[0]``.
``wrapper.py``
    :class:`DistributedDataParallel` itself: the public surface and the settings.
``runtime.py``
    Its machinery on each process, rebuilt after unpickling: broadcasts rank 0's parameters
    and buffers, plans the buckets, installs the reducer; each forward runs before / the
    module / after (or the traceable forward under compiled autograd).
``pickling.py``
    What ``torch.save``/``pickle``/``deepcopy`` keep of a DDP, and what is rebuilt on load.
``checkin.py``
    Each forward's part in :mod:`phalanx.diagnostics`: a sync point before the step's
    collectives, the step clock, straggler reports.
``joining.py``
    Its part in :mod:`phalanx.uneven` (join): an active rank's divisor and buffer source, a
    joined rank's shadow of the buckets and buffers, the final sync.
``bucketing.py``
    Pure planning: which parameter's gradient goes where in which flat buffer (no
    communication; testable alone), and each bucket's buffer at run time.
``buffer_sync.py``
    Before a forward: rank 0's buffers (BatchNorm statistics...) to every rank.
``graph_walk.py``
    After a forward, with ``find_unused_parameters``: which parameters the outputs can reach.
``reducer.py``
    During backward: grad-ready hooks copy each gradient into its bucket; a full bucket is
    launched, in bucket order; the end of backward waits, writes ``.grad`` back and raises
    every rank's unused-parameter report on every rank (worded by ``problems.py``).
``riding.py``
    A step whose gradients fit one small float32 CPU bucket: the forward's sync point rides
    that bucket's all-reduce, its head copied in with the gradients, its verdict read first.
``unusual.py``
    The reducer's slow path: gradients with a graph (``create_graph=True``) and sparse
    gradients of parameters bucketed as dense.
``sparse.py``
    Sparse gradients (``nn.Embedding(sparse=True)``...): in no bucket, all-reduced as sparse
    tensors at the end of the backward.
``bucket_comm.py``
    How one bucket is reduced (the :class:`~phalanx.ddp.bucket_comm.BucketComm` protocol):
    all-reduce of the mean, or ZeRO stage 2's reduce to the owner.
``hook_registration.py``
    What ``register_comm_hook`` and ``_register_builtin_comm_hook`` accept, refused with
    torch's exception classes and words; torch's built-in hooks as their Python twins.
``hook_comm.py``
    ``register_comm_hook``'s bucket communication (the hook writer's contract, ``GradBucket``
    and phased hooks, is :mod:`phalanx.hooks`): the hook called on each bucket, its future
    written back, the control tail reduced beside it, and collectives kept in the same order
    on every rank (phased hooks; hooks that issue from callbacks run one bucket at a time).
``reference.py``
    A naive per-parameter DDP, the oracle the bucketed one is tested against.
"""

from .wrapper import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
