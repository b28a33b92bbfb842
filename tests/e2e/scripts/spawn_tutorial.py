"""PyTorch's "Getting Started with Distributed Data Parallel" tutorial (demo_basic and
demo_checkpoint, started with torch.multiprocessing.spawn), with phalanx's imports.

What differs from the tutorial, and why: the imports (the point); the port and the checkpoint's
folder come from the command line (tests run side by side); the model goes to the CPU when
there are fewer GPUs than ranks (the tutorial needs a GPU per rank); each rank prints a
checksum of its parameters so the test can see the replicas agree.

    python spawn_tutorial.py PORT DIR
"""

import os
import sys

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim

import phalanx as dist  # was: import torch.distributed as dist
from phalanx import (
    DistributedDataParallel as DDP,  # was: from torch.nn.parallel import ...
)

PORT, CHECKPOINT_DIR = sys.argv[1], sys.argv[2]


def setup(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = PORT

    # initialize the process group
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def place(rank, world_size):
    """The tutorial's ``rank`` as device, or the CPU (model, device_ids)."""
    if torch.cuda.device_count() >= world_size:
        return rank, [rank]
    return "cpu", None


def report(rank, name, ddp_model):
    total = sum(p.double().sum().item() for p in ddp_model.parameters())
    print(f"{name} rank {rank} checksum {total:.10f}", flush=True)


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)

    # create model and move it to GPU with id rank
    device, device_ids = place(rank, world_size)
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=device_ids)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10).to(device))
    labels = torch.randn(20, 5).to(device)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    report(rank, "basic", ddp_model)

    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")


def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn,
             args=(world_size,),
             nprocs=world_size,
             join=True)


def demo_checkpoint(rank, world_size):
    print(f"Running DDP checkpoint example on rank {rank}.")
    setup(rank, world_size)

    device, device_ids = place(rank, world_size)
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=device_ids)

    CHECKPOINT_PATH = CHECKPOINT_DIR + "/model.checkpoint"
    if rank == 0:
        # All processes should see same parameters as they all start from same
        # random parameters and gradients are synchronized in backward passes.
        # Therefore, saving it in one process is sufficient.
        torch.save(ddp_model.state_dict(), CHECKPOINT_PATH)

    # Use a barrier() to make sure that process 1 loads the model after process
    # 0 saves it.
    dist.barrier()
    # configure map_location properly
    map_location = {'cuda:%d' % 0: 'cuda:%d' % rank} if device != "cpu" else "cpu"
    ddp_model.load_state_dict(
        torch.load(CHECKPOINT_PATH, map_location=map_location, weights_only=True))

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10).to(device))
    labels = torch.randn(20, 5).to(device)

    loss_fn(outputs, labels).backward()
    optimizer.step()
    report(rank, "checkpoint", ddp_model)

    # Not necessary to use a dist.barrier() to guard the file deletion below
    # as the AllReduce ops in the backward pass of DDP already served as
    # a synchronization.

    if rank == 0:
        os.remove(CHECKPOINT_PATH)

    cleanup()
    print(f"Finished running DDP checkpoint example on rank {rank}.")


if __name__ == "__main__":
    world_size = 2
    run_demo(demo_basic, world_size)
    run_demo(demo_checkpoint, world_size)
