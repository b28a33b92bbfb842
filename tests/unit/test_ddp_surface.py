"""phalanx's DistributedDataParallel against torch 2.13's public surface, in one process: the
constructor's signature, the audit in docs/torch_surface_ddp.md, the exception classes of
the cases that need no process group."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx
from phalanx.ddp.options import TORCH_ONLY_ATTRIBUTES
from tests.oracle import TORCH_2_13, on_this_torch

AUDIT = Path(__file__).resolve().parents[2] / "docs" / "torch_surface_ddp.md"
# torch 2.13's arguments that torch 2.11's DDP lacks (its last two)
NEWER_THAN_2_11 = {"batched_grad_copy", "forward_sync_buffers"}


def test_constructor_takes_torchs_arguments_in_torchs_order():
    ours = inspect.signature(phalanx.DistributedDataParallel.__init__).parameters
    theirs = inspect.signature(TorchDDP.__init__).parameters
    assert list(theirs) == on_this_torch(ours, NEWER_THAN_2_11)
    # one default differs, on purpose: bucket views are phalanx's default (faster, less memory)
    assert ours["gradient_as_bucket_view"].default is True
    assert theirs["gradient_as_bucket_view"].default is False
    differ = {n for n in theirs if ours[n].default != theirs[n].default}
    if not TORCH_2_13:  # 2.13 made broadcast_buffers' default None (True where forward_sync_buffers is not given)
        assert ours["broadcast_buffers"].default is None and theirs["broadcast_buffers"].default is True
        differ.remove("broadcast_buffers")
    assert differ == {"gradient_as_bucket_view"}


def _torch_public_surface() -> set[str]:
    """Constructor arguments, public methods and the attributes torch's DDP sets on itself."""
    names = set(inspect.signature(TorchDDP.__init__).parameters) - {"self"}
    names |= {m for m in dir(TorchDDP) if not m.startswith("_") and m not in dir(nn.Module)}
    names |= set(re.findall(r"self\.([a-z]\w*)\s*(?::[^=\n]+)?=[^=]", inspect.getsource(TorchDDP)))
    return names | {"_register_builtin_comm_hook", "_set_static_graph", "_get_ddp_logging_data"}


def test_the_audit_names_every_public_item_of_torchs_ddp():
    text = AUDIT.read_text()
    rows = dict(re.findall(r"^\| `([\w.]+)[^`]*` \| (\w+)", text, flags=re.M))
    missing = sorted(_torch_public_surface() - set(rows))
    assert missing == []
    assert set(rows.values()) <= {"supported", "different", "refused", "coming"}
    # every refused attribute has its message in the wrapper, and the audit says so
    refused = {name for name, verdict in rows.items() if verdict == "refused"}
    assert set(TORCH_ONLY_ATTRIBUTES) <= refused
    assert rows["register_comm_hook"] == "different" and rows["_register_builtin_comm_hook"] == "supported"
    assert rows["join"] == "supported" and rows["join_hook"] == "refused"


def test_no_process_group_is_a_value_error_as_in_torch():
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        TorchDDP(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs a process group: call phalanx.init_process_group"):
        phalanx.DistributedDataParallel(nn.Linear(2, 2))
    for cls in (phalanx.NotInitializedError, phalanx.AlreadyInitializedError):
        assert issubclass(cls, ValueError) and issubclass(cls, RuntimeError)
    assert issubclass(phalanx.UsageError, ValueError) and issubclass(phalanx.UsageError, RuntimeError)
