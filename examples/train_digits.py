"""Train a small CNN on scikit-learn's digits, on as many processes as you start.

Run book::

    phalanx run --nproc-per-node 2 examples/train_digits.py    # 2 processes on this machine
    torchrun --nproc-per-node 2 examples/train_digits.py       # the same script under torchrun
    srun --ntasks 4 python examples/train_digits.py            # under Slurm, no launcher
    python examples/train_digits.py                            # one process

Run it again and it resumes from its newest checkpoint in ``--out``, or says at once, before
importing torch, that a finished run trained ``--epochs`` already (``--fresh`` deletes
them and starts over; a larger ``--epochs`` trains on from where the last run ended, the
learning rate's cosine stretched over the new total from the step reached, see ``stretch``). A SIGTERM (e.g.
from ``phalanx run`` being stopped) or a Ctrl-C makes every rank save one checkpoint at the
same step and exit (75 "preempted", 130 after Ctrl-C); the next run continues from there,
mid-epoch, at any number of processes.

The steps, in order:

1. ``init_process_group`` joins the job and pins this process to its device (``LOCAL_RANK``);
2. the model is wrapped in ``DistributedDataParallel``: rank 0's weights are broadcast, and
   gradients are averaged by all-reduce while the backward pass runs;
3. a ``DistributedSampler`` gives every process its own slice, reshuffled by ``set_epoch``;
4. training, then an exact evaluation (every test sample counted once, sums all-reduced);
5. a checkpoint written by rank 0 alone, the other ranks waiting at a barrier;
6. ``destroy_process_group``.

Outputs in ``--out``: ``ckpt-*.ckpt`` checkpoints, ``curves.png`` (loss and accuracy per
epoch) and ``metrics.json``. Needs ``pip install 'phalanx[examples]'`` (scikit-learn,
matplotlib, tqdm).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

from phalanx.env import detect


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/digits", help="checkpoints, curves.png, metrics.json")
    p.add_argument("--fresh", action="store_true", help="delete --out (checkpoints, curves) and start over")
    p.add_argument("--sync-bn", action="store_true", help="batch statistics over all processes")
    return p.parse_args(argv)


def already_trained(done: int, epochs: int) -> str:
    """What a run with nothing left to train says."""
    done_text = f"{done} of {epochs}" if done == epochs else f"{done} (more than --epochs {epochs})"
    return (f"already trained {done_text} epochs; pass --epochs N to train on or --fresh to "
            "start over")


def finished_before(args: argparse.Namespace) -> str | None:
    """:func:`already_trained`'s line when ``--out`` holds a finished run of at least
    ``--epochs``, found without torch (whose import costs every process a second or two): its
    metrics.json, written at the run's end, names the checkpoint it ended with, still the
    newest. ``None`` otherwise, and whenever some rank may not see these files (ranks on other
    machines): then the checkpoint decides, in a collective every rank takes part in."""
    env = detect()
    if args.fresh or env.world_size != env.local_world_size:
        return None
    out = Path(args.out)
    try:
        metrics = json.loads((out / "metrics.json").read_text())
        done, ended_with = int(metrics["history"][-1]["epoch"]), metrics["checkpoint"]
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return None  # no finished run here, or one written before metrics named its checkpoint
    newest = max((p.name for p in out.glob("ckpt-*.ckpt")), default=None)  # 12-digit steps
    if newest != ended_with or done < args.epochs:
        return None
    return already_trained(done, args.epochs)


if __name__ == "__main__":  # before torch's import: a finished run says so at once
    _done = finished_before(parse_args())
    if _done is not None:
        if detect().rank == 0:
            print(_done, flush=True)
        sys.exit(0)

import torch  # noqa: E402 - after the check above
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import phalanx  # noqa: E402


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 1797 8x8 digits, split 80/20 identically on every rank."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = len(x) // 5
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Dropout(0.25),
        nn.Linear(128, 10),
    )


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Loss and accuracy over the whole test set, each sample counted once: every rank sums its
    own shard (uneven, maybe empty: pad=False), then one all-reduce adds the sums."""
    model.eval()
    sums = phalanx.MetricSum("loss", "correct", "samples")
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            sums.add(loss=F.cross_entropy(logits, y, reduction="sum"),
                     correct=(logits.argmax(1) == y).sum(), samples=len(y))
    totals = sums.compute()
    model.train()
    return totals["loss"] / totals["samples"], totals["correct"] / totals["samples"]


