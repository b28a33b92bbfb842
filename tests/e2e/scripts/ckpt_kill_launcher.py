"""Save two sharded checkpoints; pause inside the second at a point (tests/e2e/test_checkpoint_kill_launcher.py).

    phalanx run --nproc-per-node 2 ckpt_kill_launcher.py DIR POINT

POINT is ``mid-write`` (rank 1 inside DCP's write, a blocking save), ``before-rename``
(rank 0 about to rename the complete directory into place, a blocking save) or
``async-mid-write`` (rank 0 inside DCP's write, a background save). There the rank writes
its pid to ``DIR.paused`` and sleeps until killed: the test kills the launcher then.
"""

import os
import sys
import time

import torch

import phalanx
from phalanx.checkpoint import dcp_checkpoint, dcp_engine

directory, point = sys.argv[1], sys.argv[2]


def pause(*_args, **_kwargs):
    with open(f"{directory}.paused.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(f"{directory}.paused.tmp", f"{directory}.paused")
    time.sleep(600)


phalanx.init_process_group(backend="gloo")
rank = phalanx.get_rank()
model = torch.nn.Linear(64, 32)
ckpt = phalanx.Checkpointer(directory, model, format="sharded", keep=1)
ckpt.save(0, 1)
if (point, rank) in (("mid-write", 1), ("async-mid-write", 0)):
    dcp_engine.ChecksummingWriter.write = pause
elif (point, rank) == ("before-rename", 0):
    dcp_checkpoint.commit = pause
ckpt.save(0, 2, blocking=not point.startswith("async"))
ckpt.close()
phalanx.destroy_process_group()
