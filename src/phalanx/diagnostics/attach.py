"""The ledger of the job's default process group, attached whoever made the group.

:func:`ledger` is how every part of phalanx finds the ledger to record its collectives in.
The first call on a default group of several ranks attaches one to it, with its observer (the
hang and straggler reports of :class:`~phalanx.diagnostics.monitor.Diagnostics`):

* made by ``phalanx.init_process_group``: with the settings it was given (``diagnostics=False``
  attaches a disabled ledger; ``straggler_every``; the watchdog limit is its timeout);
* made by ``torch.distributed.init_process_group`` (any ``init_method``, ``store=``), or by a
  launcher's environment through torch: the same, with the defaults, the group's own timeout as
  the watchdog limit and its store for the reports.

One process alone, or no group at all, gets a disabled ledger. The ledger lives as long as its
group: when the group is destroyed (by phalanx or torch) or replaced, the next call attaches a
new one, and the old one's watchdog stops.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from .. import env as _env
from .._logging import get_logger
from ..errors import UsageError
from ..ledger import Ledger
from . import interrupt
from .monitor import Diagnostics
from .straggler import DEFAULT_EVERY

# The ledger of each live default group. c10d's ProcessGroup takes no attributes of its own,
# so what belongs to a group is kept here, keyed weakly by the group: it goes with the group.
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_log = get_logger("phalanx.diagnostics")

# What a process with no group of several ranks is given: records nothing, only waits.
_OFF = Ledger(0.0, enabled=False)

# The default group ledger() found last (held weakly, as _ATTACHED holds it) and its ledger:
# every DDP step asks; a weak reference's call is cheaper than the weak dictionary's lookup
_last: tuple[Any, Ledger] = (lambda: None, _OFF)

# Where c10d keeps the default group: read as an attribute, where ``dist.group.WORLD`` is two
# property calls (a DDP step asks three times); torch's public way where its layout differs
_C10D_WORLD = distributed_c10d._world if hasattr(getattr(distributed_c10d, "_world", None), "_default_pg") else None


class _Attached:
    """A group's ledger and its observer, closed once (by destroy, the group's end or exit)."""

    def __init__(self, ledger: Ledger, diagnostics: Diagnostics | None) -> None:
        self.ledger, self.diagnostics = ledger, diagnostics
        self.several = False  # the group has several ranks (ledger() hands this ledger out)
        self._closed = False

    def close(self) -> str | None:
        """Stop (once); the collectives still under way, described, if any (else ``None``)."""
        atexit.unregister(self.close_at_exit)
        if self._closed:
            return None
        self._closed = True
        unfinished = self.ledger.close()
        if self.diagnostics is not None:
            self.diagnostics.close(cleanly=not unfinished and no_error_under_way())
        if not unfinished:
            return None
        problem = (f"rank {self.ledger.rank} leaves with collectives still under way: "
                   f"{'; '.join(r.describe() for r in unfinished)}. Their results never land on "
                   "this rank, whose state now differs from the others': finish them on every "
                   "rank first (an overlapped LocalSGD/DiLoCo meeting: finish_meeting() after "
                   "the last step)")
        return problem

    def close_at_exit(self) -> None:
        """The script never destroyed the group: nobody else would say what was left; unless
        an exception ended it: the collectives it cut short are its consequence (Ctrl-C's
        in the middle of a step: nothing to say), as in a failing script's ``finally``."""
        problem = self.close()
        ended_by = getattr(sys, "last_value", None)  # the exception that ended the script
        if problem is None or isinstance(ended_by, KeyboardInterrupt):
            return
        if ended_by is not None:
            _log.warning("%s (the %s that ended the script came first)", problem,
                         type(ended_by).__name__)
        else:
            _log.error("%s", problem)


def no_error_under_way() -> bool:
    """No exception is on its way out of the script: none being handled (a ``finally`` that
    destroys the group) and none that ended it (at exit, the interpreter keeps it as
    ``sys.last_value``)."""
    return sys.exc_info()[1] is None and getattr(sys, "last_value", None) is None


def ledger() -> Ledger:
    """The ledger of this process's default group (attached on first use); a disabled one
    when there is no group of several ranks."""
    global _last
    world = dist.group.WORLD if _C10D_WORLD is None else _C10D_WORLD._default_pg  # None before init
    if world is None:
        return _OFF
    if _last[0]() is world:
        return _last[1]
    found = _ATTACHED.get(world)
    if found is not None and found.several:
        _last = (weakref.ref(world), found.ledger)
        return found.ledger
    if dist.get_world_size() == 1:
        return _OFF
    return (found or attach(world)).ledger


def diagnostics() -> Diagnostics | None:
    """The hang and straggler reports watching the default group's ledger, if it has any."""
    if ledger() is _OFF:
        return None
    return _ATTACHED[dist.group.WORLD].diagnostics


def attach(group: Any, enabled: bool = True, straggler_every: int = DEFAULT_EVERY,
           store: Any = None, timeout_s: float | None = None) -> _Attached:
    """Attach a ledger to ``group`` (the default group, of several ranks). Every rank calls it at
    the same point (with NCCL it makes a Gloo group for the sync points).

    Args:
        enabled: ``False``: a disabled ledger, no reports (``diagnostics=False``).
        straggler_every: synchronising DDP steps per straggler report.
        store: the job's store; default: the group's.
        timeout_s: the watchdog limit; default: the group's timeout.
    """
    detach(group)
    interrupt.install()
    if not enabled:
        found = _Attached(Ledger(0.0, enabled=False), None)
    else:
        timeout_s = _timeout_s(group) if timeout_s is None else timeout_s
        check_group = dist.new_group(backend="gloo") if "nccl" in str(dist.get_backend(group)) else None
        new = Ledger(timeout_s, check_group=check_group)
        store = dist.distributed_c10d._get_default_store() if store is None else store
        found = _Attached(new, Diagnostics(new, store, _env.diagnosis_file(), straggler_every,
                                           leave_word=_env.agent_store()))
        # The watchdog thread must stop before the interpreter finalises: a daemon thread coming
        # back from a store call then is killed inside C++ and the process aborts ("terminate
        # called without an active exception"; seen in 1 of 3 runs ending in a hang report).
        atexit.register(found.close_at_exit)
        weakref.finalize(group, found.close_at_exit)
    found.several = dist.get_world_size(group) > 1
    _ATTACHED[group] = found
    return found


def look_back() -> None:
    """``destroy_process_group``'s straggler look at the steps since the last report (see
    :meth:`Diagnostics.look_back`), before the default group goes."""
    found = _ATTACHED.get(dist.group.WORLD) if dist.is_initialized() else None
    if found is not None and found.diagnostics is not None:
        found.diagnostics.look_back()


def detach(group: Any = None) -> None:
    """Stop the ledger of ``group`` (default: the default group), if one is attached."""
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    found = None if group is None else _ATTACHED.pop(group, None)
    _forget()
    problem = None if found is None else found.close()
    if problem is not None:
        raise UsageError(f"destroy_process_group(): {problem}")


def _forget() -> None:
    """The next ledger() looks the default group's ledger up afresh."""
    global _last
    _last = (lambda: None, _OFF)


def _timeout_s(group: Any) -> float:
    """The group's own timeout: its backend's option (c10d offers no public getter), else
    torch's default for the backend."""
    try:
        device = torch.device("cuda" if "nccl" in str(dist.get_backend(group)) else "cpu")
        return group._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d._get_default_timeout(dist.get_backend(group)).total_seconds()