def stretch(scheduler, total_steps: int) -> None:
    """Make a loaded ``CosineAnnealingLR`` span ``total_steps`` from the step it reached.

    The checkpoint holds the schedule of the run that saved it; with a larger ``--epochs``
    its cosine would have reached 0 and climb back. Instead the curve is the one a run asked
    for ``--epochs`` from the start would follow: ``T_max`` becomes the new total, and the
    learning rate this step's value on it (the scheduler goes on from there).
    """
    step = min(scheduler.last_epoch, total_steps)
    scheduler.T_max = total_steps
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = scheduler.eta_min + (base - scheduler.eta_min) * 0.5 * (
            1 + math.cos(math.pi * step / total_steps))


def where_resumed(state, sampler, loader, args) -> str:
    """What a resumed run says: at an epoch's end, or mid-epoch (after a preemption)."""
    saved = sampler.state_dict()
    if saved["epoch"] == state.epoch and 0 < saved["position"] < len(sampler.dataset):
        per_epoch = math.ceil(sampler.num_samples / args.batch_size)
        done = per_epoch - len(loader)  # the loader now serves the rest of the epoch only
        return (f"resumed from {state.path.name} in epoch {state.epoch + 1} of {args.epochs}, "
                f"after {done} of {per_epoch} batches (step {state.step})")
    return (f"resumed from {state.path.name}: {state.epoch} of {args.epochs} epochs done "
            f"(step {state.step})")


def progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety; training does not need it
        return None
    # a refresh every half second keeps logs (and the launcher's rank prefixes) readable
    return tqdm(total=total, desc=desc, unit="batch", leave=False, disable=not enabled,
                mininterval=0.5)


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax_loss.plot(epochs, [h["train_loss"] for h in history], label="train")
    ax_loss.plot(epochs, [h["test_loss"] for h in history], label="test")
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_acc.plot(epochs, [100 * h["test_accuracy"] for h in history], color="tab:green")
    ax_acc.set(xlabel="epoch", ylabel="%", title="test accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train_epoch(model, loader, optimizer, scheduler, epoch, step, args, preemption, ckpt, history):
    """One epoch on this rank's slice; returns (loss sum, samples, step). Exits if preempted."""
    rank, world, device = phalanx.get_rank(), phalanx.get_world_size(), phalanx.get_device()
    bar = progress(len(loader), f"epoch {epoch + 1}/{args.epochs}", rank == 0)
    loss_sum, seen, started = 0.0, 0, time.perf_counter()
    for i, (x, y) in enumerate(loader):
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the all-reduce of gradient buckets overlaps this
        optimizer.step()
        scheduler.step()
        step += 1
        loss_sum += loss.item() * len(y)
        seen += len(y)
        if bar is not None:
            rate = seen * world / (time.perf_counter() - started)
            bar.set_postfix(loss=f"{loss.item():.3f}", samples_s=f"{rate:.0f}")
            bar.update()
        if preemption.should_stop():  # agreed by all ranks at this step boundary
            ckpt.save(epoch, step, consumed=(i + 1) * args.batch_size, extra={"history": history})
            preemption.exit()  # exit status 75: preempted, resumable (130 after Ctrl-C)
    if bar is not None:
        bar.refresh()  # its final state, 100%: mininterval may have skipped the last redraw,
        bar.close()  # and a log keeps the state before leave=False clears the bar
    return loss_sum, seen, step


def resume(ckpt, scheduler, total_steps, sampler, loader, args):
    """Load the newest checkpoint (a collective, so every rank sees rank 0's ``--fresh``
    clean-up): ``(first epoch, step, history)``, or ``None`` if ``--epochs`` are done."""
    state = ckpt.load()
    rank = phalanx.get_rank()
    if state is None:
        return 0, 0, []
    if state.epoch >= args.epochs:
        if rank == 0:
            print(already_trained(state.epoch, args.epochs), flush=True)
        return None
    stretch(scheduler, total_steps)  # the current --epochs' curve, from this step
    if rank == 0:
        print(where_resumed(state, sampler, loader, args), flush=True)
    return state.epoch, state.step, state.extra.get("history", [])


def report(model: nn.Module, test_loader: DataLoader, history: list[dict], out: Path,
           n_test: int, ckpt) -> None:
    """The final evaluation; rank 0 writes curves.png and metrics.json (naming the newest of
    ``ckpt``'s checkpoints, the one the run ended with: see :func:`finished_before`) and says so."""
    world = phalanx.get_world_size()
    test_loss, accuracy = evaluate(model, test_loader, phalanx.get_device())
    if phalanx.get_rank() == 0:
        plot(history, out / "curves.png")
        (out / "metrics.json").write_text(json.dumps(
            {"world_size": world, "test_accuracy": accuracy, "test_loss": test_loss,
             "checkpoint": ckpt.checkpoints()[-1].name, "history": history}, indent=2))
        processes = "1 process" if world == 1 else f"{world} processes"
        print(f"final test accuracy {100 * accuracy:.2f}% on {n_test} samples "
              f"({processes}); curves in {out / 'curves.png'}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # 1. join the job; the process is pinned to cuda:LOCAL_RANK when it has a GPU
    phalanx.init_process_group()
    rank, device = phalanx.get_rank(), phalanx.get_device()
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)

    train_set, test_set = digits(args.seed)
    # 3. each rank its own slice; the test sampler pads nothing, so evaluation is exact
    sampler = phalanx.DistributedSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        generator=torch.Generator())  # own generator: resume stays exact
    test_loader = DataLoader(test_set, batch_size=256,
                             sampler=phalanx.DistributedSampler(test_set, shuffle=False, pad=False))

    model = phalanx.SyncBatchNorm.convert_sync_batchnorm(cnn()) if args.sync_bn else cnn()
    # 2. full replica per process; gradients averaged during backward
    model = phalanx.DistributedDataParallel(model.to(device))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    total_steps = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)

    # 5. rank 0 writes, the others wait; rerunning resumes from the newest checkpoint
    out = Path(args.out)
    if args.fresh and rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    ckpt = phalanx.Checkpointer(out, model, optimizer, scheduler=scheduler, sampler=sampler, keep=2)
    resumed = resume(ckpt, scheduler, total_steps, sampler, loader, args)
    if resumed is None:  # trained --epochs already
        phalanx.destroy_process_group()
        return
    start_epoch, step, history = resumed

    with phalanx.PreemptionHandler() as preemption:
        for epoch in range(start_epoch, args.epochs):
            sampler.set_epoch(epoch)  # same shuffle on every rank, new each epoch
            lr_start = optimizer.param_groups[0]["lr"]
            loss_sum, seen, step = train_epoch(model, loader, optimizer, scheduler, epoch, step,
                                               args, preemption, ckpt, history)
            # 4. exact evaluation on the unwrapped model (ranks may hold different batch counts)
            test_loss, accuracy = evaluate(model.module, test_loader, device)
            train_loss = torch.tensor([loss_sum, seen], dtype=torch.float64, device=device)
            dist.all_reduce(train_loss)
            history.append({"epoch": epoch + 1, "train_loss": (train_loss[0] / train_loss[1]).item(),
                            "test_loss": test_loss, "test_accuracy": accuracy,
                            "lr": [lr_start, optimizer.param_groups[0]["lr"]]})
            if rank == 0:
                print(f"epoch {epoch + 1}: train loss {history[-1]['train_loss']:.4f}  test loss "
                      f"{test_loss:.4f}  test accuracy {100 * accuracy:.2f}%", flush=True)
            ckpt.save(epoch + 1, step, extra={"history": history})

    report(model.module, test_loader, history, out, len(test_set), ckpt)
    phalanx.barrier()
    # 6. leave the job
    phalanx.destroy_process_group()


if __name__ == "__main__":
    main()
