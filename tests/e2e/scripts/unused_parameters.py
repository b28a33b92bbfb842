"""Issue 25 item 6's script: a model whose 24 parameters of 12 layers take no part in the
loss, under DDP with find_unused_parameters=False: every rank raises the same long
UnusedParametersError. Each rank lingers at exit so that both have printed it before either
ends (the launcher stops the other ranks when the first one exits)."""

import atexit
import time

import torch
from torch import nn

import phalanx

phalanx.init_process_group("gloo")
# Run after the traceback is printed (the interpreter prints it before the atexit handlers);
# a second is ample for the other rank to print its own, even on a loaded machine.
atexit.register(time.sleep, 1.0)


class HalfUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused_blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(12))  # 24 parameters

    def forward(self, x):
        return self.used(x)


model = phalanx.DistributedDataParallel(HalfUsed())
model(torch.randn(4, 8)).sum().backward()
phalanx.destroy_process_group()
