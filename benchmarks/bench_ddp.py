"""phalanx DDP against torch DDP side by side, with scaling and world-size-1 overhead.

This is ``phalanx bench`` with the settings of docs/benchmarks.md's DDP table::

    python benchmarks/bench_ddp.py                  # mlp (10.5M params) and cnn, 2 processes, Gloo
    python benchmarks/bench_ddp.py --repeats 9      # any `phalanx bench` option overrides

See ``phalanx bench -h`` and :mod:`phalanx.bench.report` for what each column means; the
measurement code is :mod:`phalanx.bench.engine`.
"""

import sys

from phalanx.cli import main

TABLE_SETTINGS = ["bench", "--model", "mlp", "cnn", "--nproc-per-node", "2", "--repeats", "5",
                   "--steps", "10", "--warmup", "3", "--batch-size", "64", "--out", "runs/bench-ddp"]

if __name__ == "__main__":
    raise SystemExit(main(TABLE_SETTINGS + sys.argv[1:]))
