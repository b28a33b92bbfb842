"""A tiny deterministic data-parallel training run; rank 0 saves the final parameters.

--ddp phalanx: phalanx.init_process_group + phalanx.DistributedDataParallel.
--ddp torch:   only torch.distributed and torch's DistributedDataParallel (torchrun-style).
--fail-once-rank R: rank R exits 3 after the first step of attempt 0 (restart tests).
--listeners FILE: each rank writes FILE.rankR: `ss -ltnH`, the listening TCP sockets of its
                  network namespace, while every process of the job runs; and
                  FILE.launcher.rankR: the addresses its launcher and store helper listen on.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--ddp", choices=["phalanx", "torch"], default="phalanx")
p.add_argument("--steps", type=int, default=5)
p.add_argument("--fail-once-rank", type=int, default=None)
p.add_argument("--listeners", default=None)
args = p.parse_args()

torch.set_num_threads(1)
if args.ddp == "phalanx":
    import phalanx

    phalanx.init_process_group(backend="gloo")
    wrap = phalanx.DistributedDataParallel
else:
    dist.init_process_group("gloo")
    wrap = torch.nn.parallel.DistributedDataParallel
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

torch.manual_seed(0)
model = wrap(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(args.steps):
    g = torch.Generator().manual_seed(1000 * step + rank)  # each global rank its own batch
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if step == 0 and attempt == 0 and rank == args.fail_once_rank:
        sys.exit(3)

if rank == 0:
    state = {k.removeprefix("module."): v for k, v in model.state_dict().items()}
    torch.save({"state": state, "world": world, "attempt": attempt}, args.out)
if args.listeners:
    import json
    import subprocess

    import psutil

    ss = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    with open(f"{args.listeners}.rank{rank}", "w") as f:
        f.write(ss)
    launcher = psutil.Process(os.getppid())
    helpers = [c for c in launcher.children() if "phalanx.launcher.storehost" in c.cmdline()]
    with open(f"{args.listeners}.launcher.rank{rank}", "w") as f:
        json.dump([c.laddr[0] for proc in [launcher, *helpers]
                   for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN], f)
print(f"rank {rank}/{world} attempt {attempt} trained", flush=True)
dist.barrier()
dist.destroy_process_group()
