"""The sharded format of :class:`~phalanx.checkpoint.Checkpointer` (``format="sharded"``):
every rank writes its own part through torch's DCP, phalanx adds what DCP lacks.

**Saving** (a collective). Rank 0 gathers every rank's RNG states (and comm state), with its
DCP save plan if rank 0 does not hold it (:mod:`~phalanx.checkpoint.dcp_plan`: planned once
per layout), builds the non-tensor state and the global plan, removes temporaries of dead
writers and makes a locked temporary directory ``ckpt-<step>.dcp.tmp-...`` beside the final
one; if that fails, every rank raises. Rank 0's answer names the directory and carries the
final plans the ranks lack. Then rank 0 writes ``phalanx-state.ckpt`` there, and every rank
writes its tensors as DCP's plan says
(:class:`~phalanx.checkpoint.dcp_engine.BalancedSavePlanner`: its shards, and its even share
of the replicated tensors; with phalanx's ZeRO, the optimizer state it owns, see
:mod:`~phalanx.checkpoint.dcp_zero`), checksumming its file as it writes it
(:class:`~phalanx.checkpoint.dcp_engine.ChecksummingWriter`), fsyncs it, and sends rank 0
where each item went, its CRC-32s, or its error. Rank 0 writes ``.metadata`` and the
manifest, fsyncs them with the state file, fsyncs the directory, renames it into place,
fsyncs the parent, prunes to ``keep``, and broadcasts the outcome: every rank returns, or
every rank raises the same error (and forgets its plans).

**Background saves** (``blocking=False``) take on the caller's thread only what changes as
training goes on and is not held back: the state dicts (references), this rank's RNG states,
rank 0's scheduler, scaler and sampler state, and a copy of the model's buffers (a forward
pass may change them); then they return. On a thread of their own they copy the parameters
and the optimizer state to host memory (:class:`~phalanx.checkpoint.dcp_engine.DeferredStaging`:
into the previous background save's copy, kept until ``close()``, when the tensors fit it)
while every optimizer's ``step()`` waits for that copy (a step pre-hook: the one thing that
changes them), and a change made otherwise (an in-place write, caught by the tensors'
version counters) fails the save on every rank; then they run every exchange above (RNG
states to rank 0, plans, rank 0's verdict and directory, whose error travels in its answer),
the write and the commit, over a Gloo group of their own (so that their collectives never
interleave with training's, and off the training group's ledger). At most one is in flight: the next save,
:meth:`~phalanx.checkpoint.Checkpointer.load`, ``wait()`` and ``close()`` wait for it and raise
its error, if any (on every rank). So does the end of the job: the save is registered with
its process group (:mod:`phalanx.unfinished`), which ``phalanx.destroy_process_group``
finishes first; at interpreter exit Python lets the writer thread end, and an error nobody
waited for is logged.

**Loading**. Every rank checks the manifest and every file's size and reads the state file
(checked by its own CRC-32); the verdicts are agreed. Then ``dcp.load`` reads into the
model's and optimizer's own state dicts, so each rank reads only what its layout needs: its
rows of each tensor (``fully_shard``) or every tensor whole (DDP, one process), at any world
size. :class:`~phalanx.checkpoint.dcp_engine.SafeReader` checks each stored item's bytes
against the manifest's CRC-32 as it reads them, before they are decoded, so no byte is read
twice (the next item is read on a thread while one is checked; an item that is the archive
phalanx writes for a contiguous tensor is decoded where it lies, without ``torch.load``; of
such an item of which this rank needs only some rows, at another world size, only the
blocks holding them are read, each checked by its block CRC-32 from the manifest); DCP gathers every rank's failures, so every rank raises the same
:class:`~phalanx.checkpoint.dcp_layout.DamagedCheckpoint` naming the file, and
``resume="auto"`` sets the checkpoint aside as ``.damaged`` and tries the previous one. A directory without a manifest (written by torch's ``dcp.save``) is loaded
without checksums, after a warning: its ``"model"`` (or, if its keys have no ``model.``
prefix, the whole of it) into the model, and its ``"optimizer"`` tensors, if given.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import os
import shutil
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict as _torch_state_dict
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.distributed.tensor import DTensor

from .. import unfinished
from .._logging import get_logger
from ..agreement import agree
from ..errors import CheckpointError
from ..process_group import leave_at_exit
from . import dcp_zero
from .dcp_plan import Plans
from .dcp_engine import (BalancedSavePlanner, ChecksummingWriter, DeferredStaging, SafeReader, _own,
                         merge, split)
from .dcp_layout import (
    MANIFEST,
    METADATA,
    DamagedCheckpoint,
    STATE_FILE,
    TempDir,
    Written,
    check_save_step,
    checksum,
    clean_stale_dirs,
    commit,
    fsync_files,
    prune_all,
    read_manifest,
    share,
    sharded_name,
    verify,
    write_file,
    write_manifest,
)
from .file import fsync_path, read_checkpoint, write_checkpoint
from .state import capture_rng_state, check_loadable
from .sync import SAVE_ERRORS, as_shared, broadcast_from_writer, gather_to_writer

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

_log = get_logger(__package__)
STATE_VERSION = 1
_SHARED_ERRORS = {cls.__name__: cls for cls in SAVE_ERRORS}


# format="auto": sharded from this world size up. Up to one node's worth of ranks (8 GPUs, the
# common node) share one host's disk and link: the single file's cost there is one sequential
# write, which that disk bounds whichever rank writes, plus rank 0's gather over the node's
# fast link. Past one node, the single file funnels every byte through one node's link and
# disk while the sharded format writes on every node's disk at once.
AUTO_SHARDED_WORLD = 9


def auto_format(model: Any, optimizer: Any, group: Any) -> str:
    """What ``format="auto"`` picks: ``"sharded"`` for a model with DTensor parameters
    (``fully_shard``), for phalanx's ``ZeroRedundancyOptimizer`` (the single file would gather
    all of its state on rank 0) or for a group of :data:`AUTO_SHARDED_WORLD` ranks or more,
    else ``"consolidated"`` (also with another sharded optimizer, torch's ZeRO, which the
    sharded format does not save)."""
    if dcp_zero.is_zero(optimizer) or any(isinstance(p, DTensor) for p in model.parameters()):
        return "sharded"
    if hasattr(optimizer, "consolidate_state_dict"):
        return "consolidated"
    return "sharded" if _rank_world(group)[1] >= AUTO_SHARDED_WORLD else "consolidated"


def _rank_world(group: Any) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@dataclasses.dataclass
class _Job:
    """A save's part on this rank once the exchanges before the writes are done: its final
    plan, the temporary directory; rank 0 also its lock and the state file's content (every
    rank's RNG states: dropped once written)."""

    plan: Any
    temp_path: Path
    final: Path
    temp: TempDir | None
    state: dict | None


