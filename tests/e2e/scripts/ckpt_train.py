"""A deterministic data-parallel training run that checkpoints, resumes and can be preempted.

Run under ``phalanx run``. Every run resumes from the newest checkpoint of ``--dir`` if there
is one. Each rank appends to ``<dir>/samples.rank<R>.log``:

    R <attempt> <step>                     this attempt resumed after global step <step>
    S <attempt> <epoch> <step> <index>     sample <index> was trained on at global step <step>

At the end rank 0 saves a final checkpoint (step = total steps), which the tests compare.

--kill-at-step K   attempt 0 only: rank 1 SIGKILLs itself right after step K (a crash)
--preempt-at-step K  attempt 0 only: rank 0 sends itself SIGUSR1 after step K (preemption)
--step-delay S     sleep S seconds per step (to leave time to signal the launcher)
--global-batch G   accumulate micro-batches of --batch so that every step trains on G samples
                   at any world size (phalanx.accumulation_steps)
"""

import argparse
import contextlib
import os
import signal
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.env import detect

p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--samples", type=int, default=96)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--save-every", type=int, default=5)
p.add_argument("--kill-at-step", type=int, default=None)
p.add_argument("--preempt-at-step", type=int, default=None)
p.add_argument("--step-delay", type=float, default=0.0)
p.add_argument("--global-batch", type=int, default=None)
args = p.parse_args()

torch.set_num_threads(1)
phalanx.init_process_group(backend="gloo")
rank, world = phalanx.get_rank(), phalanx.get_world_size()
attempt = detect().restart_count
steps = phalanx.accumulation_steps(args.global_batch, args.batch) if args.global_batch else 1

data = torch.Generator().manual_seed(7)
dataset = TensorDataset(torch.randn(args.samples, 8, generator=data),
                        torch.randint(0, 3, (args.samples,), generator=data),
                        torch.arange(args.samples))
torch.manual_seed(1000 + rank)  # per-rank streams: dropout differs by rank, DDP syncs the init
model = phalanx.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 3)))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)
sampler = phalanx.DistributedSampler(dataset, seed=11)
# Its own generator: the DataLoader's base seed must not come from the global RNG stream,
# which a run resumed mid-epoch would tap at another moment than the uninterrupted run.
loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, generator=torch.Generator())
ckpt = phalanx.Checkpointer(args.dir, model, optimizer, scheduler=scheduler, sampler=sampler)

state = ckpt.load()  # resume="auto"
epoch, step = (state.epoch, state.step) if state else (0, 0)
Path(args.dir).mkdir(parents=True, exist_ok=True)
log = open(Path(args.dir) / f"samples.rank{rank}.log", "a")
log.write(f"R {attempt} {step}\n")
log.flush()

with phalanx.PreemptionHandler() as preemption:
    for epoch in range(epoch, args.epochs):
        sampler.set_epoch(epoch)
        pending = []
        for i, (x, y, index) in enumerate(loader):
            last = (i + 1) % steps == 0 or i + 1 == len(loader)
            with contextlib.nullcontext() if last else model.no_sync():
                (torch.nn.functional.cross_entropy(model(x), y) / steps).backward()
            pending += index.tolist()
            if not last:
                continue
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            step += 1
            log.write("".join(f"S {attempt} {epoch} {step} {j}\n" for j in pending))
            log.flush()
            pending = []
            time.sleep(args.step_delay)
            if attempt == 0 and step == args.kill_at_step and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if attempt == 0 and step == args.preempt_at_step and rank == 0:
                os.kill(os.getpid(), signal.SIGUSR1)
            consumed = min((i + 1) * args.batch, len(sampler))
            if preemption.should_stop():
                ckpt.save(epoch, step, consumed=consumed)
                print(f"preempted at step {step}", flush=True)
                preemption.exit()
            if step % args.save_every == 0:
                ckpt.save(epoch, step, consumed=consumed)
ckpt.save(args.epochs, step, extra={"final": True})
phalanx.destroy_process_group()
