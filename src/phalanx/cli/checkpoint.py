"""``phalanx checkpoint``: look at a checkpoint, check its bytes, export its model.

PATH is a checkpoint of either format, the single file (``ckpt-<step>.ckpt``) or the sharded
directory (``ckpt-<step>.dcp``, also one torch's ``dcp.save`` wrote), or a run directory,
which stands for its newest checkpoint. One process, no process group, no GPU.

``phalanx checkpoint info PATH``
    step, epoch, the world size and layout it was saved at, its format, its tensors (the
    model's one by one with dtype, shape and bytes; the optimizer's counted), their total
    bytes, and the checksums' verdict (every byte is read).
``phalanx checkpoint verify PATH``
    checks every byte against its checksum. Exit 0: intact; 1: damaged, each damaged file
    named. A directory torch's ``dcp.save`` wrote has no checksums: its structure is checked
    (``.metadata`` readable, every stored item inside its file), a note says that its bytes
    could not be, and it exits 0 (phalanx loads such a directory, with the same warning).
``phalanx checkpoint export PATH OUT``
    writes the model's state dict, whole tensors on the CPU (a sharded model's shards joined),
    to ``OUT``: ``torch.save`` for ``.pt``/``.pth``, safetensors for ``.safetensors`` (needs
    ``pip install safetensors``; non-tensor entries are left out and named). The bytes are
    checked as they are read; ``OUT`` appears complete or not at all. An existing ``OUT`` is
    replaced only with ``--force``. The whole model is held in memory (a single-file
    checkpoint: the whole file).

Exit status: 0 done; 1 the checkpoint is damaged or cannot be read; 2 a bad command line
(no such checkpoint, an unknown ``OUT`` suffix, safetensors not installed, ``OUT`` exists).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from .text import add_manual_parser


def add_checkpoint(commands: argparse._SubParsersAction) -> None:
    parser = add_manual_parser(commands, "checkpoint", "look at, verify or export a checkpoint",
                               __doc__)
    actions = parser.add_subparsers(title="actions", metavar="ACTION", parser_class=type(parser))
    info = actions.add_parser("info", help="step, world size, layout, tensors, checksums' verdict")
    verify = actions.add_parser("verify", help="check every byte (exit 1 naming damaged files)")
    export = actions.add_parser("export", help="the model's state dict to OUT (.pt or .safetensors)")
    for sub, handler in ((info, _info), (verify, _verify), (export, _export)):
        sub.add_argument("path", metavar="PATH", help="a checkpoint file or directory, or a run "
                                                      "directory (its newest checkpoint)")
        sub.set_defaults(handler=_on_checkpoint(handler))
    export.add_argument("out", metavar="OUT", help="the file to write: .pt, .pth or .safetensors")
    export.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.set_defaults(handler=lambda args: _usage(parser))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _error(message: str, status: int) -> int:
    print(f"phalanx checkpoint: error: {message}", file=sys.stderr)
    return status


def _on_checkpoint(action: Callable[..., int]) -> Callable[[argparse.Namespace], int]:
    """The handler that runs ``action(args, contents, path)`` once PATH is resolved (exit 2
    when it is no checkpoint); ``contents`` is :mod:`phalanx.checkpoint.contents`."""
    def handler(args: argparse.Namespace) -> int:
        from ..checkpoint import contents  # torch: imported by the command, not by the CLI's start

        try:
            path = contents.resolve(args.path)
        except contents.NotACheckpoint as e:
            return _error(str(e), 2)
        return action(args, contents, path)
    return handler


def _info(args: argparse.Namespace, contents: Any, path: Path) -> int:
    found = contents.describe(path)
    print(f"{path}")
    print(f"  format      {found.format}" + ("" if found.format == "consolidated" else " (torch DCP)"))
    for label, value in (("step", found.step), ("epoch", found.epoch),
                         ("world size", found.world_size), ("layout", found.layout)):
        if value is not None:
            print(f"  {label:<11} {value}")
    model = [t for t in found.tensors if t.name.startswith("model.")] or (
        found.tensors if found.format == "sharded" and not found.checked else [])
    others = [t for t in found.tensors if t not in model]
    if found.tensors:
        print(f"  tensors     {len(found.tensors)}, {_size(sum(t.nbytes for t in found.tensors))}"
              f" (model {len(model)}, {_size(sum(t.nbytes for t in model))}; "
              f"other {len(others)}, {_size(sum(t.nbytes for t in others))})")
    print(f"  checksums   {_verdict(found, contents)}")
    if model:
        width = max(len(t.name) for t in model)
        print("model:")
        for t in model:
            shape = "[" + ", ".join(map(str, t.shape)) + "]"
            print(f"  {t.name:<{width}}  {str(t.dtype).removeprefix('torch.'):<9} {shape:<16} {_size(t.nbytes)}")
    for problem in found.damage:
        print(problem, file=sys.stderr)
    return 1 if found.damage else 0


def _verdict(found, contents) -> str:
    if found.damage:
        return f"DAMAGED ({len(found.damage)} problem{'s' if len(found.damage) > 1 else ''})"
    if not found.checked:
        return "none: " + contents.NO_CHECKSUMS.format(manifest=contents.MANIFEST)
    return "intact (every byte checked)"


def _verify(args: argparse.Namespace, contents: Any, path: Path) -> int:
    found = contents.describe(path)
    for problem in found.damage:
        print(problem, file=sys.stderr)
    if found.damage:
        print(f"{path}: DAMAGED", file=sys.stderr)
        return 1
    if not found.checked:
        print(f"{path}: note: " + contents.NO_CHECKSUMS.format(manifest=contents.MANIFEST), file=sys.stderr)
        print(f"{path}: structure OK, bytes unchecked")
        return 0
    print(f"{path}: OK ({_size(sum(t.nbytes for t in found.tensors))} of tensors, every byte checked)")
    return 0


def _export(args: argparse.Namespace, contents: Any, path: Path) -> int:
    from ..errors import CheckpointError

    out = Path(args.out)
    if out.exists() and not args.force:
        return _error(f"{out} exists (--force replaces it)", 2)
    try:
        left_out = contents.export(path, out)
    except (ValueError, ImportError) as e:
        return _error(str(e), 2)
    except CheckpointError as e:
        return _error(str(e), 1)
    if path.is_dir() and not (path / contents.MANIFEST).exists():
        print(f"phalanx checkpoint: note: {path}: " + contents.NO_CHECKSUMS.format(
            manifest=contents.MANIFEST).split(";")[0] + ": its bytes were exported unchecked",
              file=sys.stderr)
    for name in left_out:
        print(f"phalanx checkpoint: note: {name} is not a tensor: left out of {out}", file=sys.stderr)
    print(f"{out}: the model of {path} ({_size(out.stat().st_size)})")
    return 0


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
