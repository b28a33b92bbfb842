"""Sharded and replicated models for the fully-sharded benchmarks, and what a rank holds.

Shared by ``phalanx bench --fully-shard`` (:mod:`phalanx.bench.engine`),
``benchmarks/bench_fsdp.py`` (speed, bytes sent) and ``benchmarks/bench_fsdp_memory.py``
(peak memory, a per-rank memory limit). Runs on a rank, inside a process group.

* :func:`build` makes one variant of a model: sharded by phalanx's or torch's
  ``fully_shard`` (each block a unit, then the root), or replicated by torch's or phalanx's
  DDP. With ``meta=True`` a sharded variant is built on the meta device and initialised
  shard by shard, so no rank ever holds the whole model.
* :func:`held_bytes` is what a rank holds of parameters, gradients and optimizer state (a
  DTensor's local shard); :func:`sent_bytes` what the process has written so far (its
  sockets: its collectives).
* :class:`Memory` reads the process's resident memory (``/proc/self/status``): the peak since
  :meth:`Memory.reset_peak`, and :func:`limit_data` caps what a rank may allocate.
"""

from __future__ import annotations

import resource
from typing import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

SHARDED = ("phalanx fully_shard", "torch fully_shard")
REPLICATED = ("torch DDP", "phalanx DDP")
VARIANTS = SHARDED + REPLICATED


def units(net: nn.Module) -> list[nn.Module]:
    """The modules :func:`shard` makes units of before the root: a GPT's blocks, else each
    child holding parameters (an ``nn.Sequential``'s layers)."""
    blocks = dict(net.named_children()).get("blocks")
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    return [child for child in net.children() if any(True for _ in child.parameters())]


def shard(net: nn.Module, fully_shard: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """``fully_shard`` each of :func:`units`, then the root, as torch's FSDP2 examples do."""
    for unit in units(net):
        fully_shard(unit)
    return fully_shard(net)


def _fully_shard_of(variant: str, group=None) -> Callable[[nn.Module], nn.Module]:
    if variant == "phalanx fully_shard":
        from ..fsdp import fully_shard

        return fully_shard
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if group is None:
        return torch_fully_shard
    mesh = DeviceMesh.from_group(group, "cpu")
    return lambda module: torch_fully_shard(module, mesh=mesh)


# The layers of the benchmark models (phalanx.bench.engine), each with its own initialisation.
_LAYERS = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Conv2d, nn.BatchNorm2d)


def _reset(module: nn.Module) -> None:
    if isinstance(module, _LAYERS):
        module.reset_parameters()


def build(variant: str, make: Callable[[], nn.Module], seed: int = 0, meta: bool = False,
          torch_group=None) -> nn.Module:
    """``make()``'s model as ``variant`` (one of :data:`VARIANTS`), from ``seed``; torch's
    variants on ``torch_group`` when given (:func:`phalanx.bench.ranks.torch_group`), else on
    the default group, as phalanx's always are.

    ``meta=True``: a sharded variant is built on the meta device, sharded, and initialised
    per shard (phalanx: :func:`phalanx.fsdp.initialize`, each rank keeping its rows of the
    values one process would have; torch: ``reset_parameters`` on the DTensors); a replicated
    one is built whole, as it must be.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    torch.manual_seed(seed)
    if variant in REPLICATED:
        from ..ddp import DistributedDataParallel

        if variant == "torch DDP":
            return torch.nn.parallel.DistributedDataParallel(make(), process_group=torch_group)
        return DistributedDataParallel(make())
    sharder = _fully_shard_of(variant, torch_group)
    if not meta:
        return shard(make(), sharder)
    with torch.device("meta"):
        net = make()
    shard(net, sharder)
    net.to_empty(device="cpu")
    torch.manual_seed(seed)  # alike on every rank
    if variant == "phalanx fully_shard":
        from ..fsdp import initialize

        initialize(net, _reset)
    else:
        net.apply(_reset)
    return net


def parameter_bytes(make: Callable[[], nn.Module]) -> int:
    """The bytes of ``make()``'s parameters (built on the meta device: nothing allocated)."""
    with torch.device("meta"):
        net = make()
    return sum(p.numel() * p.element_size() for p in net.parameters())


def _local_bytes(tensors: Iterable[object]) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def held_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """This rank's bytes of parameters, gradients and optimizer state (local shards)."""
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values()]
    return _local_bytes(params) + _local_bytes(p.grad for p in params) + _local_bytes(state)


def sent_bytes() -> int:
    """Bytes this process has written (``/proc/self/io``'s ``wchar``): its sockets, so its
    collectives, plus its few writes to files and pipes."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # /proc reports kB
    raise RuntimeError(f"/proc/self/status has no {key}")


class Memory:
    """This process's resident memory, from ``/proc/self/status`` (Linux).

    ``VmHWM``, the peak resident set, only grows; :meth:`reset_peak` sets it back to the
    current resident set (writing ``5`` to ``/proc/self/clear_refs``, Linux 4.0+), so a
    peak can be measured from a point on: after torch, Gloo and the process group, before
    the model.

    Example::

        >>> memory = Memory()
        >>> memory.reset_peak()
        >>> ...                        # build, train
        >>> memory.peak() - memory.start   # what the model and its training added at most
    """

    def __init__(self) -> None:
        self.start = self.resident()

    @staticmethod
    def resident() -> int:
        return _status("VmRSS")

    @staticmethod
    def peak() -> int:
        return _status("VmHWM")

    def reset_peak(self) -> bool:
        """Reset the peak to the resident set now (and :attr:`start` with it); ``False``
        where the kernel refuses (the peak then counts from the process's start)."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # proc(5): "5" resets the peak resident set size (VmHWM)
        except OSError:
            return False
        self.start = self.resident()
        return True


def limit_data(budget: int) -> int:
    """Let this process allocate at most ``budget`` more bytes of private memory
    (``RLIMIT_DATA`` over its data segment now, ``VmData``); return the limit set.

    Since Linux 4.7 ``RLIMIT_DATA`` covers private writable mappings, which is where torch's
    CPU allocator puts every tensor: past the limit an allocation fails with torch's
    ``RuntimeError: ... DefaultCPUAllocator: can't allocate memory`` (errno 12) in the
    process that made it, nothing else killed. Set it in a process that ends with the
    measurement (a process not privileged cannot raise it again).
    """
    limit = _status("VmData") + budget
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    return limit


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed (torch's CPU allocator, or Python's)."""
    return isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))
