"""SyncBatchNorm: batch normalisation over the global batch of all ranks, on CPU (Gloo) and CUDA.

The algorithm, one collective each way:

* **forward** (training): every rank reduces its local batch to a per-channel mean and sum of
  squared deviations, computed around a float32 estimate of the mean and corrected in float64
  (a shifted two-pass, stable on large means), turns them into the sum and the sum of squares
  ``n * mean`` and ``M2 + n * mean**2`` in float64, and one all-reduce of
  ``cat([sum, sum_of_squares, count])`` gives the global mean and variance. Float64 keeps the
  ``E[x**2] - E[x]**2`` step exact to ~1e-16 relative, where float32 would lose every digit once
  the mean is ~1e4 times the standard deviation. The running variance is updated unbiased over
  the global count, as ``BatchNorm`` would on the concatenated batch.
* **backward**: each rank sums ``dy`` and ``dy * (x - mean)`` per channel; one all-reduce of
  ``cat([sum_dy, sum_dy_xmu])`` gives what the input gradient of the global computation needs.
  Weight and bias gradients stay local sums: DDP averages them like any other gradient.

A rank with an empty batch still joins both collectives with zeros (otherwise every other rank
would wait for it forever). In eval mode, or with a single process, it is plain ``BatchNorm``
and communicates nothing, also with ``track_running_stats=False`` (statistics of this rank's
batch then), exactly as torch's ``SyncBatchNorm``, whose ``need_sync`` requires
``self.training``.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from .diagnostics import ledger
from .ledger import syncpoint

# What convert_sync_batchnorm replaces: every BatchNorm, as torch's does (BatchNorm1d/2d/3d,
# their subclasses, and torch's own SyncBatchNorm, so a script already converted with torch's
# switches by changing its import).
_CONVERTIBLE = _BatchNorm
# Whether torch's BatchNorm takes bias= (2.13's does, 2.11's does not: there a BatchNorm always
# has a bias when affine).
_TAKES_BIAS = "bias" in inspect.signature(_BatchNorm.__init__).parameters


def _reduce_dims(x: torch.Tensor) -> list[int]:
    """Every dimension but the channels (dim 1)."""
    return [0, *range(2, x.dim())]


def _channel_view(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against ``x`` (N, C, *)."""
    return t.to(x.dtype).view(1, -1, *([1] * (x.dim() - 2)))


