"""``phalanx run`` SIGKILLed while its job writes a sharded checkpoint (blocking, or in the
background): its workers die with it (PR_SET_PDEATHSIG); the previous checkpoint stays
byte-identical, no partial one is visible, resuming loads the previous one, and the next save
removes the temporary left behind."""

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import phalanx
from phalanx.checkpoint import dcp_layout
from tests.e2e.launch_helpers import base_env

pytestmark = pytest.mark.slow  # launches a job per point

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ckpt_kill_launcher.py"


def _files(path):
    return {n: (path / n).read_bytes() for n in os.listdir(path)}


def _unlocked(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _holders(path):
    """The processes with ``path`` open (for the failure message)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            fds = os.listdir(f"/proc/{proc.pid}/fd")
            if any(os.readlink(f"/proc/{proc.pid}/fd/{fd}") == str(path) for fd in fds):
                found.append((proc.pid, proc.info["cmdline"]))
        except OSError:
            continue
    return found


def _wait_for(condition, seconds, why):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(why())
        time.sleep(0.05)


@pytest.mark.parametrize("point", ["mid-write", "before-rename", "async-mid-write"])
def test_launcher_killed_during_save(tmp_path, point):
    directory = tmp_path / "ckpts"
    paused = Path(f"{directory}.paused")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "run", "--standalone", "--nproc-per-node", "2",
         str(SCRIPT), str(directory), point],
        env=base_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: paused.exists() or launcher.poll() is not None, 120, lambda: "never paused")
        assert launcher.poll() is None, launcher.communicate()[0]
        workers = psutil.Process(launcher.pid).children(recursive=True)
        previous = directory / dcp_layout.sharded_name(1)
        before = _files(previous)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(30)
        _wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers),
                  30, lambda: f"workers outlived the launcher: {workers}")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    names = os.listdir(directory)
    assert [n for n in names if ".tmp-" not in n] == [previous.name], names
    assert len(names) == 2, names  # and the temporary of the save that never finished
    # the dead writer's lock is free (seen once held a moment after the workers were reaped)
    temp = directory / next(n for n in names if ".tmp-" in n)
    _wait_for(lambda: _unlocked(temp), 10, lambda: f"{temp} still locked: {_holders(temp)}")
    assert _files(previous) == before
    state = phalanx.Checkpointer(directory, torch.nn.Linear(64, 32)).load()
    assert (state.step, state.world_size) == (1, 2)
    phalanx.Checkpointer(directory, torch.nn.Linear(64, 32), format="sharded", keep=1).save(0, 3)
    assert os.listdir(directory) == [dcp_layout.sharded_name(3)]
