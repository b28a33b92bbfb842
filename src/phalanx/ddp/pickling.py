"""What of a DistributedDataParallel goes into a pickle (``torch.save``, ``pickle``,
``copy.deepcopy``), and what is rebuilt when it comes out.

Kept: the module and the settings. Dropped, and rebuilt by the wrapper in the loading
process (no collective, so one rank may load alone): the reducer (its hooks hold it weakly,
and weak references do not pickle), the bucket plan, the buffer sync (it holds collectives'
work handles), and what ``shard_gradients`` and ``register_comm_hook`` set up (the optimizer
and the hook's state are not in the pickle: call them again after loading).

The process group, as in torch's DDP: ``None`` or the default group is stored as ``None``,
which means the loading process's default group. Another group (or a ``device_mesh``)
exists only in the process that made it: the state holds it in a :class:`_ProcessLocal`,
which a deep copy shares and a pickler refuses with :class:`~phalanx.errors.UsageError`.
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError
from .options import is_default_group

# Rebuilt after loading (see the module notes; the runtime, phalanx.ddp.runtime, holds all but
# the bucket plan); stored as these values.
_REBUILT = {"_runtime": None, "bucket_plan": []}


class _ProcessLocal:
    """A process group or device mesh in a DistributedDataParallel's state."""

    def __init__(self, obj: Any, what: str) -> None:
        self.obj = obj
        self.what = what

    def __deepcopy__(self, memo: dict) -> _ProcessLocal:
        return self  # the copy averages over the same ranks

    def __reduce__(self) -> Any:
        raise UsageError(
            f"a DistributedDataParallel over a {self.what} cannot be pickled: the {self.what} "
            "exists in this process only. As in torch, pickling needs process_group=None (the "
            "default group, which the loading process provides). Save ddp.module or "
            "ddp.state_dict() instead; copy.deepcopy works"
        )


def picklable_state(state: dict[str, Any], group: Any, mesh: Any) -> dict[str, Any]:
    """A DistributedDataParallel's ``__dict__`` made fit for pickling."""
    state = {**state, **_REBUILT}
    state["process_group"] = None if is_default_group(group) else _ProcessLocal(group, "process group")
    state["device_mesh"] = None if mesh is None else _ProcessLocal(mesh, "device_mesh")
    return state


def unpickled_state(state: dict[str, Any]) -> dict[str, Any]:
    """The ``__dict__`` to give a loaded DistributedDataParallel before it rebuilds."""
    return {k: v.obj if isinstance(v, _ProcessLocal) else v for k, v in {**_REBUILT, **state}.items()}
