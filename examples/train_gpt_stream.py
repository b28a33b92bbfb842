"""Train a tiny GPT on pre-tokenised shards streamed by phalanx.StreamingDataset.

Run book::

    phalanx run --nproc-per-node 2 examples/train_gpt_stream.py    # writes the shards, trains
    # Ctrl-C mid-epoch: every rank saves at the same step and exits (130)
    phalanx run --nproc-per-node 3 examples/train_gpt_stream.py    # resumes at 3 ranks

The first run writes a synthetic corpus (token runs that count up by a per-run stride, so the
model has something to learn) as raw ``uint16`` shards with
``phalanx.streaming.write_token_shards``, into ``--data``. Every run streams them through
``phalanx.StreamingDataset`` with ``--workers`` DataLoader workers per rank: each sample once per
epoch over all ranks and workers; a run stopped mid-epoch (Ctrl-C, SIGTERM, or
``--stop-at-step``) saves the data set's global position in its checkpoint, and the next run, at
any number of ranks and workers, trains on exactly the samples the epoch has left. The loss is
token-weighted (``phalanx.token_loss_scale``): the gradient of the global per-token mean.

Outputs in ``--out``: checkpoints and ``metrics.json`` (per epoch: mean loss, samples trained).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import phalanx


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=Path("runs/gpt_stream/shards"))
    p.add_argument("--out", type=Path, default=Path("runs/gpt_stream/ckpt"))
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--samples", type=int, default=1200, help="corpus size, in samples")
    p.add_argument("--save-every", type=int, default=20, help="steps")
    p.add_argument("--stop-at-step", type=int, default=0,
                   help="send this process a Ctrl-C (SIGINT) after that global step (demo/tests)")
    return p.parse_args(argv)


def write_corpus(directory: Path, samples: int, seq_len: int, vocab: int) -> None:
    """Runs of tokens counting up by a stride (1-4) from a random start, as shards of 100."""
    g = torch.Generator().manual_seed(0)
    runs = []
    for _ in range(samples):
        start, stride = torch.randint(vocab, (1,), generator=g), torch.randint(1, 5, (1,), generator=g)
        runs.append((start + stride * torch.arange(seq_len + 1)) % vocab)
    phalanx.streaming.write_token_shards(torch.cat(runs), directory, seq_len + 1, samples_per_shard=100)


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.embed(x) + self.position(torch.arange(n, device=x.device))
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=x.device)
        return self.head(self.blocks(h, mask=mask, is_causal=True))


def train_step(model, optimizer, batch: torch.Tensor) -> tuple[float, int]:
    """One step on this rank's batch; the loss summed over its tokens, and their count."""
    x, y = batch[:, :-1].long(), batch[:, 1:].long()
    scale = phalanx.token_loss_scale(y.numel())  # ranks' batches may differ at an epoch's end
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
    (loss * scale).backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item(), y.numel()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = 256
    phalanx.init_process_group()
    if phalanx.get_rank() == 0 and not args.data.exists():
        write_corpus(args.data, args.samples, args.seq_len, vocab)
    phalanx.barrier()
    data = phalanx.StreamingDataset(
        phalanx.streaming.TokenFiles(args.data, seq_len=args.seq_len + 1),
        batch_size=args.batch_size, ends="drop", seed=0, shuffle_block=256)
    loader = DataLoader(data, batch_size=args.batch_size, num_workers=args.workers,
                        persistent_workers=args.workers > 0)
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(TinyGPT(vocab, args.seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ckpt = phalanx.Checkpointer(args.out, model, optimizer, sampler=data)
    state = ckpt.load()
    epoch, step = (state.epoch, state.step) if state else (0, 0)
    history = state.extra.get("history", []) if state else []
    if state and phalanx.get_rank() == 0:
        print(f"resumed at epoch {epoch}, step {step}, sample {data.state_dict(consumed=0)['position']}"
              f" of {data.num_samples}, now {phalanx.get_world_size()} ranks", flush=True)
    with phalanx.PreemptionHandler() as preemption:
        for epoch in range(epoch, args.epochs):
            data.set_epoch(epoch)  # keeps a restored mid-epoch position
            before = data.state_dict(consumed=0)["position"]  # samples done before this run
            sums = phalanx.MetricSum("loss", "tokens", "samples")
            for batches, batch in enumerate(loader, 1):
                loss, tokens = train_step(model, optimizer, batch)
                sums.add(loss=loss, tokens=tokens, samples=len(batch))
                step += 1
                if step == args.stop_at_step:
                    os.kill(os.getpid(), signal.SIGINT)  # what a Ctrl-C does
                consumed = batches * args.batch_size
                if preemption.should_stop():
                    ckpt.save(epoch, step, consumed=consumed, extra={"history": history})
                    preemption.exit()  # 130 after Ctrl-C, 75 after SIGTERM: resumable
                if step % args.save_every == 0:
                    ckpt.save(epoch, step, consumed=consumed, extra={"history": history})
            totals = sums.compute()
            history.append({"epoch": epoch, "loss": totals["loss"] / max(totals["tokens"], 1),
                            "samples": before + int(totals["samples"])})
            if phalanx.get_rank() == 0:
                print(f"epoch {epoch}: loss {history[-1]['loss']:.3f} over "
                      f"{history[-1]['samples']} samples", flush=True)
            ckpt.save(epoch + 1, step, consumed=len(data), extra={"history": history})
    if phalanx.get_rank() == 0:
        (args.out / "metrics.json").write_text(json.dumps(history, indent=1))
    phalanx.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
