"""Fully sharded data parallel: ``fully_shard``, torch's FSDP2 API (torch 2.13).

The files, from the call down:

``api.py``
    :func:`fully_shard`: checks, the unit's parameters, the class swap.
``module.py``
    :class:`FSDPModule`: ``unshard``, ``reshard``, ``set_requires_gradient_sync``...
``unit.py``
    One unit's hooks: all-gather before its forward and backward, reshard, reduce-scatter
    right after its backward; the end-of-backward callback the units of one root share.
``params.py``
    A unit's parameters: one flat shard buffer (each parameter a DTensor viewing it), one
    unsharded buffer allocated only while unsharded, the swap between the two.
``values.py``
    Values set on the modules in a shard's place (``load_state_dict(assign=True)``, a
    ``setattr``): checked, copied into the flat buffer, the unit's own Parameter put back.
``init.py``
    :func:`initialize`: ``model.apply(fn)`` on a sharded model, one unit gathered at a time.
``clip.py``
    :func:`clip_grad_norm_` over sharded and plain gradients together.
``collectives.py``
    The all-gather and the reduce-scatter (an all-to-all on Gloo), issued through the
    ledger; torch's flat layout.
"""

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from .api import fully_shard
from .clip import clip_grad_norm_
from .init import initialize
from .module import FSDPModule, UnshardHandle, register_fsdp_forward_method

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "UnshardHandle", "clip_grad_norm_", "fully_shard", "initialize", "register_fsdp_forward_method"]
