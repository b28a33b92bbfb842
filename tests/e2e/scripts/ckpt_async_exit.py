"""Save a sharded checkpoint in the background and end at once (tests/e2e/test_checkpoint_async_exit.py).

    python ckpt_async_exit.py DIR destroy|exit|torch-exit|alone

``destroy``: join the job, save, ``phalanx.destroy_process_group()`` at once; ``exit``: join,
save, end without destroying the group; ``torch-exit``: the same with a group made by torch's
``init_process_group``; ``alone``: no process group at all, save, end. Every rank's writer
sleeps 2 s first, so the save is surely still in flight when the script ends. The last thing
the process does is say whether a process group is still alive then (it should not be: a Gloo
group that goes with the interpreter can abort the process).
"""

import atexit
import sys
import time

import torch
import torch.distributed as dist

import phalanx
from phalanx.checkpoint import dcp_engine

write = dcp_engine.ChecksummingWriter.write


def slow_write(self, *args, **kwargs):  # a slow disk: the script ends long before the save
    time.sleep(2.0)
    return write(self, *args, **kwargs)


dcp_engine.ChecksummingWriter.write = slow_write

directory, mode = sys.argv[1], sys.argv[2]
atexit.register(lambda: print(f"group alive at exit: {dist.is_initialized()}", flush=True))  # runs last
if mode == "torch-exit":
    dist.init_process_group(backend="gloo")
elif mode != "alone":
    phalanx.init_process_group(backend="gloo")
model = torch.nn.Linear(256, 256)
with torch.no_grad():
    for p in model.parameters():
        p.fill_(float(phalanx.get_world_size()) + 0.5)
ckpt = phalanx.Checkpointer(directory, model, format="sharded")
ckpt.save(0, 7, extra={"mode": mode}, blocking=False)
if mode == "destroy":
    phalanx.destroy_process_group()