class ShardedIO:
    """Saves and loads a :class:`~phalanx.checkpoint.Checkpointer`'s state as DCP directories
    (see the module notes); the Checkpointer holds one and calls it."""

    def __init__(self, owner: Checkpointer) -> None:
        # weakly: the Checkpointer holds this object, and a cycle would keep it (and its
        # comm_state, a LocalSGD meeting in flight included) alive until the cyclic GC ran
        self._owner = weakref.ref(owner)
        self._saving_for: Checkpointer | None = None  # held while a background save runs
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._owed_by: Any = None  # the group whose destruction waits for the save in flight
        self._background_group: Any = None
        self._warned_foreign = False
        self._manifest: dict | None = None  # of the checkpoint read last
        self._staged: Any = None  # the host-memory copy of the last background save
        self._plans = Plans()  # DCP's save plans, reused while the state's layout lasts
        self._staging: DeferredStaging | None = None  # of the background save in flight
        self._step_hook: Any = None  # makes every optimizer's step() wait for that staging
        self._optimizer_info: Any = None  # (the parameters, weakly; torch's _StateDictInfo; their names)

    @property
    def owner(self) -> Checkpointer:
        owner = self._owner()
        assert owner is not None, "a Checkpointer's ShardedIO outlived it"  # the owner holds it
        return owner

    # ---- saving ----------------------------------------------------------------------------
    def save(self, epoch: int, step: int, consumed: int | None, extra: Mapping | None,
             blocking: bool) -> Path:
        self.wait()
        o = self.owner
        zero = dcp_zero.is_zero(o.optimizer)
        # a background save copies every tensor before writing it: the Parameters themselves
        # will do (detaching each, a DTensor's, was a third of the call's time on the training's
        # thread at world 4)
        tree = {"model": o.module.state_dict(keep_vars=not blocking)}
        params = list(o.module.parameters())
        if zero:  # this rank's owned entries, named as a plain optimizer's
            tree["optimizer"] = dcp_zero.optimizer_tree(o.module, o.optimizer)
        elif o.optimizer is not None:
            tree["optimizer"] = self._optimizer_state(o.module, o.optimizer, params)
        tensors, rest = split(tree)
        try:
            return self._save(epoch, step, consumed, extra, blocking, tensors, rest, zero, params)
        except BaseException:
            self._plans.forget()  # (every rank raises: every rank plans anew next time)
            raise

    def _optimizer_state(self, module: Any, optimizer: Any, model_params: list) -> dict:
        """``get_optimizer_state_dict(module, optimizer)``. Most of its time is spent finding
        each parameter's name (torch's ``_get_fqns``, a walk of the module per parameter),
        the same for every save: so the names are found once, by torch's own code, while the
        model's and the optimizer's parameters are the same objects, and checked once against
        ``get_optimizer_state_dict``'s result (which is used whenever they differ, and for
        torch's FSDP1, whose optimizer state torch converts)."""
        sd = _torch_state_dict
        if not all(hasattr(sd, n) for n in ("_verify_options", "_init_optim_state", "_get_fqns",
                                            "_maybe_full_or_cpu_state_dict", "_gc_context")):
            return get_optimizer_state_dict(module, optimizer)  # (another torch)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        known = self._optimizer_info
        if known is None or len(known[0]) != len(params) + len(model_params) or any(
                r() is not p for r, p in zip(known[0], [*params, *model_params])):
            expected = get_optimizer_state_dict(module, optimizer)
            info = sd._verify_options(module, (optimizer,), optim_only=True)
            names = None
            if not info.fsdp_modules and not info.flatten_optimizer_state_dict:
                pid = {p: i for i, p in enumerate(params)}
                names = [None] * len(params)
                for key, param in module.named_parameters():
                    fqns = sd._get_fqns(module, key)
                    if len(fqns) == 1 and param in pid:
                        names[pid[param]] = next(iter(fqns))
            known = self._optimizer_info = ([weakref.ref(p) for p in (*params, *model_params)], info, names)
            if names is None or None in names or not _same_tree(self._named_state(optimizer, known), expected):
                self._optimizer_info = (known[0], info, None)
            return expected
        if known[2] is None:
            return get_optimizer_state_dict(module, optimizer)
        with sd._gc_context():
            return self._named_state(optimizer, known)

    @staticmethod
    def _named_state(optimizer: Any, known: tuple) -> dict:
        """What torch's ``_get_optim_state_dict`` gives for one optimizer of a model that is
        not FSDP1's, with the parameters' names ``known[2]`` (by their index)."""
        _, info, names = known
        _torch_state_dict._init_optim_state(optimizer)
        osd = optimizer.state_dict()
        state = {names[pid]: value for pid, value in osd["state"].items()}
        groups = osd["param_groups"]
        for group in groups:
            group["params"] = [names[pid] for pid in group["params"]]
        return _torch_state_dict._maybe_full_or_cpu_state_dict({"state": state, "param_groups": groups}, info)

    def _save(self, epoch: int, step: int, consumed: int | None, extra: Mapping | None, blocking: bool,
              tensors: dict, rest: dict, zero: bool, model_params: list) -> Path:
        o = self.owner
        rank, _ = _rank_world(o.group)
        local = None if o.comm_state is None else o.comm_state.state_dict()
        # (ZeRO: the non-tensor state of each rank's own parameters, if its optimizer has any)
        owned_rest = rest["optimizer"].get("state") if zero else None
        if not blocking:  # gathered on the writer's thread, later: copied now (the comm state's
            # tensors, PowerSGD's error feedback, change in the next backward, before any step)
            local, owned_rest = copy.deepcopy(local), copy.deepcopy(owned_rest)
        # what changes as training goes on, taken now: this rank's RNG states, rank 0's objects
        mine = (epoch, step, capture_rng_state(), local, owned_rest)
        objects = self._objects(consumed) if rank == 0 else None
        saved = (mine, objects, dict(extra or {}), rest)
        if blocking:
            planner = BalancedSavePlanner()
            planner.set_up_planner(tensors, is_coordinator=rank == 0)
            job = self._prepare(planner, *saved, o.group, None)
            return self._write(planner, job, o.group)
        group = self._group()  # (a collective: made on the first background save)
        # this rank's part, copied to host memory into the previous save's buffers (kept
        # between saves, released by close()): the model's buffers now (a forward pass may
        # change them), the parameters and optimizer state on the writer's thread, which every
        # optimizer's step() waits for (the only thing that changes them)
        params = {_own(p).data_ptr() for p in model_params if p.numel()}
        staging = DeferredStaging(
            tensors, self._staged,
            lambda path, t: path[0] == "model" and (not t.numel() or _own(t).data_ptr() not in params))
        self._watch_steps()
        self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix="phalanx-checkpoint")
        self._staging = staging
        try:
            self._pending = self._pool.submit(self._background, staging, tensors, saved, group)
        except BaseException:
            staging.done.set()  # (no step may wait for a copy nobody will make)
            raise
        self._saving_for = o
        self._owed_by = (o.group or dist.group.WORLD) if dist.is_initialized() else None
        if self._owed_by is not None:
            unfinished.owe(self._owed_by, self.wait)  # destroy_process_group finishes it first
        atexit.register(self._wait_at_exit)
        return o.directory / sharded_name(step)

    def _background(self, staging: DeferredStaging, tensors: dict, saved: tuple, group: Any) -> Path:
        """The writer's thread: the staging's rest, then the save's exchanges and writes,
        over the background group (an error of any rank's is raised on every rank)."""
        try:
            problem = None
            try:
                self._staged = staging.finish()
            except Exception as e:
                problem = f"rank {_rank_world(group)[0]}: {e}"
            # (failed: planned on the live tensors, whose layout is the copy's, to report it)
            staged = staging.tree if problem is None else tensors
            planner = BalancedSavePlanner()
            planner.set_up_planner(staged, is_coordinator=_rank_world(group)[0] == 0)
            job = self._prepare(planner, *saved, group, problem)
        except BaseException:
            self._plans.forget()
            raise
        return self._write(planner, job, group)

    def _prepare(self, planner: BalancedSavePlanner, mine: tuple, objects: dict | None, extra: dict,
                 rest: dict, group: Any, problem: str | None) -> _Job:
        """Every rank: the exchanges before the writes. Rank 0 gathers every rank's RNG states
        (and save plan, if it lacks it: dcp_plan), builds the state file's content and the
        global plan, and makes the temporary directory; its answer names the directory and
        carries the final plans the ranks lack, or the error every rank raises (a blocking
        save agrees through :func:`agree`, on the training's group; a background one has its
        answer carry the error, on the background group, off the training's ledger)."""
        o = self.owner
        rank, _ = _rank_world(group)
        step = mine[1]
        final = o.directory / sharded_name(step)
        gathered = gather_to_writer((mine, self._plans.offer(planner), problem), group)
        temp, state, plans, error = None, None, None, None
        if gathered is not None:
            try:
                failed = [p for *_, p in gathered if p is not None]
                if failed:
                    raise CheckpointError(f"Saving checkpoint {final} failed on " + "; ".join(failed))
                state = self._state([g for g, *_ in gathered], objects, extra, rest, planner.state_dict)
                plans = self._plans.decide(planner, [offer for _, offer, _ in gathered])
                temp = TempDir(o.directory, step)
            except Exception as e:
                error = as_shared(e, f"Saving checkpoint {final} failed on rank 0: ", SAVE_ERRORS)
        if group is o.group:
            agree(f"Saving checkpoint {final}", group, problem=error, decided_by=0)
        answer = None if gathered is None else (temp.path.name, plans) if error is None else (
            type(error).__name__, str(error))
        # the temporary directory's name, and each rank's final plan (if it does not hold it)
        answer = broadcast_from_writer(answer, group)
        if error is not None:
            raise error
        name, plans = answer
        if isinstance(plans, str):  # rank 0's error, as its type
            raise _SHARED_ERRORS.get(name, CheckpointError)(plans)
        plan = self._plans.accept(plans[rank])
        return _Job(plan, o.directory / name, final, temp, state)

    def _watch_steps(self) -> None:
        """Every optimizer's ``step()`` waits for the staging in flight (a hook registered
        once, removed by close(); it holds this object weakly)."""
        if self._step_hook is None:
            me = weakref.ref(self)

            def wait_for_staging(*_args: Any) -> None:
                io = me()
                staging = None if io is None else io._staging
                if staging is not None:
                    staging.done.wait()
            self._step_hook = register_optimizer_step_pre_hook(wait_for_staging)

    def _group(self) -> Any:
        """The Gloo group of the background saves (made on the first; every rank calls)."""
        if self._background_group is None and dist.is_initialized():
            leave_at_exit()  # a group used on a thread must not outlive the interpreter
            ranks = dist.get_process_group_ranks(self.owner.group or dist.group.WORLD)
            self._background_group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        return self._background_group

    def _objects(self, consumed: int | None) -> dict:
        """Rank 0, at save time: the scheduler's, scaler's and sampler's state dicts."""
        o = self.owner
        out = {}
        for name in ("scheduler", "scaler", "sampler"):
            obj = getattr(o, name)
            if obj is not None:
                out[name] = obj.state_dict(consumed=consumed) if (
                    name == "sampler" and consumed is not None) else obj.state_dict()
        return out

    def _state(self, gathered: list, objects: dict, extra: dict, rest: dict, tensors: dict) -> dict:
        """Rank 0: the non-tensor state, checked; the directory checked and tidied."""
        o = self.owner
        epoch, step = check_save_step(gathered, o.directory)
        sharded = any(isinstance(t, DTensor) for t in _leaves(tensors))
        layout = "sharded" if sharded else "zero" if dcp_zero.is_zero(o.optimizer) else "replicated"
        if layout == "zero":
            owned = {k: v for *_, part in gathered for k, v in (part or {}).items()}
            rest = {**rest, "optimizer": {**rest["optimizer"], "state": owned}} if owned else rest
        state = {"version": STATE_VERSION, "epoch": epoch, "step": step, "world_size": len(gathered),
                 "layout": layout, "skeleton": rest,
                 "rng": [rng for _, _, rng, *_ in gathered], "extra": extra}
        if o.comm_state is not None:
            state["comm_state"] = [local for _, _, _, local, _ in gathered]
        state.update(objects)
        for key, value in state.items():
            check_loadable(value, key)
        for stale in clean_stale_dirs(o.directory):
            _log.info("removed %s, left by a writer that died", stale)
        return state

    def _write(self, planner: BalancedSavePlanner, job: _Job, group: Any) -> Path:
        """Every rank (main thread or background): write, checksum, commit, agree."""
        try:
            return self._write_and_commit(planner, job, group)
        except BaseException:
            self._plans.forget()  # (every rank raises: every rank plans anew next time)
            raise

    def _write_and_commit(self, planner: BalancedSavePlanner, job: _Job, group: Any) -> Path:
        rank, _ = _rank_world(group)
        writer = ChecksummingWriter(job.temp_path)
        writer.set_up_storage_writer(rank == 0, rank=rank)
        written, error, head = None, None, None
        if job.state is not None:  # rank 0: the state file first, while the others write theirs
            head = {k: job.state[k] for k in ("step", "epoch", "world_size", "layout")}
            try:  # (fsynced at the commit, with .metadata and the manifest)
                write_checkpoint(job.temp_path / STATE_FILE, job.state, sync=False)
            except Exception as e:  # (reported below: every rank still writes its part)
                error = f"rank {rank}: {type(e).__name__}: {e}"
            finally:  # (every rank's RNG states: not held while the data and the reports are)
                job.state = None
        try:
            written = writer.write(job.plan, planner)  # what it wrote, taken as it wrote it
        except Exception as e:
            error = error or f"rank {rank}: {type(e).__name__}: {e}"
        reports = gather_to_writer((written, error), group)
        del written
        outcome = None
        if reports is not None:
            try:
                failed = [e for _, e in reports if e is not None]
                if failed:
                    raise CheckpointError(f"Writing checkpoint {job.final} failed on " + "; ".join(failed))
                # .metadata, as DCP's finish writes it, from where every rank put its items
                data = self._plans.metadata_file([w for w, _ in reports], writer.storage_meta())
                files: dict[str, Any] = {METADATA: write_file(job.temp_path / METADATA, data)}
                files.update((w.name, w) for w, _ in reports)
                del reports
                self._commit(job.temp_path, job.final, head, files)
            except Exception as e:
                outcome = str(as_shared(e, f"Saving checkpoint {job.final} failed on rank 0: "))
                shutil.rmtree(job.temp_path, ignore_errors=True)
            finally:
                job.temp.release()
        outcome = broadcast_from_writer(outcome, group)
        if outcome is not None:
            raise CheckpointError(outcome)
        return job.final

    def _commit(self, temp_path: Path, final: Path, head: dict, files: dict) -> None:
        """Rank 0, once every rank's tensor file is durable: manifest, rename. (The state
        file, .metadata and the manifest are fsynced here, together: the first fsync's
        journal commit takes the others'.) ``files``: name -> the manifest's entry, or the
        :class:`~phalanx.checkpoint.dcp_layout.Written` it is made of."""
        others = [n for n in os.listdir(temp_path) if n not in files and n != MANIFEST]
        files.update({n: checksum(temp_path / n) for n in others})
        write_manifest(temp_path, {**head, "files": files}, sync=False)
        fsync_files([temp_path / n for n in (STATE_FILE, METADATA, MANIFEST)])
        fsync_path(temp_path)
        commit(temp_path, final)
        o = self.owner
        if o.keep is not None:
            prune_all(o.directory, o.keep)
        size = sum(f.size if isinstance(f, Written) else f["bytes"] for f in files.values())
        _log.info("saved %s (%.1f MB in %d files, epoch %d, step %d)", final, size / 1e6,
                  len(files), head["epoch"], head["step"])

    def wait(self) -> Path | None:
        """The path of the background save in flight once it is committed (``None`` if none);
        raises its error (on every rank)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        atexit.unregister(self._wait_at_exit)
        if self._owed_by is not None:
            unfinished.settle(self._owed_by, self.wait)
        try:
            return pending.result()
        finally:
            self._saving_for = None

    def _wait_at_exit(self) -> None:
        """At interpreter exit (after Python has let the writer thread finish): the
        outcome of a background save nobody waited for, logged if it failed."""
        try:
            self.wait()
        except Exception as e:
            _log.error("%s", e)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._staged = None
            self._staging = None
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None

    # ---- loading ---------------------------------------------------------------------------
    def read(self, path: Path) -> dict:
        """This rank's checks before anything is decoded (no collective); the state file."""
        manifest = read_manifest(path)
        rank, world = _rank_world(self.owner.group)
        if manifest is None:
            return self._foreign(path, rank)
        for name, expected in manifest["files"].items():
            try:
                found = (path / name).stat().st_size
            except FileNotFoundError:
                raise CheckpointError(f"Checkpoint {path} is damaged: its file {name} is missing") from None
            if found != expected["bytes"]:
                raise CheckpointError(f"Checkpoint {path} is damaged: its file {name} has {found} "
                                      f"bytes, the manifest says {expected['bytes']}")
        # Each byte is checked once, as it is read, before it is decoded: the tensor files'
        # items as DCP reads them and .metadata (SafeReader), the state file by its own
        # CRC-32 (read_checkpoint); anything else whole, the ranks sharing the reading.
        whole = {n: f["bytes"] for n, f in manifest["files"].items()
                 if "items" not in f and n not in (".metadata", STATE_FILE)}
        verify(path, manifest, share(whole, world)[rank])
        self._manifest = manifest
        state = read_checkpoint(path / STATE_FILE, map_location=self.owner.map_location)
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise CheckpointError(f"Checkpoint {path}: {STATE_FILE} holds no state of version {STATE_VERSION}")
        return state

    def _foreign(self, path: Path, rank: int) -> dict:
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"Checkpoint {path} is neither a phalanx checkpoint nor a DCP "
                                  f"checkpoint: it has no {MANIFEST} and no .metadata")
        if rank == 0 and not self._warned_foreign:
            _log.warning("checkpoint %s has no %s (written by torch's dcp.save?): it has no "
                         "checksums to check; loading it as it is", path, MANIFEST)
            self._warned_foreign = True
        writers = {n.split("_")[2] for n in os.listdir(path) if n.startswith("__") and n.endswith(".distcp")}
        return {"version": STATE_VERSION, "epoch": 0, "step": 0, "world_size": len(writers),
                "extra": {}, "rng": [], "foreign": True}

    def apply(self, state: dict, path: Path) -> None:
        """Every rank: ``dcp.load`` into the model's and optimizer's state (a collective)."""
        o = self.owner
        zero = dcp_zero.is_zero(o.optimizer)
        if hasattr(o.optimizer, "consolidate_state_dict") and not zero:
            raise CheckpointError(f"Checkpoint {path} is sharded (DCP): loading it into "
                                  f"{type(o.optimizer).__name__} is not supported (phalanx's "
                                  "ZeroRedundancyOptimizer is)")
        reader = SafeReader(path, None if state.get("foreign") else self._manifest)
        target = {"model": o.module.state_dict()}
        if zero:  # the entries of the parameters this rank owns, shaped as saved
            target["optimizer"] = {**dcp_zero.targets(o.module, o.optimizer, reader.read_metadata()),
                                   "param_groups": dcp_zero.param_groups(o.module, o.optimizer)}
        elif o.optimizer is not None:
            target["optimizer"] = get_optimizer_state_dict(o.module, o.optimizer)
        tensors, rest = split(target)
        bare = False
        if state.get("foreign"):
            keys = reader.read_metadata().state_dict_metadata
            bare = not any(k.startswith("model.") for k in keys)  # a model's state dict alone
            if o.optimizer is not None and (bare or not any(k.startswith("optimizer.") for k in keys)):
                raise CheckpointError(f"Checkpoint {path} holds no optimizer state, but an optimizer was given")
        else:
            rest = state["skeleton"]
        try:
            dcp.load(tensors["model"] if bare else tensors, storage_reader=reader,
                     process_group=o.group, no_dist=not dist.is_initialized())
        except CheckpointException as e:  # every rank sees every rank's failures
            damage = [str(f) for _, (f, _) in sorted(e.failures.items()) if isinstance(f, DamagedCheckpoint)]
            if damage:
                raise DamagedCheckpoint(damage[0]) from None
            raise
        loaded = merge(tensors, rest)
        o.module.load_state_dict(loaded["model"])
        if zero:
            if "optimizer" not in loaded:
                raise CheckpointError(f"Checkpoint {path} holds no optimizer state, but an optimizer was given")
            dcp_zero.load(o.module, o.optimizer, loaded["optimizer"], path)
        elif o.optimizer is not None:
            set_optimizer_state_dict(o.module, o.optimizer, loaded["optimizer"])


def _same_tree(a: Any, b: Any) -> bool:
    """Whether two nests of dicts and lists are equal, their tensors the same objects."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b


def _leaves(tree: dict) -> Any:
    for value in tree.values():
        if isinstance(value, dict):
            yield from _leaves(value)
        else:
            yield value
