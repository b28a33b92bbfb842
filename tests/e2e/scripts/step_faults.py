"""A training loop's page faults: the benchmark's MLP (10.5M parameters, 42 MB of gradients)
trained with SGD; prints the minor page faults per step after 3 warm-up steps, as
``faults/step N``."""

import resource

import torch
import torch.nn.functional as F

from phalanx.bench.engine import make_batch, mlp

torch.set_num_threads(1)
torch.manual_seed(0)
model = mlp()
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
x, y = make_batch("mlp", 64, seed=1)


def step() -> None:
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


for _ in range(3):
    step()
before = faults()
for _ in range(10):
    step()
print(f"faults/step {(faults() - before) / 10:.0f}", flush=True)
