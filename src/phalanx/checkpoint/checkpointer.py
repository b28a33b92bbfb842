"""Checkpoints of the whole training state: written once, atomically, and resumed exactly.

A :class:`Checkpointer` holds the objects of a training run (model, optimizer, lr scheduler,
GradScaler, sampler) and a directory. :meth:`Checkpointer.save` and :meth:`Checkpointer.load`
are collectives: every rank calls them.

**Saving.** A sharded optimizer is consolidated on rank 0; every rank's RNG states are
gathered there; rank 0 alone writes one file, atomically and checksummed (see
:mod:`phalanx.checkpoint.file`), keeps the newest ``keep`` and removes temporaries left by
dead writers; the other ranks wait for rank 0's outcome, so an error on rank 0 (disk full,
an extra that cannot be saved) is raised on every rank instead of leaving them in a barrier.

**Sharded models** (``fully_shard``, phalanx's or torch's: DTensor parameters and optimizer
state) are saved into the same one file, whole: the writer receives each sharded tensor from
every rank and writes it before receiving the next, so no rank holds more than its shards
and one tensor (see :mod:`phalanx.checkpoint.sharded`). Every rank loads its own rows at the
world size it runs at; a model that is not sharded loads the whole tensors.

**What a checkpoint holds**: ``epoch`` and ``step``; the model's ``state_dict`` unwrapped
(no ``module.`` prefix, whether the model is phalanx's or torch's DDP or a plain module); the
optimizer's (consolidated when sharded), the scheduler's, the GradScaler's and the sampler's
state dicts when given; the world size; each rank's RNG states (Python ``random``, torch CPU,
the current CUDA device's when CUDA is initialised, numpy's global one when numpy is
importable); rank 0's ``extra`` dict; and, with ``comm_state``, every rank's state of the
communication scheme (PowerSGD's error feedback, local SGD's parameters between meetings).

**Loading.** Rank 0 chooses the file (``resume="auto"``: the newest complete checkpoint of
the directory; a damaged one is skipped with a warning and the next newest tried) and every
rank reads it itself, so the directory must be visible to all ranks (a shared file system on
several machines). Reading is safe: the bytes are checked against their CRC-32 and then
decoded by ``torch.load(weights_only=True)`` from those same bytes, which builds tensors and
plain containers only and cannot run code. Tensors land on the rank's own device
(``cuda:LOCAL_RANK`` or the CPU), never all on ``cuda:0``. Each rank restores its own RNG
states. If any rank fails (damaged file, shapes that do not fit), every rank raises
:class:`~phalanx.errors.CheckpointError` naming the file, what failed and on which ranks.

**Another world size.** Model, optimizer (phalanx's ZeRO state is keyed by parameter, not
rank), scheduler and sampler (a global position) resume unchanged. RNG states: ranks that
existed when saving restore their own; new ranks keep the RNG state their script seeded;
the states of ranks that no longer exist are dropped. Data order stays exact; anything
random per rank (dropout) is then reproducible only at the same world size.

**Exactness.** A ``DataLoader`` draws a seed from torch's global RNG whenever an iterator
starts, which a run resumed mid-epoch does at a different moment. Give it its own
``generator=torch.Generator()`` and the global RNG stream is the uninterrupted run's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from .. import comm, process_group
from .._logging import get_logger
from ..agreement import agree
from ..diagnostics import ledger
from ..errors import CheckpointError
from ..uneven import Joinable
from .dcp_checkpoint import ShardedIO, auto_format
from .dcp_zero import is_zero
from .dcp_layout import DamagedCheckpoint, check_save_step, list_all, prune_all
from .file import checkpoint_name, clean_stale_temps, read_checkpoint, write_checkpoint
from .sharded import ShardedState, mesh_of, optimizer_state, restore, rows_for
from .state import (
    capture_rng_state,
    check_fits,
    check_loadable,
    load_comm_state,
    restore_rng_state,
    unwrap,
)
from .sync import (
    SAVE_ERRORS,
    as_shared,
    attempt,
    broadcast_from_writer,
    gather_to_writer,
    is_writer,
    writer_global_rank,
)

_log = get_logger(__package__)
_log0 = get_logger(__package__, rank_zero_only=True)

# A checkpoint resume="auto" had to skip is renamed with this suffix (it stays for inspection).
DAMAGED_SUFFIX = ".damaged"
# Layout of the saved dict; the file format around it has its own version.
STATE_VERSION = 1
_OPTIONAL = ("optimizer", "scheduler", "scaler", "sampler")
FORMATS = ("consolidated", "sharded", "auto")


class CheckpointAction(IntEnum):
    """What a Checkpointer shadows on a rank that has joined (phalanx.join)."""

    SAVE = 1  # arguments: epoch, step


@dataclass(frozen=True)
class TrainingState:
    """Where a loaded checkpoint left training.

    Args:
        epoch: the epoch passed to :meth:`Checkpointer.save`.
        step: the step passed to :meth:`Checkpointer.save`.
        path: the file it was loaded from.
        world_size: the world size it was saved at.
        extra: the ``extra`` dict given to :meth:`Checkpointer.save` (rank 0's).
    """

    epoch: int
    step: int
    path: Path
    world_size: int
    extra: dict = field(default_factory=dict)


class Checkpointer(Joinable):
    r"""Saves and restores a training run's whole state, consistently across ranks.

    :meth:`save` writes one checkpoint file per call (rank 0 writes, all ranks call);
    :meth:`load` restores every object given here plus each rank's RNG state. See the module
    notes for the contents, the safety of loading and what a change of world size does.

    .. note::
        Files are named ``ckpt-<step, 12 digits>.ckpt``; "newest" means the highest step. A
        file exists under that name only once it is complete and durable (written to a
        temporary, fsynced, renamed, directory fsynced): a process killed while saving
        leaves the previous checkpoints untouched. Saving the same step again replaces it.

    Args:
        directory (str or PathLike): where checkpoints live; created on the first save.
        model (nn.Module): the model, plain, wrapped in phalanx's or torch's DDP, or sharded
            by ``fully_shard`` (phalanx's or torch's).
        optimizer (Optimizer, optional): plain (its state DTensors with a sharded model), or
            sharded (``consolidate_state_dict``, as phalanx's and torch's
            ``ZeroRedundancyOptimizer``). Default ``None``.
        scheduler (optional): an lr scheduler. Default ``None``.
        scaler (optional): a ``torch.amp.GradScaler``. Default ``None``.
        sampler (optional): a sampler with ``state_dict``/``load_state_dict``, such as
            :class:`phalanx.DistributedSampler`, or a :class:`phalanx.StreamingDataset`
            (both keep a global position, resumable at any world size). Default ``None``.
        comm_state (optional): state kept per rank by the communication scheme: a
            :class:`phalanx.comm_hooks.PowerSGDState` (error feedback), a
            :class:`phalanx.LocalSGD` or :class:`phalanx.DiLoCo`; anything with
            ``state_dict``/``load_state_dict``. Every rank's is saved, and each rank
            loads its own, so only at the same world size. Default ``None``.
        keep (int or None, optional): how many checkpoints to keep; ``None`` keeps all.
            Default ``3``.
        group (ProcessGroup, optional): the ranks that save and load together; its rank 0
            writes. Default ``None``: the world (or this process alone when no process group
            is initialised).
        map_location (optional): where loaded tensors go. Default: this rank's device
            (``phalanx.get_device()``).
        format (str, optional): how :meth:`save` writes: ``"consolidated"``, one file
            written by rank 0, or ``"sharded"``, a directory ``ckpt-<step>.dcp`` in torch's
            DCP format that every rank writes its part of, checksummed and committed
            atomically (see :mod:`phalanx.checkpoint.dcp_checkpoint`; phalanx's
            ``ZeroRedundancyOptimizer``: each rank writes the state it owns, not torch's
            ZeRO), or ``"auto"``: sharded for a ``fully_shard`` model (DTensor parameters),
            for phalanx's ``ZeroRedundancyOptimizer`` or for a group of 9 ranks or more (past
            one 8-GPU node), else consolidated; :attr:`format` says which. :meth:`load` reads
            both. Default ``"auto"``. While ranks have joined (:class:`phalanx.join`), a
            save writes the single file whatever the format (a rank that has joined takes
            part in it as in any save).

    .. warning::
        ``save`` and ``load`` are collectives. If loading fails part-way (e.g. the optimizer
        does not fit after the model was loaded), the objects may be partly restored: do not
        train on after a :class:`~phalanx.errors.CheckpointError`.

    Example::

        >>> sampler = phalanx.DistributedSampler(dataset)
        >>> loader = DataLoader(dataset, batch_size=32, sampler=sampler,
        ...                     generator=torch.Generator())
        >>> ckpt = phalanx.Checkpointer("runs/exp1", model, optimizer, sampler=sampler)
        >>> state = ckpt.load()             # resume="auto": newest checkpoint, or None
        >>> epoch, step = (state.epoch, state.step) if state else (0, 0)
        >>> for epoch in range(epoch, n_epochs):
        ...     sampler.set_epoch(epoch)    # keeps the restored mid-epoch position
        ...     for i, batch in enumerate(loader):
        ...         train_step(batch)
        ...         step += 1
        ...         if step % 100 == 0:
        ...             ckpt.save(epoch, step, consumed=(i + 1) * 32)
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        scheduler: Any = None,
        scaler: Any = None,
        sampler: Any = None,
        comm_state: Any = None,
        keep: int | None = 3,
        group: dist.ProcessGroup | None = None,
        map_location: Any = None,
        format: str = "auto",
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"Invalid keep {keep!r}, expected a positive integer or None")
        if format not in FORMATS:
            raise ValueError(f"Invalid format {format!r}, expected one of {', '.join(map(repr, FORMATS))}")
        if format == "auto":
            format = auto_format(model, optimizer, group)
        if format == "sharded" and hasattr(optimizer, "consolidate_state_dict") and not is_zero(optimizer):
            raise TypeError("Checkpointer(format='sharded') saves phalanx's ZeroRedundancyOptimizer, "
                            f"not {type(optimizer).__name__} (its state is not keyed by parameter "
                            "owner): use format='consolidated'")
        self.format = format
        self.directory = Path(directory)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.sampler = sampler
        if comm_state is not None and not all(hasattr(comm_state, m) for m in ("state_dict", "load_state_dict")):
            raise TypeError("comm_state must have state_dict() and load_state_dict() (a PowerSGDState, "
                            f"LocalSGD, DiLoCo...), got {type(comm_state).__name__}")
        self.comm_state = comm_state
        self.keep = keep
        self.group = group
        self.map_location = process_group.get_device() if map_location is None else map_location
        self._last = comm.LastWorks()  # the outcome's broadcast: often a script's last collective
        self._sharded = ShardedIO(self)

    @property
    def module(self) -> torch.nn.Module:
        """The model without its DDP (or ``torch.compile``) wrappers."""
        return unwrap(self.model)

    def checkpoints(self) -> list[Path]:
        """The complete checkpoints in :attr:`directory`, files and sharded directories,
        oldest first (not a collective)."""
        return list_all(self.directory)

    def wait(self) -> Path | None:
        """Wait for the save made with ``blocking=False`` still in flight, if any, and return
        its path once committed (a collective); raise its error, on every rank."""
        return self._sharded.wait()

    def close(self) -> None:
        """Wait for a save in flight (see :meth:`wait`) and stop the background writer."""
        self._sharded.close()

    def save(
        self,
        epoch: int,
        step: int,
        *,
        consumed: int | None = None,
        extra: Mapping[str, Any] | None = None,
        blocking: bool = True,
    ) -> Path:
        """Write a checkpoint of the current state (a collective); return its path.

        Args:
            epoch (int): the current epoch.
            step (int): the global step count; names the file.
            consumed (int, optional): samples of this epoch's iteration the training loop has
                used on each rank, passed to ``sampler.state_dict(consumed=...)`` (needed
                when the ``DataLoader`` prefetches, see :class:`phalanx.DistributedSampler`).
                Default ``None``: the sampler counts what it handed out.
            extra (dict, optional): anything else to keep (rank 0's is saved): tensors,
                numbers, strings, and lists/tuples/dicts of them.
            blocking (bool, optional): ``False`` (``format="sharded"`` only): copy the
                model's buffers to host memory, and return the path the checkpoint will have;
                a background thread copies the parameters and optimizer state (every
                optimizer's ``step()`` waits for that copy; change them otherwise only after
                :meth:`wait`, or the save fails) and writes the checkpoint. The next ``save``,
                ``load``, :meth:`wait` or :meth:`close` waits for it and raises its errors
                (those below included). Default ``True``.

        Raises:
            ValueError, TypeError: a bad argument, or an ``extra`` value safe loading could
                not rebuild (named), on every rank; a sharded tensor placed otherwise than
                ``fully_shard`` places it (``Shard(0)`` on one 1-D mesh of the group's ranks).
            RankMismatchError: ranks passed different ``epoch``/``step``.
            CheckpointError: writing failed (on every rank); with ``blocking=False``, also a
                parameter or optimizer state changed before its copy was made, other than by
                an optimizer's ``step()`` (named).
        """
        _check_count("epoch", epoch)
        _check_count("step", step)
        if extra is not None and not isinstance(extra, Mapping):
            raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
        if not blocking and self.format != "sharded":
            raise ValueError("save(blocking=False) needs Checkpointer(format='sharded'), "
                             f"got format={self.format!r}")
        book = ledger()
        if not blocking and book.join is None:
            # nothing of the group's goes out in a background save's foreground (its exchanges
            # run on a group of their own): its check is started here and waited for by the
            # group's next collective (the next training step's), its latency hidden behind
            # what comes between, as a forward's is
            book.sync_point("Checkpointer.save", self.group, wait=False)
            return self._sharded.save(epoch, step, consumed, extra, blocking)
        with book.collective("Checkpointer.save", group=self.group, check=True,
                             shadow=book.shadow(self, CheckpointAction.SAVE, epoch, step)):
            if self.format == "sharded" and not _ranks_joined(book):
                return self._sharded.save(epoch, step, consumed, extra, blocking)
            return self._save(epoch, step, consumed, extra)

    def _save(self, epoch: int, step: int, consumed: int | None, extra: Mapping | None) -> Path:
        writer = _writer()
        if hasattr(self.optimizer, "consolidate_state_dict"):
            self.optimizer.consolidate_state_dict(to=writer)
        sharded = ShardedState(self.module.state_dict(), optimizer_state(self.optimizer), self.group)
        local = None if self.comm_state is None else self.comm_state.state_dict()
        gathered = gather_to_writer((epoch, step, capture_rng_state(), local), self.group, writer)
        path = self.directory / checkpoint_name(step)
        error = None
        if gathered is not None:
            frames = sharded.receive(writer_global_rank(self.group, writer)) if sharded else None
            try:
                self._write(path, gathered, consumed, dict(extra or {}), sharded, frames)
            except Exception as e:
                error = as_shared(e, f"Saving checkpoint {path} failed on rank {writer}: ", SAVE_ERRORS)
            finally:
                for _ in frames or ():  # the other ranks send every tensor: take them all
                    pass
        elif sharded:
            error = attempt(sharded.send, writer_global_rank(self.group, writer))[1]
        # (sharded: a sender's failure counts too; the writer's broadcast alone otherwise)
        agree(f"Saving checkpoint {path}", self.group, problem=error,
              decided_by=None if sharded else writer, keep=None if sharded else self._last)
        return path

    # phalanx.join: a rank that has joined takes part in the others' saves (the highest active
    # rank writes: its model is current; a joined rank's may be stale).
    def join_shadow(self, action: int, verdict: Any) -> None:
        epoch, step = verdict.announce[3:5]  # CheckpointAction.SAVE, the only one
        self._save(epoch, step, None, None)

    def _write(self, path: Path, gathered: list, consumed: int | None, extra: dict,
               sharded: ShardedState, frames: Iterator[torch.Tensor] | None) -> None:
        epoch, step = check_save_step(gathered, self.directory)
        model, optim, places = sharded.skeleton()
        state = {"version": STATE_VERSION, "epoch": epoch, "step": step,
                 "world_size": len(gathered), "model": model,
                 "rng": [rng for _, _, rng, _ in gathered], "extra": extra}
        if sharded:
            state["sharded"] = places
        if self.comm_state is not None:
            state["comm_state"] = [local for *_, local in gathered]
        for name in _OPTIONAL:
            obj = getattr(self, name)
            if obj is not None:
                if name == "sampler" and consumed is not None:
                    state[name] = obj.state_dict(consumed=consumed)
                elif name == "optimizer" and optim is not None:
                    state[name] = optim
                else:
                    state[name] = obj.state_dict()
        for key, value in state.items():
            check_loadable(value, key)
        for stale in clean_stale_temps(self.directory):
            _log.info("removed %s, left by a writer that died", stale)
        size = write_checkpoint(path, state, frames)
        if self.keep is not None:
            prune_all(self.directory, self.keep)
        _log.info("saved %s (%.1f MB, epoch %d, step %d)", path, size / 1e6, epoch, step)

    def load(self, resume: str | os.PathLike = "auto") -> TrainingState | None:
        """Restore the state from a checkpoint (a collective).

        Args:
            resume (str or PathLike): ``"auto"`` for the newest usable checkpoint of
                :attr:`directory`, or the path of a checkpoint file. Default ``"auto"``.

        Returns:
            A :class:`TrainingState`, or ``None`` when ``"auto"`` found no checkpoint (a log
            line says training starts fresh).

        Raises:
            TypeError: ``resume`` is neither ``"auto"`` nor a path.
            CheckpointError: on every rank, naming the file and what failed: missing, empty,
                truncated, checksum mismatch, refused by safe loading, not fitting the
                model/optimizer/scheduler/scaler/sampler given, or a model every rank held
                whole loaded into a sharded one.
        """
        if not isinstance(resume, (str, os.PathLike)):
            raise TypeError(f"resume must be 'auto' or a path, got {type(resume).__name__}")
        auto = resume == "auto"
        self._sharded.wait()
        mine = None
        if is_writer(self.group):
            mine = [str(p) for p in reversed(self.checkpoints())] if auto else [os.fspath(resume)]
        with ledger().collective("Checkpointer.load", group=self.group, check=True):
            candidates = broadcast_from_writer(mine, self.group)
            if not candidates:
                _log0.info("no checkpoint in %s: starting fresh", self.directory)
                return None
            state, path = self._read_first_usable([Path(c) for c in candidates], auto)
            _, problem = attempt(self._apply, state, path)
            agree(f"Loading {path}", self.group, problem=problem)
        return TrainingState(epoch=state["epoch"], step=state["step"], path=path,
                             world_size=state["world_size"], extra=state["extra"])

    def _read_first_usable(self, candidates: list[Path], auto: bool) -> tuple[dict, Path]:
        skipped = []
        for path in candidates:
            state, problem = attempt(self._read, path)
            loading = False
            try:
                agree(f"Reading {path}", self.group, problem=problem)
                if path.is_dir():  # DCP reads the tensors, each item checked as it is read
                    loading = True
                    _, problem = attempt(self._sharded.apply, state, path)
                    agree(f"Loading {path}", self.group, problem=problem)
                return state, path
            except CheckpointError as e:
                # (while loading, only damage is a reason to try an older checkpoint)
                if not auto or (loading and not isinstance(e, DamagedCheckpoint)):
                    raise
                _log0.warning("skipping checkpoint: %s; kept aside as %s", e,
                              self._set_aside(path).name)
                skipped.append(str(e))
        raise CheckpointError(f"No usable checkpoint in {self.directory}: " + "; ".join(skipped))

    def _set_aside(self, path: Path) -> Path:
        """Rename a damaged checkpoint (rank 0, once every rank is done reading it) so that it
        no longer counts as the newest: later saves of lower steps are kept, not pruned."""
        aside = path.with_name(path.name + DAMAGED_SUFFIX)
        if is_writer(self.group):
            try:
                os.replace(path, aside)
            except OSError as e:
                _log.warning("could not rename %s aside: %s", path, e)
        return aside

    def _read(self, path: Path) -> dict:
        if path.is_dir():
            return self._sharded.read(path)
        mesh = mesh_of(self.module)
        state = read_checkpoint(path, map_location=self.map_location, select=rows_for(mesh))
        required = ("version", "epoch", "step", "world_size", "model", "rng", "extra")
        if not isinstance(state, dict) or any(k not in state for k in required):
            raise CheckpointError(
                f"Checkpoint {path} does not hold a training state: expected the keys "
                f"{', '.join(required)}"
            )
        if state["version"] != STATE_VERSION:
            raise CheckpointError(
                f"Checkpoint {path} holds state version {state['version']}; this phalanx "
                f"reads version {STATE_VERSION}"
            )
        if "sharded" in state:
            restore(state, mesh, path)
        elif mesh is not None:
            raise CheckpointError(
                f"Checkpoint {path} holds a model every rank held whole, and this model is "
                "sharded (fully_shard): load it into the model before sharding it")
        return state

    def _apply(self, state: dict, path: Path) -> None:
        if not path.is_dir():  # (a sharded checkpoint's tensors are loaded already)
            check_fits(self.module, state["model"], path)
            self.module.load_state_dict(state["model"])
        for name in _OPTIONAL:
            obj = getattr(self, name)
            if obj is None or (name == "optimizer" and path.is_dir()):
                continue
            if name not in state and state.get("foreign"):
                _log0.warning("checkpoint %s (torch's) holds no %s state: it keeps its own", path, name)
                continue
            if name not in state:
                raise CheckpointError(
                    f"Checkpoint {path} holds no {name} state, but a {name} was given"
                )
            try:
                obj.load_state_dict(state[name])
            except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
                raise CheckpointError(
                    f"Checkpoint {path}: its {name} state does not fit the {name} given: {e}"
                ) from e
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        if self.comm_state is not None:
            world = dist.get_world_size(self.group) if dist.is_initialized() else 1
            load_comm_state(self.comm_state, state.get("comm_state"), path, rank, world)
        saved = state["rng"]
        if rank < len(saved):
            restore_rng_state(saved[rank])
        else:
            _log.info("checkpoint %s was saved by %d ranks: rank %d keeps its own RNG state",
                      path, len(saved), rank)


def _ranks_joined(book: Any) -> bool:
    """Whether, at the sync point just settled, some rank of a running ``phalanx.join`` had
    joined: it takes part in a save through :meth:`Checkpointer.join_shadow`, which writes
    the single file; the active ranks then write it too."""
    return book.join is not None and len(book.join.active) < book.join.world


def _writer() -> int:
    """Who writes: rank 0, or while ranks have joined (phalanx.join) the highest still active."""
    join = ledger().join
    return 0 if join is None else join.authoritative()


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"Invalid {name} {value!r}, expected a non-negative integer")
