"""Runs every Python example of README.md and docs/*.md, as written, in one process at world
size 1: ``python -m tests.docs_examples`` prints one JSON line per example (its name, and the
traceback when it failed). tests/unit/test_docs.py starts it and reads the lines.

Each example runs in a namespace of its own, given the objects its text assumes (a model, a
loader, an optimizer...: ``FIXTURES``), in a scratch directory, so the checkpoints and files
the examples write go there. An example that calls ``init_process_group`` itself runs without a
process group; the others get the group of one process that ``phalanx.init_process_group()``
makes without a launcher. The README's two-column import table runs column by column.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
import types

from tests.docs_pages import Block, blocks, pages

# The objects the examples' text takes as given, small enough to run in a second.
DATA = """
import torch, phalanx
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x)

loss_fn = torch.nn.functional.cross_entropy
x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
val_set = TensorDataset(torch.randn(20, 4), torch.randint(0, 2, (20,)))
"""
FIXTURES = DATA + """
sampler = phalanx.DistributedSampler(val_set)
loader = DataLoader(val_set, batch_size=4, sampler=sampler)
net = Net()
model = ddp = phalanx.DistributedDataParallel(Net())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
opt = phalanx.ZeroRedundancyOptimizer(Net().parameters(), torch.optim.AdamW, lr=1e-3)
ckpt = phalanx.Checkpointer("runs/fixture", model, optimizer)
preemption = phalanx.PreemptionHandler()
batches_done, batch_size, epoch, step = 2, 4, 0, 2
"""
# The process-group calls the README says `import phalanx as dist` keeps or passes through.
DIST_NAMES = ("init_process_group", "destroy_process_group", "get_rank", "get_world_size",
              "barrier", "is_initialized", "all_reduce", "ReduceOp", "new_group")


def _columns(code: str) -> tuple[str, str]:
    """The README's ``# before ... # after`` table -> (before, after) as two programs."""
    lines = code.splitlines()
    cut = lines[0].index("# after")
    return ("\n".join(line[:cut].rstrip() for line in lines[1:]),
            "\n".join(line[cut:].strip() for line in lines[1:]))


def _run_columns(block: Block) -> None:
    before, after = _columns(block.code)
    torch_names: dict = {}
    phalanx_names: dict = {}
    exec(compile(before, block.name + " (before)", "exec"), torch_names)
    exec(compile(after, block.name + " (after)", "exec"), phalanx_names)
    torch_names.pop("__builtins__")
    phalanx_names.pop("__builtins__")
    if set(torch_names) != set(phalanx_names):
        raise AssertionError(f"the columns bind {sorted(torch_names)} and {sorted(phalanx_names)}")
    for name, value in phalanx_names.items():
        home = value.__name__ if isinstance(value, types.ModuleType) else value.__module__
        if value is torch_names[name] or not home.startswith("phalanx"):
            raise AssertionError(f"{name} after the move is {value!r}, not phalanx's")
    missing = [n for n in DIST_NAMES if not hasattr(phalanx_names["dist"], n)]
    if missing:
        raise AssertionError(f"import phalanx as dist lacks {missing}")


def _run(block: Block) -> None:
    import phalanx

    if block.code.startswith("# before"):
        _run_columns(block)
        return
    makes_group = "init_process_group(" in block.code
    if makes_group and phalanx.is_initialized():
        phalanx.destroy_process_group()
    if not makes_group and not phalanx.is_initialized():
        phalanx.init_process_group()
    names: dict = {}
    exec(compile(DATA if makes_group else FIXTURES, "fixtures", "exec"), names)
    exec(compile(block.code, block.name, "exec"), names)


def main() -> None:
    examples = [b for page in pages() for b in blocks(page) if b.language == "python"]
    os.chdir(tempfile.mkdtemp(prefix="phalanx-docs-"))
    for block in examples:
        try:
            _run(block)
            print(json.dumps({"name": block.name, "error": None}), flush=True)
        except BaseException:  # noqa: BLE001 - every failure is reported, the run goes on
            print(json.dumps({"name": block.name, "error": traceback.format_exc()}), flush=True)


if __name__ == "__main__":
    main()
