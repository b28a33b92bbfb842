"""What ``register_comm_hook`` and ``_register_builtin_comm_hook`` accept, refused in torch's words.

torch's checks, with torch's exception classes and the start of torch's messages (phalanx
says more after them): a hook that is not callable (``TypeError``, "Communication hook must
be callable."), a bucket or return annotation other than ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]`` (``ValueError``), a second registration of either
kind (``RuntimeError``: :class:`~phalanx.errors.UsageError`, "register_comm_hook or
register_builtin_comm_hook can only be called once."). Where phalanx is kinder than torch:
the annotations are checked as evaluated (a module with ``from __future__ import
annotations`` writes them as strings, which torch refuses), the bucket parameter need not be
named ``bucket`` (torch raises ``KeyError`` otherwise), phalanx's
:class:`~phalanx.hooks.GradBucket` and a bare ``torch.futures.Future`` are accepted too.

phalanx's own refusals: a hook that cannot be called as ``hook(state, bucket)``
(``TypeError``), a registration after a forward or with ZeRO stage 2 (``UsageError``).

torch's built-in C++ hooks are registered as their Python twins in torch's
``default_hooks``, which compute the same thing: ``ALLREDUCE`` divides each bucket by the
group's size and all-reduces it, ``FP16_COMPRESS`` does so in fp16.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import UsageError
from ..hooks import GradBucket
from .hook_comm import hook_name

# torch's words, word for word (its C++ reducer's), so that scripts matching them match ours.
ONCE = "register_comm_hook or register_builtin_comm_hook can only be called once."
ONCE_BUILTIN = "register_builtin_comm_hook or register_comm_hook can only be called once."
NOT_CALLABLE = "Communication hook must be callable."
BUCKET_ANNOTATION = "Communication hook: bucket annotation should be dist.GradBucket."
RETURN_ANNOTATION = "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]."
BUILTIN_ARGUMENT = "_register_builtin_comm_hook(): incompatible function arguments."

SHARDED_WITH_HOOK = (
    "ZeRO stage 2 reduces each bucket to its owner, a communication hook averages it on every "
    "rank; phalanx does not combine them. Use one or the other"
)

_BUCKET_TYPES = (inspect.Parameter.empty, dist.GradBucket, GradBucket)
_RETURN_TYPES = (inspect.Signature.empty, torch.futures.Future[torch.Tensor], torch.futures.Future)


def check_registration(hook: Any, registered: tuple[Any, Any] | None, forwarded: bool, sharded: bool,
                       builtin: bool = False) -> None:
    """Raise unless ``hook`` may be registered now (see ``register_comm_hook``); ``builtin``:
    for ``_register_builtin_comm_hook`` (torch words its second registration the other way)."""
    check_hook(hook)
    if registered is not None:
        raise UsageError(f"{ONCE_BUILTIN if builtin else ONCE} This DistributedDataParallel has "
                         f"{hook_name(registered[1])} already")
    if forwarded:
        raise UsageError("register_comm_hook must be called before the first forward (torch's "
                         "documentation: before the first backward): the reducer's buckets are in use")
    if sharded:
        raise UsageError(f"register_comm_hook after shard_gradients(): {SHARDED_WITH_HOOK}")


def check_hook(hook: Any) -> None:
    """``TypeError`` unless ``hook`` can be called as ``hook(state, bucket)``; ``ValueError``
    for an annotation torch refuses (see the module notes)."""
    if not callable(hook):
        raise TypeError(f"{NOT_CALLABLE} phalanx calls it as hook(state, bucket) -> torch.futures.Future; "
                        f"got {type(hook).__name__}")
    try:
        signature = inspect.signature(hook)
    except ValueError:
        return  # no signature to inspect (a builtin): it will tell when called
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(f"a communication hook is called as hook(state, bucket); {hook_name(hook)} "
                        f"takes {signature}") from None
    _check_annotations(hook)


def _check_annotations(hook: Callable) -> None:
    try:
        signature = inspect.signature(hook, eval_str=True)
    except (NameError, AttributeError, SyntaxError):
        return  # a string annotation that names what this module cannot see: unchecked
    bucket = _bucket_parameter(signature)
    if bucket is not None and bucket.annotation not in _BUCKET_TYPES:
        raise ValueError(f"{BUCKET_ANNOTATION} {hook_name(hook)}'s {bucket.name} is annotated "
                         f"{_shown(bucket.annotation)} (phalanx also takes phalanx.hooks.GradBucket)")
    if signature.return_annotation not in _RETURN_TYPES:
        raise ValueError(f"{RETURN_ANNOTATION} {hook_name(hook)} is annotated to return "
                         f"{_shown(signature.return_annotation)} (phalanx also takes torch.futures.Future)")


def _bucket_parameter(signature: inspect.Signature) -> inspect.Parameter | None:
    """The parameter named ``bucket`` (torch's rule), else the second positional one."""
    if "bucket" in signature.parameters:
        return signature.parameters["bucket"]
    positional = [p for p in signature.parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return positional[1] if len(positional) > 1 else None


def _shown(annotation: Any) -> str:
    return annotation.__qualname__ if isinstance(annotation, type) else repr(annotation)


def builtin_hook(comm_hook_type: Any) -> Callable:
    """The Python twin in torch's ``default_hooks`` of the built-in hook ``comm_hook_type`` (a
    ``torch.distributed.BuiltinCommHookType``), to be called with the DDP's group as state."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # only when asked

    twins = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
             dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
    if not isinstance(comm_hook_type, dist.BuiltinCommHookType) or comm_hook_type not in twins:
        names = ", ".join(f"BuiltinCommHookType.{t.name}" for t in twins)
        raise TypeError(f"{BUILTIN_ARGUMENT} phalanx takes a torch.distributed.BuiltinCommHookType "
                        f"({names}), got {comm_hook_type!r}")
    return twins[comm_hook_type]
