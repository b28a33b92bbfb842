"""Worker processes: started so that none outlives the launcher, stopped as whole trees.

* Each worker leads its own session (so its process group holds its whole tree, and a Ctrl-C
  on the terminal reaches only the launcher, which forwards it).
* Signals the launcher passes on (SIGTERM, SIGINT, SIGUSR1...) go to the worker's main process
  only, as torchrun sends them: the worker decides what its children get (a DataLoader's
  workers and multiprocessing's resource tracker would die of SIGUSR1's default action while
  the worker saves its checkpoint). SIGKILL goes to the whole tree: after the shutdown timeout,
  and to whatever a worker leaves behind once it has exited.
* Each worker asks the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``).
  The kernel sends it when the *thread* that forked exits, so workers are forked from the
  launcher's main thread only.
* A :class:`Guardian` process, forked before anything else, holds a pipe from the launcher and
  SIGKILLs every registered worker group when that pipe closes: the launcher has exited,
  however it exited (SIGKILL included), and the workers' own children go too, which
  parent-death signals alone would leave behind.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from .events import FORWARD_SIGNALS, STOP_SIGNALS
from .output import WorkerOutput

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent(parent_pid: int):
    """A ``preexec_fn``: SIGKILL this child when the launcher dies, even before exec."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved in the parent, not after fork
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill)
        if os.getppid() != parent_pid:  # the launcher died between fork and prctl
            os.kill(os.getpid(), sigkill)

    return preexec


@dataclass
class Worker:
    """One worker process of this node and where its output goes."""

    rank: int
    local_rank: int
    popen: subprocess.Popen
    output: WorkerOutput
    error_file: str  # torch elastic's TORCHELASTIC_ERROR_FILE, written by @record scripts
    exited_at: float | None = None  # time.monotonic() when its exit was first seen

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        code = self.popen.poll()
        if code is not None and self.exited_at is None:
            self.exited_at = time.monotonic()
        return code

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the worker's main process, if it still runs."""
        if self.returncode is None:
            self.popen.send_signal(signum)  # polls again: never a reaped, reusable pid

    def kill_tree(self) -> None:
        """SIGKILL the worker's whole process group: it and every child it left."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the whole group is gone already
            pass


def start_tied(command: list[str], env: dict[str, str] | None = None, pipe_output: bool = True,
               pass_fds: tuple[int, ...] = (), control: bool = False,
               die_with_parent: bool = True) -> subprocess.Popen:
    """Start a child that dies with the launcher: its own session, parent-death SIGKILL
    (unless ``die_with_parent`` is False: it must then end itself when the launcher goes),
    stdin from /dev/null, stdout/stderr piped back (or inherited). ``control``: stdin and
    stdout are pipes to the launcher instead, stderr is inherited."""
    pipe = subprocess.PIPE if pipe_output and not control else None
    return subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.PIPE if control else subprocess.DEVNULL,
        stdout=subprocess.PIPE if control else pipe,
        stderr=pipe,
        start_new_session=True,
        pass_fds=pass_fds,
        preexec_fn=_die_with_parent(os.getpid()) if die_with_parent else None,
    )


def spawn(command: list[str], env: dict[str, str], rank: int, local_rank: int,
          output: WorkerOutput) -> Worker:
    """Start one worker (see :func:`start_tied`)."""
    return Worker(rank, local_rank, start_tied(command, env), output,
                  env["TORCHELASTIC_ERROR_FILE"])


def first_failure(workers: list[Worker]) -> Worker | None:
    """The worker whose non-zero exit (or death by a signal) was seen first: the earliest
    :attr:`Worker.exited_at`, so of workers first seen dead in the same look, the first listed
    (the agent lists them by local rank); ``None`` when none has failed."""
    failed = [w for w in workers if w.returncode not in (None, 0)]
    return min(failed, key=lambda w: w.exited_at, default=None)


def describe_exit(returncode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL"``."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def shell_status(returncode: int) -> int:
    """A worker's status as a shell reports it: the code, or 128 + the signal's number."""
    return 128 - returncode if returncode < 0 else returncode


class Guardian:
    """A small process that SIGKILLs the registered worker process groups once the
    launcher is gone, and removes the launcher's scratch directory. Fork it first, before
    threads or workers exist.

    The launcher writes ``+PGID`` / ``-PGID`` lines to it; end of file means the launcher
    has exited, and every group still registered is killed.
    """

    def __init__(self, scratch: str) -> None:
        read_end, self._write_end = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - runs in the forked child
            os.close(self._write_end)
            _guard(read_end, scratch)
        os.close(read_end)

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def release(self, pgid: int) -> None:
        self._send(f"-{pgid}\n")

    def _send(self, line: str) -> None:
        try:
            os.write(self._write_end, line.encode())
        except OSError:  # the guardian was killed; parent-death signals still cover workers
            pass

    def close(self) -> None:
        """Let the guardian go (it exits at end of file) and reap it."""
        os.close(self._write_end)
        os.waitpid(self.pid, 0)


def _guard(read_end: int, scratch: str) -> None:  # pragma: no cover - forked child
    try:
        for signum in (*STOP_SIGNALS, *FORWARD_SIGNALS):
            signal.signal(signum, signal.SIG_IGN)  # only end of file ends it
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # hold none of the caller's pipes open
            os.dup2(devnull, fd)
        os.closerange(3, read_end)
        os.closerange(read_end + 1, os.sysconf("SC_OPEN_MAX"))
        groups: set[int] = set()
        pending = b""
        while True:
            chunk = os.read(read_end, 4096)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                (groups.add if line[:1] == b"+" else groups.discard)(int(line[1:]))
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(scratch, ignore_errors=True)
    finally:
        os._exit(0)
