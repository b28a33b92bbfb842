"""phalanx.fully_shard against torch's surface: the same arguments, and every public method
of torch's FSDPModule either offered or refused by name; a name torch adds fails here. And
what needs no process group: fully_shard without one is refused."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import phalanx
from phalanx.errors import NotInitializedError
from phalanx.fsdp import FSDPModule, fully_shard
from phalanx.fsdp.module import NOT_YET
from phalanx.uneven import Joinable
from tests.oracle import on_this_torch

# torch 2.13's fully_shard argument and FSDPModule methods that torch 2.11's lack
NEWER_THAN_2_11 = {"dp_mesh_dims", "reset_iter_state", "set_reduce_scatter_max_input_buffers",
                   "set_reduce_scatter_unused_params", "set_separate_reduce_scatter_group",
                   "set_symm_mem_for_comm"}


def _public(cls) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")}


def test_same_arguments_as_torchs_fully_shard():
    ours = inspect.signature(fully_shard).parameters
    theirs = inspect.signature(inspect.unwrap(torch_fully_shard)).parameters
    assert list(theirs) == on_this_torch(ours, NEWER_THAN_2_11)
    ours = {n: ours[n] for n in theirs}
    assert [p.kind for p in ours.values()] == [p.kind for p in theirs.values()]
    assert [p.default for n, p in ours.items() if n != "module"] == [
        p.default for n, p in theirs.items() if n != "module"]


def test_every_method_of_torchs_fsdp_module_is_offered_or_refused():
    # beyond torch's: phalanx.join's protocol (a fully_shard root takes part in a join)
    assert _public(Joinable) - {"join_steps_with_gradients"} <= _public(FSDPModule)
    # (and nn.Module's named_parameters: the units' own Parameters put back first, values.py)
    offered = _public(FSDPModule) - set(NOT_YET) - _public(Joinable) - _public(nn.Module)
    torchs = set(on_this_torch(offered | set(NOT_YET), NEWER_THAN_2_11))
    assert _public(TorchFSDPModule) == torchs, _public(TorchFSDPModule) ^ torchs
    assert "unshard" in offered and "set_requires_gradient_sync" in offered


def test_a_subclass_of_torchs_fsdp_module_overriding_every_method():
    """isinstance(unit, torch.distributed.fsdp.FSDPModule) holds (torch's FSDP2 example
    asserts it), and no method of torch's class is reached: each one, the private ones
    included (they need torch's state), is phalanx's."""
    assert issubclass(FSDPModule, TorchFSDPModule)
    methods = {n for n, v in vars(TorchFSDPModule).items() if callable(v)}
    assert {"__new__", "_apply", "_get_fsdp_state", "_set_unshard_async_op", "unshard"} <= methods
    assert methods - set(vars(FSDPModule)) == set(), methods - set(vars(FSDPModule))
    assert FSDPModule._orig_cls_mro_index == FSDPModule._ORIG_CLASS_INDEX == 3


def test_reachable_as_phalanx_names():
    assert phalanx.fully_shard is fully_shard and phalanx.FSDPModule is FSDPModule


def test_without_a_process_group_it_is_refused():
    with pytest.raises(NotInitializedError, match="fully_shard needs a process group: call "
                       r"phalanx.init_process_group\(\) first"):
        fully_shard(nn.Linear(2, 2))
    assert not isinstance(torch.nn.Linear(2, 2), FSDPModule)
