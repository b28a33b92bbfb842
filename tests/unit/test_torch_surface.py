"""docs/torch_surface.md audits every public name of torch's DistributedSampler, SyncBatchNorm
and ZeroRedundancyOptimizer: a name torch adds, and the page does not mention, fails here."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data.distributed import DistributedSampler

DOC = Path(__file__).resolve().parents[2] / "docs" / "torch_surface.md"
# ZeroRedundancyOptimizer's attributes, from torch's documentation and __init__ (an instance
# needs a process group).
_ZERO_ATTRIBUTES = {"optim", "param_groups", "state", "defaults", "process_group", "world_size",
                    "rank", "global_rank", "parameters_as_bucket_view", "initialized"}


def _public(names) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def _surface(cls, base, instance=None) -> set[str]:
    """``cls``'s arguments, its public methods and properties beyond ``base``'s, and the
    public attributes of ``instance``."""
    arguments = _public(inspect.signature(cls.__init__).parameters) - {"self"}
    members = _public(dir(cls)) - _public(dir(base))
    attributes = _public(vars(instance)) - {"training"} if instance is not None else set()
    return arguments | members | attributes


def _section(title: str) -> str:
    text = DOC.read_text()
    return text.split(f"## `{title}`", 1)[1].split("\n## ", 1)[0]


def test_every_public_name_of_torchs_classes_is_audited():
    cases = {
        "torch.utils.data.DistributedSampler": _surface(
            DistributedSampler, torch.utils.data.Sampler, DistributedSampler(range(4), 2, 0))
        | {"__iter__", "__len__"},
        "torch.nn.SyncBatchNorm": _surface(
            torch.nn.SyncBatchNorm, torch.nn.Module, torch.nn.SyncBatchNorm(2))
        | {"forward", "weight", "bias", "running_mean", "running_var", "num_batches_tracked"},
        "torch.distributed.optim.ZeroRedundancyOptimizer": _surface(
            ZeroRedundancyOptimizer, object) | _ZERO_ATTRIBUTES,
    }
    assert len(cases["torch.distributed.optim.ZeroRedundancyOptimizer"]) > 25
    for title, names in cases.items():
        section = _section(title)
        written = set(re.findall(r"`(?:\*\*)?(\w+)", section))
        missing = sorted(n.lstrip("*") for n in names if n not in written)
        assert not missing, f"{title}: not in docs/torch_surface.md: {missing}"


def test_links_the_ddp_audit_and_names_a_test_per_refusal():
    text = DOC.read_text()
    assert "[torch_surface_ddp.md](torch_surface_ddp.md)" in text
    for table in re.findall(r"Refused[^\n]*\n\n(\|.*?)\n\n", text + "\n\n", re.S):
        rows = table.splitlines()[2:]
        assert rows and all(re.search(r"`(tests/\S+::)?test_\w+`", row) for row in rows), table
