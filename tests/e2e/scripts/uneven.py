"""The DDP tutorial's loop with uneven inputs and no join: rank 0 has 5 batches, rank 1 has 4,
so rank 1 ends its script (exit code 0) while rank 0 waits for it in its fifth step."""

import torch

import phalanx
from phalanx import DistributedDataParallel as DDP

phalanx.init_process_group(backend="gloo")
model = DDP(torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5 if phalanx.get_rank() == 0 else 4):
    optimizer.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
