"""phalanx DDP against torch DDP side by side, with scaling and world-size-1 overhead.

This is ``phalanx bench`` with the settings of docs/benchmarks.md's DDP table: two models of
few large tensors (mlp: 10.5M parameters in 8 tensors; cnn: 0.36M with BatchNorm) and two of
many small ones, as transformers are trained today (deep-mlp: 402 tensors; gpt: 24 blocks,
293 tensors)::

    python benchmarks/bench_ddp.py                  # mlp, cnn, deep-mlp and gpt, 2 processes, Gloo
    python benchmarks/bench_ddp.py --repeats 9      # any `phalanx bench` option overrides

See ``phalanx bench -h`` and :mod:`phalanx.bench.report` for what each column means; the
measurement code is :mod:`phalanx.bench.engine`.
"""

import sys

from phalanx.cli import main

TABLE_SETTINGS = ["bench", "--model", "mlp", "cnn", "deep-mlp", "gpt", "--nproc-per-node", "2",
                  "--repeats", "5", "--steps", "10", "--warmup", "3", "--batch-size", "64",
                  "--out", "runs/bench-ddp"]

if __name__ == "__main__":
    raise SystemExit(main(TABLE_SETTINGS + sys.argv[1:]))
