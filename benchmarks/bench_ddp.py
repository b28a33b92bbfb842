"""phalanx DDP against torch DDP side by side, with scaling and world-size-1 overhead.

This is ``phalanx bench`` with the settings of docs/benchmarks.md's DDP table: two models of
few large tensors (mlp: 10.5M parameters in 8 tensors; cnn: 0.36M with BatchNorm) and two of
many small ones, as transformers are trained today (deep-mlp: 402 tensors; gpt: 24 blocks,
293 tensors). phalanx runs over its shared-memory backend (``shared_memory=True``), torch's DDP
over Gloo (its default), and torch's DDP over phalanx's backend beside them (the transport
alone)::

    python benchmarks/bench_ddp.py                        # mlp, cnn, deep-mlp and gpt, 2 processes
    python benchmarks/bench_ddp.py --no-shared-memory     # everything on Gloo (the earlier table)
    python benchmarks/bench_ddp.py --repeats 9            # any `phalanx bench` option overrides

Each repeat times 10 steps per implementation, or as many as take half a second where 10
take less (``--min-seconds 0.5``: deep-mlp's 15 ms steps), so that no ratio rests on a
fraction of a second.

Goals (issue 35), at 2 processes: phalanx/torch <= 0.90 on mlp and deep-mlp; on cnn and gpt,
phalanx/torch <= 0.95 and what phalanx's DDP adds over the single process (printed under the
table) at most half of what torch's adds. See ``phalanx bench -h`` and
:mod:`phalanx.bench.report` for what each column means; the measurement code is
:mod:`phalanx.bench.engine`.
"""

import sys

from phalanx.cli import main

TABLE_SETTINGS = ["bench", "--model", "mlp", "cnn", "deep-mlp", "gpt", "--nproc-per-node", "2",
                  "--repeats", "5", "--steps", "10", "--min-seconds", "0.5", "--warmup", "3",
                  "--batch-size", "64", "--shared-memory", "--out", "runs/bench-ddp"]

if __name__ == "__main__":
    raise SystemExit(main(TABLE_SETTINGS + sys.argv[1:]))
