"""Checkpointer(format="sharded"): a rank SIGKILLed during a blocking or a background save,
in a one-process job and in a two-rank one, at 18 points. Whatever the point, the previous
checkpoint stays byte-identical, no partial checkpoint is visible under a final name, the
newest complete one resumes, and the next save removes what the dead writer left.
(The launcher killed mid-save: tests/e2e/test_checkpoint_kill_launcher.py.)
"""

import os
import signal

import pytest
import torch

from phalanx.checkpoint import Checkpointer, dcp_checkpoint, dcp_engine, dcp_layout
from tests.harness import RankError, run_ranks

# What a directory holds after the kill (keep=1): "previous" (the new checkpoint was never
# renamed into place), "both" (renamed, the previous not yet pruned), "new" (renamed and the
# previous pruned), None (any of these: the survivor may or may not have committed).
# Where a one-process job is SIGKILLed during its second save, and what it leaves:
_KILL_POINTS = {
    "mid-write": "previous", "before-manifest": "previous", "before-rename": "previous",
    "after-rename": "both", "mid-prune": "new", "async-mid-write": "previous",
    "async-before-rename": "previous",
}

# Where one rank of a two-rank job is SIGKILLed during the job's second save: point ->
# (the rank killed, what it leaves).
_GROUP_POINTS = {
    "r1-mid-write": (1, "previous"), "r0-mid-write": (0, "previous"),
    "r1-before-report": (1, "previous"), "r0-before-manifest": (0, "previous"),
    "r0-before-rename": (0, "previous"), "r0-after-rename": (0, "both"),
    "r1-awaiting-outcome": (1, None), "r1-async-staging": (1, "previous"),
    "r1-async-mid-write": (1, "previous"), "r0-async-mid-write": (0, "previous"),
    "r0-async-before-rename": (0, "previous"),
}


def _die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _die_on_second_call(fn):
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return _die() if len(calls) == 2 else fn(*args, **kwargs)
    return wrapper


def _intercept(point):
    if point.endswith("mid-write"):
        dcp_engine.ChecksummingWriter.write = _die
    elif point.endswith("before-report"):  # its file written and fsynced, not yet reported
        write = dcp_engine.ChecksummingWriter.write
        dcp_engine.ChecksummingWriter.write = lambda *args: write(*args) and _die()
    elif point.endswith("before-manifest"):
        dcp_checkpoint.write_manifest = _die
    elif point.endswith("before-rename"):
        dcp_checkpoint.commit = _die
    elif point.endswith("after-rename"):
        rename = os.rename
        os.rename = lambda a, b: rename(a, b) or (str(b).endswith(".dcp") and _die())
    elif point.endswith("mid-prune"):
        dcp_layout.shutil.rmtree = _die
    elif point.endswith("staging"):  # the copy of the parameters, on the writer's thread
        dcp_engine.DeferredStaging.finish = _die
    elif point.endswith("awaiting-outcome"):  # reported, waiting for rank 0's commit
        dcp_checkpoint.broadcast_from_writer = _die_on_second_call(dcp_checkpoint.broadcast_from_writer)
    else:
        raise ValueError(point)


def _linear(fill):
    model = torch.nn.Linear(64, 32)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    return model


def _save(directory, point):
    ckpt = Checkpointer(directory, _linear(2.0), format="sharded", keep=1)
    ckpt.save(0, 2, blocking="async" not in point)
    ckpt.close()
    return f"{point}: still alive after the save"


def _save_and_die(rank, _world_size, directories):
    point = list(_KILL_POINTS)[rank]
    _intercept(point)
    return _save(directories[rank], point)


def _save_and_die_in_group(rank, _world_size, directory, point):
    if rank == _GROUP_POINTS[point][0]:
        _intercept(point)
    return _save(directory, point)


def _files(path):
    return {n: (path / n).read_bytes() for n in os.listdir(path)}


def _previous(directory):
    return _files(Checkpointer(directory, _linear(1.0), format="sharded").save(0, 1))


def _check(point, directory, before, leaves):
    """The directory after the kill: the previous checkpoint untouched, nothing partial under
    a final name, the newest resumes; then the next save tidies up."""
    previous, new = dcp_layout.sharded_name(1), dcp_layout.sharded_name(2)
    expected = {"previous": [previous], "both": [previous, new], "new": [new]}
    names = os.listdir(directory)
    finals = sorted(n for n in names if ".tmp-" not in n)
    assert len(names) - len(finals) <= 1, (point, names)  # the dead writer's (or prune's) temporary
    assert finals in (list(expected.values()) if leaves is None else [expected[leaves]]), (point, names)
    if previous in finals:
        assert _files(directory / previous) == before, point
    model = _linear(0.0)
    state = Checkpointer(directory, model, format="sharded").load()
    renamed = new in finals
    assert state.step == (2 if renamed else 1), point
    assert model.weight.eq(2.0 if renamed else 1.0).all(), point
    # the next save (a new process in real life) removes the dead writer's temporary
    Checkpointer(directory, _linear(3.0), format="sharded", keep=1).save(0, 3)
    assert os.listdir(directory) == [dcp_layout.sharded_name(3)], (point, os.listdir(directory))


@pytest.mark.slow
def test_kill_during_save_at_every_point(tmp_path):
    directories = [tmp_path / point for point in _KILL_POINTS]
    before = {directory: _previous(directory) for directory in directories}
    results = run_ranks(_save_and_die, len(directories), directories, init=False, return_exceptions=True)
    for (point, leaves), directory, result in zip(_KILL_POINTS.items(), directories, results):
        assert isinstance(result, RankError) and "exit code -9" in result.message, (point, result)
        assert not [n for n in os.listdir(directory) if ".tmp-" in n and point == "after-rename"]
        _check(point, directory, before[directory], leaves)


@pytest.mark.slow
@pytest.mark.parametrize("point", list(_GROUP_POINTS))
def test_kill_one_rank_of_two_during_save(tmp_path, point):
    victim, leaves = _GROUP_POINTS[point]
    before = _previous(tmp_path)
    results = run_ranks(_save_and_die_in_group, 2, tmp_path, point, timeout=60, return_exceptions=True)
    assert isinstance(results[victim], RankError) and "exit code -9" in results[victim].message, results
    # the survivor learns it (a collective with a dead peer fails), or finds the save committed
    survivor = results[1 - victim]
    assert isinstance(survivor, RankError) or leaves != "previous", (point, survivor)
    _check(point, tmp_path, before, leaves)
