"""Exception types.

User mistakes (a bad argument, a bad environment variable) raise ``ValueError`` or
``TypeError`` -- plain ones, or the subclasses below when callers may want to catch
them specifically. Problems that involve several ranks raise ``RuntimeError``
subclasses, on every rank involved, naming the ranks and the first thing that differs.

Where torch raises another built-in class for the same case, phalanx's error is an instance
of that class too, so that a script written for torch catches it unchanged: a user mistake
that torch reports as ``RuntimeError`` (a DDP module with no parameter that requires a
gradient, ``process_group`` given with ``device_mesh``...) raises :class:`UsageError`, both a
``ValueError`` and a ``RuntimeError``; a process group missing or initialised twice is a
``RuntimeError`` here and a ``ValueError`` in torch, so those errors are both as well.
"""

from __future__ import annotations


class PhalanxError(Exception):
    """Base of every exception phalanx defines."""


class EnvironmentConfigError(PhalanxError, ValueError):
    """An environment variable (RANK, WORLD_SIZE, SLURM_*, ...) is missing or malformed."""


class UsageError(PhalanxError, ValueError, RuntimeError):
    """A user mistake that torch reports as a ``RuntimeError`` (so it is both)."""


class AlreadyInitializedError(PhalanxError, RuntimeError, ValueError):
    """``init_process_group`` was called while a default process group exists (torch:
    ``ValueError``)."""


class NotInitializedError(PhalanxError, RuntimeError, ValueError):
    """A collective was requested before ``init_process_group`` (torch: ``ValueError``)."""


class RendezvousError(PhalanxError, RuntimeError):
    """The processes could not meet: the master could not be reached or could not listen."""


class LaunchConfigError(PhalanxError, ValueError):
    """``phalanx run`` was asked for something impossible: a bad option, a missing script,
    a master port already in use. The command line exits with status 2."""


class RankMismatchError(PhalanxError, RuntimeError):
    """Ranks disagree on something that must be identical (model parameters, a plan...).

    Raised on every rank, so no rank is left waiting in a collective.
    """


class UnusedParametersError(PhalanxError, RuntimeError):
    """Parameters received no gradient while ``find_unused_parameters=False``."""


class CollectiveMismatchError(PhalanxError, RuntimeError):
    """Ranks issued different collectives (op, dtype, shape or group) at the same point.

    Raised on every rank at a sync point, before the mismatched payloads are sent, naming the
    first collective that differs and the line each rank issued it from.
    """


class CollectiveTimeoutError(PhalanxError, RuntimeError):
    """A collective waited past the watchdog limit (the process group's timeout).

    The message is the hang report: the ranks that never arrived (``culprits``) and where every
    rank is. Raised on every rank: a late rank outside any collective is interrupted.

    ``transport`` marks the transport's own error (the shared-memory backend's: it names the
    late or dead ranks, but is not yet the hang report); the diagnostics turn it into the
    report, as they do Gloo's timeouts and closed connections.
    """

    def __init__(self, message: str, culprits: list[int] | None = None, *,
                 transport: bool = False) -> None:
        super().__init__(message)
        self.culprits = list(culprits or [])
        self.transport = transport


class RankExitedError(CollectiveTimeoutError):
    """A rank left the job (exited, crashed, was killed) while others waited in a collective
    with it; ``culprits`` are the ranks that left."""


class EarlyTerminationError(PhalanxError, RuntimeError):
    """A rank ran out of inputs inside ``join(throw_on_early_termination=True)``: raised on
    every rank, naming the ranks that had joined (torch raises a ``RuntimeError`` there)."""


class CheckpointError(PhalanxError, RuntimeError):
    """A checkpoint is missing, damaged, unsafe or does not fit the objects it is loaded into."""


# Exit status of a worker that stopped because it was preempted (SIGTERM/SIGUSR1) after
# writing its checkpoint: the run is resumable, not failed. 75 is EX_TEMPFAIL from
# sysexits.h, "temporary failure; the user is invited to retry".
PREEMPTED_EXIT_CODE = 75


def ranks_text(ranks: object) -> str:
    """``"rank 1"`` or ``"ranks 1, 2"``: ranks named in a message, worded by their count."""
    ranks = list(ranks)  # type: ignore[call-overload]
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"
