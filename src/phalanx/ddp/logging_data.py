"""torch's DDP logging data, ``DistributedDataParallel._get_ddp_logging_data()``, from phalanx's facts.

torch's DDP fills a dict from its C++ ``c10d::Logger``: settings at construction, runtime
stats at sampled iterations (the first 10, then every ``sample_rate``-th, 100 by default),
the last error it raised. phalanx gives the keys for which it has the same fact, under
torch's names and in torch's types (``int`` or ``str``), and leaves the others out
(docs/ddp.md lists both). Nothing is measured during training: the only per-step cost is the
count of synchronising forwards (:attr:`DDPLog.sync_forwards`); the
rest is read from the settings, the module and the reducer when the dict is asked for.

Keys and their meaning, as torch's:

* at construction: ``module_name``, ``device_ids`` (``""`` on CPU), ``output_device``
  (``-1`` on CPU), ``world_size`` and ``rank`` (in the DDP's group), ``backend_name``,
  ``broadcast_buffers``, ``bucket_cap_bytes`` (the cap as torch computes it from
  ``bucket_cap_mb``/``bucket_cap_mb_list``), ``find_unused_parameters``,
  ``gradient_as_bucket_view``, ``has_sync_bn``, ``is_multi_device_module``,
  ``num_parameter_tensors``, ``total_parameter_size_bytes`` and ``dtypes`` (of the distinct
  trainable parameters);
* ``static_graph`` (``1``, only when set), ``comm_hook`` (after a registration: the hook's
  ``__qualname__``, a built-in's ``str(BuiltinCommHookType...)``), ``has_error``/``error``
  (the last error the DDP raised after construction);
* ``iteration``: the last sampled iteration (``0`` until the second synchronising forward);
* ``bucket_sizes``: bytes of each of phalanx's buckets, in launch order. phalanx plans them
  once, as torch *rebuilds* them after its first iteration (torch's first-iteration
  buckets, what its ``bucket_sizes`` holds, are one per dtype unless
  ``find_unused_parameters``): this is torch's ``rebuilt_bucket_sizes`` where torch
  rebuilds in reverse registration order. Absent with one process (no buckets);
* from the first sampled iteration on: ``unused_parameter_size`` (bytes of the parameters
  the reducer treats as unused: with ``static_graph`` those learned in the first backward,
  with ``find_unused_parameters`` those the latest synchronising forward's graph did not
  reach, torch's at its last sampled forward) and, without a comm hook,
  ``num_buckets_reduced`` (every bucket, each synchronising backward).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..sync_batchnorm import SyncBatchNorm
from .bucketing import DEFAULT_BUCKET_CAP_MB, MIB, BucketSpec

# torch's kDDPRuntimeLoggingSampleRate (c10d reducer.hpp): runtime stats every 100th iteration...
SAMPLE_RATE = 100
# ...after the first 10, which are all sampled (c10d Reducer::should_collect_runtime_stats).
ALWAYS_SAMPLED = 10

# torch's words, word for word (its C++ reducer's and nn/parallel/distributed.py's).
SAMPLE_RATE_TOO_LOW = "DDP runtime logging sample rate should be equal or greater than 1"
STATIC_GRAPH_TOO_LATE = ("set_static_graph() should be called before training loop starts and after "
                         "DistributedDataParallel is constructed.")
STATIC_GRAPH_AGAIN = "You've set static_graph to be True, no need to set it again."
STATIC_GRAPH_FINDS_UNUSED = (
    "You passed find_unused_parameters=true to DistributedDataParallel, `_set_static_graph` will detect "
    "unused parameters automatically, so you do not need to set find_unused_parameters=true, just be sure "
    "these unused parameters will not change during training loop while calling `_set_static_graph`."
)

# caffe2::TypeMeta names, which torch's logger joins into "dtypes" (sorted, as a std::set);
# a parameter of another dtype leaves the key out.
_DTYPE_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
    torch.complex64: "c10::complex<float>",
    torch.complex128: "c10::complex<double>",
}


def last_sampled(first: int, last: int, rate: int) -> int:
    """The latest iteration in ``[first, last]`` at which torch records runtime stats with
    ``rate``: each of iterations 1 to 10, then multiples of ``rate``; ``0`` if none."""
    first = max(first, 1)
    if last < first:
        return 0
    if last <= ALWAYS_SAMPLED:
        return last
    multiple = last - last % rate
    if multiple >= first and multiple > ALWAYS_SAMPLED:
        return multiple
    return ALWAYS_SAMPLED if ALWAYS_SAMPLED >= first else 0


@dataclass
class DDPLog:
    """What a DDP's logging data needs beyond its settings and reducer (one per
    :class:`~phalanx.ddp.runtime.Runtime`, so reset by unpickling, as torch's logger is)."""

    sync_forwards: int = 0  # synchronising forwards so far (Runtime.before_forward counts them)
    rate: int = SAMPLE_RATE
    rate_since: int = 0  # the first iteration ``rate`` applies to
    sampled_before: int = 0  # the last iteration sampled under the earlier rates
    comm_hook: str | None = None
    error: str | None = None
    error_at: int = 0  # sync_forwards when the error was recorded

    def iteration(self) -> int:
        """torch's ``iteration``: the last sampled one (iteration ``k`` is the ``k``-th
        synchronising forward's, counted from 0, sampled at its start), or the count of
        synchronising forwards when the last error was recorded, whichever came later."""
        return max(self.sampled(), self.error_at)

    def sampled(self) -> int:
        """The last iteration sampled so far (0: none), when torch records its runtime stats."""
        return max(self.sampled_before, last_sampled(self.rate_since, self.sync_forwards - 1, self.rate))

    def set_rate(self, rate: int) -> None:
        """``_set_ddp_runtime_logging_sample_rate``: from the next forward on."""
        if not isinstance(rate, int) or isinstance(rate, bool):
            raise TypeError(f"the sample rate must be an int, got {type(rate).__name__}")
        if rate < 1:
            raise ValueError(f"{SAMPLE_RATE_TOO_LOW}, got {rate}")
        self.sampled_before = self.sampled()
        self.rate, self.rate_since = rate, self.sync_forwards

    def record(self, error: BaseException) -> None:
        """The last error (torch's logger also sets ``iteration`` to its count then)."""
        self.error, self.error_at = f"{type(error).__name__}: {error}", self.sync_forwards

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Record what the block raises as the last error (torch's ``_log_and_throw``)."""
        try:
            yield
        except Exception as e:
            self.record(e)
            raise


def construction_data(module: nn.Module, group: dist.ProcessGroup | None, device: torch.device | None,
                       bucket_caps_mb: tuple[float | None, Sequence[float] | None],
                       settings: dict[str, bool]) -> dict[str, int | str]:
    """The keys torch sets at construction: ``settings`` holds ``broadcast_buffers``,
    ``find_unused_parameters`` and ``gradient_as_bucket_view``; ``bucket_caps_mb`` is
    ``(bucket_cap_mb, bucket_cap_mb_list)``."""
    group = dist.group.WORLD if group is None else group
    params = _distinct_trainable(module)
    data: dict[str, int | str] = {
        "module_name": type(module).__name__,
        "device_ids": "" if device is None else str(device.index),
        "output_device": -1 if device is None else device.index,
        "world_size": dist.get_world_size(group),
        "rank": dist.get_rank(group),
        "backend_name": group.name(),
        "bucket_cap_bytes": _bucket_cap_bytes(*bucket_caps_mb),
        "iteration": 0,
        "has_sync_bn": int(any(isinstance(m, (nn.SyncBatchNorm, SyncBatchNorm)) for m in module.modules())),
        "is_multi_device_module": int(len({p.device for p in params}) > 1),
        "num_parameter_tensors": len(params),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
    }
    data.update({name: int(value) for name, value in settings.items()})
    if all(p.dtype in _DTYPE_NAMES for p in params):
        data["dtypes"] = ", ".join(sorted({_DTYPE_NAMES[p.dtype] for p in params}))
    return data


def runtime_data(log: DDPLog, plan: Sequence[BucketSpec], unused: Sequence[torch.Tensor] | None,
                 static_graph: bool) -> dict[str, int | str]:
    """The keys that change after construction; ``unused``: the parameters the reducer treats
    as unused now (``None`` without a reducer)."""
    data: dict[str, int | str] = {"iteration": log.iteration()}
    if static_graph:
        data["static_graph"] = 1
    if plan:
        data["bucket_sizes"] = ", ".join(str(spec.nbytes) for spec in plan)
    if log.sampled() and unused is not None:  # torch's runtime stats, set at sampled iterations
        data["unused_parameter_size"] = sum(p.numel() * p.element_size() for p in unused)
        if log.comm_hook is None:
            data["num_buckets_reduced"] = len(plan)
    if log.comm_hook is not None:
        data["comm_hook"] = log.comm_hook
    if log.error is not None:
        data.update(has_error=1, error=log.error)
    return data


def _bucket_cap_bytes(bucket_cap_mb: float | None, bucket_cap_mb_list: Sequence[float] | None) -> int:
    """torch's ``bucket_bytes_cap``: the largest of ``bucket_cap_mb_list``, else ``bucket_cap_mb``."""
    if bucket_cap_mb_list:
        return int(max(bucket_cap_mb_list) * MIB)
    return int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MIB)


def _distinct_trainable(module: nn.Module) -> list[torch.Tensor]:
    """The parameters torch's reducer holds: those that require a gradient, each tensor once."""
    return [p for p in module.parameters() if p.requires_grad]  # parameters() skips repeats
