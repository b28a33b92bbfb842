"""A process SIGKILLed at any point of a save: the previous checkpoint survives byte for byte,
no half-written file appears under a final name, and the next save leaves no temporaries."""

import os
import signal

import torch

from phalanx.checkpoint import file as checkpoint_file
from phalanx.checkpoint import Checkpointer, read_checkpoint
from phalanx.checkpoint.file import checkpoint_name
from tests.harness import RankError, run_ranks

# Where the writer is SIGKILLed, and what that interrupts.
_KILL_POINTS = {
    "mid-payload": "the payload stream, after its third write",
    "before-fsync": "before the temporary is fsynced",
    "before-rename": "after the fsync, before the rename",
    "before-dir-fsync": "after the rename, before the directory is fsynced",
    "mid-prune": "while the oldest checkpoint is being deleted",
}


def _model(fill):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    return model


def _die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _intercept(point):
    if point == "mid-payload":
        original = checkpoint_file._ChecksumWriter.write
        calls = []

        def write(self, data):
            calls.append(1)
            if len(calls) == 3:
                _die()
            return original(self, data)

        checkpoint_file._ChecksumWriter.write = write
    elif point == "before-fsync":
        checkpoint_file.os.fsync = _die
    elif point == "before-rename":
        checkpoint_file.os.replace = _die
    elif point == "before-dir-fsync":
        checkpoint_file.fsync_path = _die
    elif point == "mid-prune":
        os.unlink = _die  # (prune_all deletes files of either format)


def _save_and_die(rank, _world_size, directories):
    point = list(_KILL_POINTS)[rank]
    _intercept(point)
    Checkpointer(directories[rank], _model(2.0), keep=1).save(0, 2)
    return f"{point}: still alive after the save"


def test_kill_during_save_at_every_point(tmp_path):
    directories = [tmp_path / point for point in _KILL_POINTS]
    before = {}
    for directory in directories:
        path = Checkpointer(directory, _model(1.0), keep=1).save(0, 1)
        before[directory] = path.read_bytes()

    results = run_ranks(_save_and_die, len(directories), directories, init=False,
                        return_exceptions=True)

    previous, new = checkpoint_name(1), checkpoint_name(2)
    for point, directory, result in zip(_KILL_POINTS, directories, results):
        why = f"killed {_KILL_POINTS[point]} ({point})"
        assert isinstance(result, RankError) and "exit code -9" in result.message, (why, result)
        names = os.listdir(directory)
        finals = sorted(n for n in names if not n.startswith("."))
        temps = [n for n in names if n.startswith(".")]
        renamed = point in ("before-dir-fsync", "mid-prune")
        assert finals == ([previous, new] if renamed else [previous]), (why, names)
        assert len(temps) == (0 if renamed else 1), (why, names)
        assert (directory / previous).read_bytes() == before[directory], why
        assert read_checkpoint(directory / previous)["model"]["0.weight"].eq(1.0).all(), why
        if renamed:
            assert read_checkpoint(directory / new)["model"]["0.weight"].eq(2.0).all(), why

        # the next save (a new process in real life) cleans up after the dead writer
        Checkpointer(directory, _model(3.0), keep=1).save(0, 3)
        assert os.listdir(directory) == [checkpoint_name(3)], (why, os.listdir(directory))
