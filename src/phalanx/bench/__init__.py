"""``phalanx bench``: phalanx's DDP against torch's DDP and one process, side by side.

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
``ranks.py``
    No torch: how every benchmark script starts its ranks, through the launcher's
    :func:`~phalanx.launcher.launch` as ``phalanx bench`` does, and reads rank 0's result.

Importing this package imports no torch, so ``phalanx bench`` reports cheaply.
"""
