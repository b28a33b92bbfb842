"""The DDP tutorial's loop, endless, for a Ctrl-C: each rank writes ``ready.<rank>`` in the
folder given once it has taken a step."""

import os
import sys

import torch

import phalanx
from phalanx import DistributedDataParallel as DDP

phalanx.init_process_group(backend="gloo")
model = DDP(torch.nn.Linear(64, 64))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0
while True:
    optimizer.zero_grad()
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    step += 1
    if step == 1:
        open(os.path.join(sys.argv[1], f"ready.{phalanx.get_rank()}"), "w").close()
