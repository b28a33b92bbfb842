"""``phalanx bench``: phalanx's DDP against torch's DDP and one process, side by side (or, with
``--fully-shard``, phalanx's ``fully_shard`` against torch's).

The files, in the order data flows through them:

``engine.py``
    Runs on every rank (``python -m phalanx.bench``, started by the launcher): builds the
    models, takes turns step by step (A B, B A, ...), and rank 0 writes every step time.
``report.py``
    No torch: turns the step times into the table (medians, paired ratio, scaling
    efficiency, exposed communication) and the chart.
``options.py``
    No torch: ``--comm-hook`` and the checks of the counts (``--steps``...), shared by the
    engine and the ``phalanx bench`` command.
``netns.py``
    No torch: two network namespaces joined by a veth pair, optionally rate-limited by
    ``tc`` (benchmarks/bench_slow_link.py; the launcher's multi-node and elastic tests).
``nodes.py``
    No torch: a benchmark's two ranks started as two nodes, one in each of those namespaces
    (benchmarks/bench_slow_link.py, benchmarks/bench_fsdp.py ``--rate``).
``ranks.py``
    No torch: how every benchmark script starts its ranks, through the launcher's
    :func:`~phalanx.launcher.launch` as ``phalanx bench`` does, and reads rank 0's result.
``fsdp.py``
    On a rank: a model sharded by phalanx's or torch's ``fully_shard`` (on the meta device
    if asked) or replicated by a DDP, the bytes a rank holds and sends, its peak memory and a
    memory limit (``phalanx bench --fully-shard``, benchmarks/bench_fsdp.py,
    benchmarks/bench_fsdp_memory.py).

Importing this package imports no torch, so ``phalanx bench`` reports cheaply.
"""
