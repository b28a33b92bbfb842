"""A checkpoint looked at from outside a training run: what it holds, whether its bytes are
intact, and its model's state dict whole. One process, no process group; both formats (the
single file ``ckpt-<step>.ckpt`` and the sharded directory ``ckpt-<step>.dcp``, phalanx's or
one torch's ``dcp.save`` wrote). ``phalanx checkpoint`` (:mod:`phalanx.cli.checkpoint`) is
its command line.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..errors import CheckpointError
from .dcp_engine import SafeReader, merge
from .dcp_layout import MANIFEST, STATE_FILE, DamagedCheckpoint, list_all, problems, read_manifest
from .file import read_checkpoint
from .sharded import restore

# What `verify` says of a directory torch's dcp.save wrote (no manifest).
NO_CHECKSUMS = ("it has no checksums ({manifest} missing: written by torch's dcp.save?); only its "
                "structure was checked (.metadata readable, every stored item inside its file)")


class NotACheckpoint(ValueError):
    """The path names no checkpoint: missing, or neither a checkpoint nor a run directory."""


@dataclass
class Tensor:
    """One tensor of a checkpoint: its name (``model.<fqn>``, ``optimizer...``), dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass
class Contents:
    """What :func:`describe` found. ``damage`` lists what is wrong (empty: intact);
    ``checked`` is ``False`` for a checkpoint without checksums (torch's ``dcp.save``)."""

    path: Path
    format: str  # "consolidated" or "sharded"
    step: int | None = None
    epoch: int | None = None
    world_size: int | None = None
    layout: str | None = None
    tensors: list[Tensor] = field(default_factory=list)
    damage: list[str] = field(default_factory=list)
    checked: bool = True


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint ``path`` names: itself (a ``.ckpt`` file or a checkpoint directory), or
    the newest checkpoint of a run directory."""
    path = Path(path)
    if not path.exists():
        raise NotACheckpoint(f"{path} does not exist")
    if path.is_file() or (path / ".metadata").is_file() or (path / MANIFEST).is_file():
        return path
    found = list_all(path)
    if not found:
        raise NotACheckpoint(f"{path} is neither a checkpoint (a ckpt-<step>.ckpt file, a directory "
                             "with .metadata) nor a directory holding checkpoints")
    return found[-1]


def describe(path: Path) -> Contents:
    """Everything about the checkpoint at ``path``, every byte checked (nothing raised for
    damage: it is listed in ``damage``)."""
    if path.is_file():
        return _describe_file(path)
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return Contents(path, "sharded", damage=[str(e)])
    found = Contents(path, "sharded")
    if manifest is None:
        found.checked = False
        found.world_size = len({n.split("_")[2] for n in os.listdir(path)
                                if n.startswith("__") and n.endswith(".distcp")})
    else:
        found.step, found.epoch = manifest["step"], manifest["epoch"]
        found.world_size, found.layout = manifest["world_size"], manifest["layout"]
        found.damage = problems(path, manifest, list(manifest["files"]))
    if any(".metadata" in d for d in found.damage):
        return found  # (its tensors cannot be listed)
    try:
        metadata = SafeReader(path).read_metadata()
    except Exception as e:
        found.damage.append(f"Checkpoint {path}: its .metadata cannot be read: {type(e).__name__}: {e}")
        return found
    found.tensors = [Tensor(k, m.properties.dtype, tuple(m.size))
                     for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)]
    if manifest is None:
        found.damage = _structure(path, metadata)
    return found


def _describe_file(path: Path) -> Contents:
    found = Contents(path, "consolidated")
    try:
        state = _read_file(path)
    except CheckpointError as e:
        found.damage = [str(e)]
        return found
    found.step, found.epoch, found.world_size = state["step"], state["epoch"], state["world_size"]
    found.layout = state["layout"]
    found.tensors = [Tensor(f"model.{k}", v.dtype, tuple(v.shape))
                     for k, v in state["model"].items() if isinstance(v, torch.Tensor)]
    optimizer = state.get("optimizer") or {}
    for index, per_param in optimizer.get("state", {}).items():
        found.tensors += [Tensor(f"optimizer.state.{index}.{n}", v.dtype, tuple(v.shape))
                          for n, v in per_param.items() if isinstance(v, torch.Tensor)]
    return found


def _read_file(path: Path) -> dict:
    """A single-file checkpoint's state, every tensor whole on the CPU, and its ``"layout"``
    (as the sharded format's manifest names it)."""
    state = read_checkpoint(path, map_location="cpu")
    if not isinstance(state, dict) or not {"step", "epoch", "world_size", "model"} <= set(state):
        raise CheckpointError(f"Checkpoint {path} holds no Checkpointer state (step, epoch, "
                              "world_size, model)")
    state["layout"] = "sharded" if state.get("sharded") is not None else "replicated"
    if state["layout"] == "sharded":
        restore(state, None, path)  # the fully_shard tensors, whole, in their places
    return state


def _structure(path: Path, metadata: Metadata) -> list[str]:
    """What is wrong with a DCP directory without checksums: each stored item must lie
    inside its file."""
    found, sizes = [], {}
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path
        if name not in sizes:
            try:
                sizes[name] = (path / name).stat().st_size
            except FileNotFoundError:
                sizes[name] = None
                found.append(f"Checkpoint {path} is damaged: its file {name} is missing")
        if sizes[name] is not None and info.offset + info.length > sizes[name]:
            found.append(f"Checkpoint {path} is damaged: its file {name} has {sizes[name]} bytes, "
                         f".metadata places an item at [{info.offset}, {info.offset + info.length})")
            sizes[name] = None  # (one line per file)
    return found


def model_state(path: Path) -> dict[str, Any]:
    """The model's state dict saved in the checkpoint at ``path``, every tensor whole on the
    CPU (a sharded directory is read without a process group; its bytes checked as read).

    Raises:
        CheckpointError: the checkpoint is damaged or holds no model.
    """
    if path.is_file():
        return _read_file(path)["model"]
    manifest = read_manifest(path)
    reader = SafeReader(path, manifest)
    metadata = reader.read_metadata()
    places = {k: metadata.planner_data.get(k, (k,)) if metadata.planner_data else (k,)
              for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    bare = not any(p[0] == "model" and len(p) > 1 for p in places.values())  # torch's: a bare model
    wanted = {k: p if bare else p[1:] for k, p in places.items() if bare or p[0] == "model"}
    target = {k: torch.empty(metadata.state_dict_metadata[k].size,
                             dtype=metadata.state_dict_metadata[k].properties.dtype) for k in wanted}
    if not target:
        raise CheckpointError(f"Checkpoint {path} holds no model tensors")
    try:
        with warnings.catch_warnings():  # ("torch.distributed is disabled...": on purpose here)
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            # keys as DCP flattened them: each is read straight into its tensor
            dcp_load(target, storage_reader=reader, planner=DefaultLoadPlanner(flatten_state_dict=False),
                     no_dist=True)
    except CheckpointException as e:
        damage = [f for f, _ in e.failures.values() if isinstance(f, DamagedCheckpoint)]
        raise (damage[0] if damage else CheckpointError(f"Checkpoint {path} cannot be read: {e}")) from None
    model: dict[str, Any] = {}
    for key, at in wanted.items():
        model[".".join(map(str, at))] = target[key]
    if manifest is not None:
        skeleton = read_checkpoint(path / STATE_FILE, map_location="cpu")["skeleton"].get("model", {})
        model = merge(model, skeleton)
    return model


EXPORT_SUFFIXES = (".pt", ".pth", ".safetensors")


def export(path: Path, out: Path) -> list[str]:
    """Write the model's state dict of the checkpoint at ``path`` to ``out``, whole tensors:
    ``torch.save`` for ``.pt``/``.pth``, safetensors' ``save_file`` for ``.safetensors``
    (needs the ``safetensors`` package); written beside ``out`` first, fsynced, then renamed.
    Returns the names of the entries left out (safetensors holds tensors only).

    Raises:
        ValueError: ``out`` has another suffix.
        ImportError: ``.safetensors`` without the ``safetensors`` package.
        CheckpointError: the checkpoint is damaged or holds no model.
    """
    if out.suffix not in EXPORT_SUFFIXES:
        raise ValueError(f"Invalid output {out}: expected a name ending in "
                         f"{', '.join(EXPORT_SUFFIXES)}, got {out.suffix or 'no suffix'!r}")
    save_file = _safetensors_save() if out.suffix == ".safetensors" else None
    model = model_state(path)
    left_out = []
    temp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if save_file is None:
            torch.save(model, temp)
        else:
            left_out = [k for k, v in model.items() if not isinstance(v, torch.Tensor)]
            save_file(_unshared({k: v for k, v in model.items() if isinstance(v, torch.Tensor)}), str(temp))
        with open(temp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temp, out)
    finally:
        temp.unlink(missing_ok=True)
    return left_out


def _safetensors_save() -> Any:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ImportError("Exporting to .safetensors needs the safetensors package, which is not "
                          "installed: pip install safetensors") from None
    return save_file


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, none sharing memory with another (safetensors refuses both; tied
    weights loaded from one file share a storage)."""
    out, seen = {}, set()
    for key, value in tensors.items():
        value = value.contiguous()
        ptr = value.untyped_storage().data_ptr()
        out[key] = value.clone() if ptr in seen else value
        seen.add(ptr)
    return out
