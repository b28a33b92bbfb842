"""``torch.compile`` and ``fully_shard``: the units' hooks run eagerly, as torch's FSDP2's.

A unit's hooks do Python bookkeeping (stages, prefetch lists, the ledger's records, which
reads ``sys._getframe`` and ``time.monotonic``) and start collectives whose handles they keep:
nothing Dynamo can put in a graph. Traced, each such call is a graph break in the middle of
the hook, and the compiled block is cut into pieces around it. Marked as torch's FSDP2 marks
its own hooks (``_dynamo_disable`` in ``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``),
Dynamo skips each hook whole: a ``torch.compile``-d block is one graph between its pre- and
post-forward hooks; in a compiled root each unit's hook is one break, as with torch's.

So ``torch.compile(model, fullgraph=True)`` of a sharded model cannot work (with torch's
``fully_shard`` neither): Dynamo's error names :data:`REASON`, which says what to do instead.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

# shown in Dynamo's error when fullgraph=True meets a unit's hook
REASON = ("phalanx.fully_shard's hooks run eagerly (collectives and Python bookkeeping), so a "
          "graph cannot hold them: torch.compile each block (fullgraph=True works there), or "
          "the whole model without fullgraph=True")


def eager_hook(fn: F) -> F:
    """``fn`` skipped by Dynamo, with everything it calls (torch's ``_dynamo_disable``)."""
    return torch._dynamo.disable(fn, recursive=True, reason=REASON)  # type: ignore[return-value]


def refuse_compiled_autograd() -> None:
    """Raise if the backward runs under compiled autograd (``torch._dynamo.compiled_autograd``):
    it does not run the end-of-backward callback, so the reduce-scatters would never land in
    ``.grad`` and the optimizer would step on nothing. torch 2.13's ``fully_shard`` does not
    support it either (its parameters stay unsharded after such a backward)."""
    state = torch._dynamo.compiled_autograd  # (hooks run inside its graph: the region flag)
    if state.compiled_autograd_enabled or state.in_compiled_autograd_region:
        raise RuntimeError(
            "phalanx.fully_shard does not support compiled autograd: its units reduce the "
            "gradients in hooks and an end-of-backward callback that compiled autograd does "
            "not run, so .grad would never arrive. Run loss.backward() without compiled "
            "autograd; torch.compile the blocks (their backward is compiled with them)")