def _accurate(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself in float32/float64; half types upcast to float32 for the reductions."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _local_moments(x: torch.Tensor, local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and sum of squared deviations of ``x``, float64, in four fast passes.

    Summing around a float32 estimate of the mean keeps every term small; the float64
    correction then removes the estimate's rounding (1e-3 at a mean of 1e4), which would
    otherwise enter the variance between ranks linearly. (torch's ``var_mean`` and a float64
    ``sum`` are as accurate but far slower on CPU over dims (0, 2, 3): ~11 ms each against
    ~0.3 ms per pass here, measured on a 32x32x32x32 float32 batch with one thread.)
    """
    dims = _reduce_dims(x)
    shift = x.mean(dims, keepdim=True)
    centred = x - shift
    d = centred.sum(dims).double()
    q = (centred * centred).sum(dims).double()
    return shift.flatten().double() + d / local, q - d * d / local


def _sum_shadow(sums: torch.Tensor) -> tuple[int, ...]:
    """A rank that has joined (phalanx.join) adds zeros: count 0, the others' statistics exact."""
    return syncpoint.tensor_shadow(syncpoint.ALL_REDUCE, sums, syncpoint.REDUCE_OPS.index("SUM"))


def _global_stats(x: torch.Tensor, eps: float, group: dist.ProcessGroup | None):
    """Mean, biased variance, 1/std (float64, per channel) and count of the global batch.

    One all-reduce. Raises on every rank alike when the global batch has one value per channel.
    """
    channels = x.shape[1]
    local = x.numel() // channels if channels else 0
    if local > 0:
        mean, m2 = _local_moments(_accurate(x), local)
        sums = torch.cat([mean * local, m2 + mean * mean * local, mean.new_full((1,), local)])
    else:
        sums = torch.zeros(2 * channels + 1, dtype=torch.float64, device=x.device)
    with ledger().collective("SyncBatchNorm forward", (sums,), group, shadow=_sum_shadow(sums)):
        dist.all_reduce(sums, group=group)
    count = int(sums[-1].item())
    if count == 1:
        raise ValueError(
            "Expected more than 1 value per channel when training, got 1 value per channel "
            f"over all ranks (input size {tuple(x.shape)} on this rank)"
        )
    mean = sums[:channels] / max(count, 1)
    var = (sums[channels:-1] / max(count, 1) - mean * mean).clamp_(min=0)
    return mean, var, (var + eps).rsqrt(), count


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalise with given global statistics; backward gives the global computation's gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, count, group):
        # (x - mean) first, then scale: at large means this keeps float32's error at the
        # rounding of the mean alone (x * scale + shift would add the rounding of both terms)
        acc = _accurate(x)
        xmu = acc - _channel_view(mean, acc)
        scale = _channel_view(invstd if weight is None else invstd * weight.double(), acc)
        y = xmu * scale
        if bias is not None:
            y.add_(_channel_view(bias, acc))  # in place: out-of-place addcmul is ~5x slower on CPU
        ctx.save_for_backward(xmu, weight, invstd)
        ctx.count, ctx.group, ctx.x_dtype = count, group, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        xmu, weight, invstd = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        if xmu.numel() > 0:
            dy = dy.to(xmu.dtype)
            sum_dy = dy.sum(_reduce_dims(xmu))
            sum_dy_xmu = (dy * xmu).sum(_reduce_dims(xmu))
        else:  # an empty batch still joins the all-reduce, with zeros
            sum_dy = sum_dy_xmu = torch.zeros(xmu.shape[1], dtype=torch.float64, device=xmu.device)
        # zeros rather than None on an empty rank, so DDP's gradient hooks fire on every rank
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if need_weight else None
        grad_bias = sum_dy.to(ctx.bias_dtype) if need_bias else None
        grad_x = None
        if need_x:
            sums = torch.cat([sum_dy, sum_dy_xmu]).double()
            with ledger().collective("SyncBatchNorm backward", (sums,), ctx.group, shadow=_sum_shadow(sums)):
                dist.all_reduce(sums, group=ctx.group)
            grad_x = _input_grad(dy, xmu, weight, invstd, sums / max(ctx.count, 1))
            grad_x = grad_x.to(ctx.x_dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None


def _input_grad(dy, xmu, weight, invstd, means):
    """dx = w * invstd * (dy - mean(dy) - (x - mean) * invstd**2 * mean(dy * (x - mean))).

    ``means`` is ``cat([mean(dy), mean(dy * (x - mean))])`` over the global batch.
    """
    if xmu.numel() == 0:
        return torch.zeros_like(xmu)
    channels = xmu.shape[1]
    mean_dy, mean_dy_xmu = means[:channels], means[channels:]
    gain = invstd if weight is None else invstd * weight.double()
    dx = (dy - _channel_view(mean_dy, xmu)).mul_(_channel_view(gain, xmu))
    return dx.addcmul_(xmu, _channel_view(-mean_dy_xmu * invstd * invstd * gain, xmu))


class SyncBatchNorm(_BatchNorm):
    r"""Batch normalisation whose statistics span the global batch of every rank in a group.

    In training mode each forward normalises with the mean and variance of all ranks' batches
    together, and backward gives exactly the gradients of that global computation, so training
    on ``R`` ranks with batches of ``B`` matches ``BatchNorm`` on one batch of ``R * B``. It
    subclasses torch's ``_BatchNorm`` (as ``torch.nn.SyncBatchNorm`` does) so parameters,
    buffers, ``state_dict`` keys and ``isinstance`` checks are those of any BatchNorm.

    .. note::
        One all-reduce per forward (``cat([sum, sum_of_squares, count])`` in float64) and one
        per backward (``cat([sum_dy, sum_dy_xmu])``, skipped when no input gradient is needed,
        the same way on every rank). Works on CPU with Gloo, where ``torch.nn.SyncBatchNorm``
        refuses CPU tensors, and on CUDA with NCCL.

    .. note::
        Ranks may have different batch sizes, and a rank's batch may be empty: it still joins
        both collectives. The running variance is unbiased over the global count. Weight and
        bias gradients are this rank's share, averaged by DDP like any other parameter's.

    .. note::
        In eval mode (and with a single process, or no process group) it is plain
        ``BatchNorm`` on this rank's batch and communicates nothing. Without running
        statistics (``track_running_stats=False``) eval mode therefore normalises with this
        rank's batch statistics, as torch's ``SyncBatchNorm`` does (it syncs only when
        ``self.training``).

    Args:
        num_features (int): ``C`` of an input of shape ``(N, C, *)``.
        eps (float): added to the variance for stability. Default ``1e-5``.
        momentum (float, optional): running-stat update factor; ``None`` for a cumulative
            average, as in ``BatchNorm``. Default ``0.1``.
        affine (bool): learnable weight and bias. Default ``True``.
        track_running_stats (bool): keep running mean and variance. Default ``True``.
        process_group (ProcessGroup, optional): ranks whose batches are pooled. Default
            ``None``: the whole world.
        device, dtype: where and in what type to create parameters and buffers.
        bias (bool, keyword-only): learnable bias when ``affine``. Default ``True``.

    .. warning::
        Every rank of ``process_group`` must run the forward (and backward) of every
        SyncBatchNorm in training mode, in the same order, or the ranks wait for one another
        until the group's timeout. Keep data loaders in step (``drop_last`` or
        ``DistributedSampler``'s padding), not ``pad=False``, when training. Its backward
        all-reduce shares ``process_group`` with DDP's bucket all-reduces (as in torch), so
        they too must come in the same order on every rank: inside DDP every rank must run
        the same graph (see :class:`~phalanx.DistributedDataParallel`'s warning).

    Example::

        >>> model = phalanx.SyncBatchNorm.convert_sync_batchnorm(model)
        >>> model = phalanx.DistributedDataParallel(model)
        >>> # or directly
        >>> bn = phalanx.SyncBatchNorm(64)
        >>> y = bn(torch.randn(8, 64, 32, 32))   # statistics over 8 * world_size images
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        if not bias and not _TAKES_BIAS:
            raise TypeError(
                f"SyncBatchNorm(bias=False) needs torch's BatchNorm bias argument, which torch "
                f"{torch.__version__} lacks (its BatchNorm has a bias whenever it is affine)")
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats,
            device=device, dtype=dtype, **({"bias": bias} if _TAKES_BIAS else {}),
        )
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, *), got {input.dim()}D input")
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"expected {self.num_features} channels in dimension 1, got input of shape "
                f"{tuple(input.shape)}"
            )

    def _synchronised(self) -> bool:
        return (
            self.training
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self.process_group) > 1
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self._synchronised():
            return super().forward(input)  # BatchNorm on this rank's batch
        self._check_input_dim(input)
        factor = self._running_factor()
        with torch.no_grad():
            mean, var, invstd, count = _global_stats(input, self.eps, self.process_group)
            if self.track_running_stats and count > 1:
                unbiased = var * (count / (count - 1))
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, mean, invstd, count, self.process_group
        )

    def _running_factor(self) -> float:
        """Count this batch and return the running-stat update factor, as ``BatchNorm`` does."""
        if not self.track_running_stats:
            return 0.0
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    @classmethod
    def convert_sync_batchnorm(
        cls, module: nn.Module, process_group: dist.ProcessGroup | None = None
    ) -> nn.Module:
        """Replace every BatchNorm in ``module`` (``BatchNorm1d/2d/3d``, their subclasses,
        torch's ``SyncBatchNorm``: any ``_BatchNorm``, as torch converts).

        The new layers share the old ones' parameter and buffer tensors (so values,
        ``requires_grad``, device, dtype, and an optimizer built beforehand all carry over) and
        keep their training mode and ``qconfig``. Returns the converted module (``module``
        itself, modified in place, unless ``module`` is a BatchNorm).

        Example::

            >>> model = phalanx.SyncBatchNorm.convert_sync_batchnorm(model)
        """
        if isinstance(module, _CONVERTIBLE):
            return _converted(cls, module, process_group)
        for name, child in module.named_children():
            converted = cls.convert_sync_batchnorm(child, process_group)
            if converted is not child:
                setattr(module, name, converted)
        return module


def _converted(cls, bn: _BatchNorm, process_group) -> SyncBatchNorm:
    sync = cls(
        bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
        process_group, device="meta", bias=bn.bias is not None or not bn.affine,
    )
    # share, not copy: same Parameter objects and buffers, so same values, device and dtype
    for name in list(sync._parameters):
        setattr(sync, name, bn._parameters.get(name))
    for name in list(sync._buffers):
        setattr(sync, name, bn._buffers.get(name))
    sync.train(bn.training)
    if hasattr(bn, "qconfig"):  # as torch's convert_sync_batchnorm carries it over
        sync.qconfig = bn.qconfig
    return sync
