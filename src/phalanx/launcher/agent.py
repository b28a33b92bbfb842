"""The supervisor: start a round of workers, watch it, stop it, restart or report.

A *round* is one attempt of the whole group. It ends with the first of

* a worker exiting non-zero or killed by a signal (on any node): ``failed``; exit status
  :data:`~phalanx.errors.PREEMPTED_EXIT_CODE` instead means ``preempted`` (resumable);
* a stop signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT) reaching a launcher: ``signal``;
* every worker of every node exiting 0: ``succeeded``.

* on several nodes, node 0 seeing a node leave, or a newcomer waiting for a place, or the
  store's host lost (the next round meets where the store moves, :mod:`.relocate`):
  ``membership``.

The first ending published wins and every node acts on it: workers still running get SIGTERM
(or the signal the launcher received) in their main process, then their whole process trees
SIGKILL after ``shutdown_timeout``. A membership change, or a failure in which nodes were
lost, is followed by a new round on the nodes still there (and any newcomer), at the new world
size, without using a restart. A failed round is followed by a new one while restarts are
left; otherwise the launcher prints a summary naming the node, rank, exit code or signal and
the end of that worker's traceback, and exits with that worker's status.

The failing worker named is the one whose exit the launcher saw first (it looks at every
SIGCHLD; workers found dead in the same look go by local rank). Its traceback is what a script
decorated with torch elastic's ``@record`` wrote to its ``TORCHELASTIC_ERROR_FILE``, or
otherwise the traceback that ended it, found in its stderr (see
:func:`~phalanx.launcher.output.traceback_tail`): no decorator is needed.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import threading
import time

from ..env import DistEnv
from ..errors import PREEMPTED_EXIT_CODE, RendezvousError, UsageError
from .board import LeaderBoard
from .config import STDERR, STDOUT, LaunchConfig
from .console import Console
from .environment import watchdog_note, worker_environ
from .events import FORWARD_SIGNALS, STOP_SIGNALS, Pump, SignalInbox
from .membership import Layout, StoreLost
from .outcome import RoundEnd
from .output import WorkerOutput, read_diagnosis, recorded_error, traceback_tail
from .relocate import MovingBoard
from .rendezvous import Interrupted, meet
from .workers import Guardian, Worker, describe_exit, first_failure, shell_status, spawn

_RULE = "=" * 64


class Agent:
    """Runs the rounds of one node. Built by :func:`launch`; see the module docstring."""

    def __init__(self, config: LaunchConfig, board, store, console: Console,
                 inbox: SignalInbox, guardian: Guardian, scratch: str) -> None:
        self.config, self.board, self.store = config, board, store
        self.console, self.inbox, self.guardian = console, inbox, guardian
        self.layout: Layout | None = None  # this node's place in the current round
        self._pump = Pump(inbox)
        self._scratch = scratch  # torch's per-worker error files; the guardian removes it
        # the file the frames of the worker's own traceback name (a module's: found by its frames)
        self._entry = None if config.module else os.path.abspath(config.entrypoint)
        self._host = socket.gethostname()
        self._log_dir = None

    @property
    def node_rank(self) -> int:
        """This node's rank in the current round (``GROUP_RANK``)."""
        return self.layout.node_rank

    def run(self) -> int:
        """All rounds; returns the launcher's exit status."""
        last, restarts, changed = self.config.max_restarts, 0, True
        while True:
            layout = self.board.next_round(self.layout, restarts)
            if isinstance(layout, RoundEnd):  # the job ended while this node waited for a place
                return self._ended_without_us(layout)
            self._begin(layout, changed)
            restarts, changed = layout.restarts, False
            try:
                record, workers = self._round(layout.round)
            except StoreLost as e:  # its host is lost: the next round meets where it moves
                record, workers = RoundEnd("membership", detail=str(e)), []
            lost = self.board.lost_in(layout.round) if record.kind == "failed" else []
            if record.kind == "membership" or lost:
                why = record.detail or f"{', '.join(lost)} lost ({record.who()} failed)"
                self.console.note(f"{why}: the nodes meet again (no restart used)")
                self._release(record)
                changed = True
                continue
            if not self._restarts(record, restarts):
                status = self._finish(record, workers, restarts)
                self.board.finish(record)
                self._release(record)
                return status
            self.console.note(
                f"attempt {restarts + 1} of {last + 1} failed: {record.cause(_exits(workers))}"
                f"{_last_line(record)}; restarting every worker ({last - restarts} "
                f"{'restart' if last - restarts == 1 else 'restarts'} left)"
            )
            self._release(record)
            restarts += 1

    def _begin(self, layout: Layout, changed: bool) -> None:
        """Take this node's place in a new round; say where when the nodes changed."""
        self.layout = layout
        if self._log_dir is None and self.config.log_dir is not None:
            self._log_dir = _run_log_dir(self.config.log_dir, layout.run_id)
            self.console.note(f"worker logs: {self._log_dir}")
        if self.board.multi and changed:
            self.console.note(
                f"round {layout.round}: {layout.nnodes} node(s) ({', '.join(layout.members)}), "
                f"world size {layout.world_size}; this is node {layout.node_rank}, ranks "
                f"{layout.rank_offset}-{layout.rank_offset + self.config.nproc_per_node - 1}")

    def _ended_without_us(self, record: RoundEnd) -> int:
        """The status of a job that ended while this node waited for a place in it."""
        if record.kind == "lost":
            raise RendezvousError(record.detail)
        self.console.note(f"the job ended ({record.kind}) before this node had a place in it")
        if record.kind in ("succeeded", "preempted"):
            return 0 if record.kind == "succeeded" else PREEMPTED_EXIT_CODE
        return 128 + signal.Signals[record.signal] if record.signal else shell_status(record.returncode)

    def _release(self, record: RoundEnd) -> None:
        """Show what the other workers wrote after the failure (held back by :meth:`_round`)."""
        self.console.release(f"what the other workers wrote after {record.who()} failed:")

    def close(self) -> None:
        self.console.release("what the other workers wrote after the failure:")
        self._pump.close()

    def _restarts(self, record: RoundEnd, restarts: int) -> bool:
        return (record.kind == "failed" and restarts < self.config.max_restarts
                and self.inbox.pending_stop() is None)

    def _round(self, round_: int) -> tuple[RoundEnd, list[Worker]]:
        # Several nodes: node 0 opened the round's store before it published the round.
        workers: list[Worker] = []
        try:
            for local_rank in range(self.config.nproc_per_node):
                workers.append(self._spawn(round_, local_rank))
            if not self.board.multi:
                # The door already listens; the store opens while the workers import torch.
                self.store.open_round()
            try:
                record = self._watch(workers, round_)
            except RendezvousError:  # the other nodes are gone: stop ours gracefully all the same
                self._stop(workers, RoundEnd("lost"))
                raise
            if record.kind == "failed":  # the root cause is reported first, then the rest
                self.board.acknowledge(round_)
                self.console.hold(w.rank for w in workers if w.rank != record.rank)
            self._stop(workers, record)
        finally:
            self._clean_up(workers)
        return record, workers

    def _spawn(self, round_: int, local_rank: int) -> Worker:
        config, layout = self.config, self.layout
        rank = layout.rank_offset + local_rank
        dist_env = DistEnv(
            rank=rank, world_size=layout.world_size, local_rank=local_rank,
            local_world_size=config.nproc_per_node, node_rank=layout.node_rank,
            master_addr=layout.store_host, master_port=layout.store_port,
            restart_count=round_, use_agent_store=True, source="launcher",
        )
        error_dir = os.path.join(self._scratch, f"attempt_{round_}", str(local_rank))
        os.makedirs(error_dir)
        env = worker_environ(
            dist_env, group_world_size=layout.nnodes, max_restarts=config.max_restarts,
            run_id=layout.run_id, error_file=os.path.join(error_dir, "error.json"),
            role=config.role, rank_prefix=config.rank_prefix, watchdog=config.watchdog,
            tune_malloc=config.tune_malloc,
        )
        logs = {}
        if self._log_dir is not None:
            stem = os.path.join(self._log_dir, f"attempt_{round_}", f"rank{rank}")
            logs = {STDOUT: stem + ".stdout.log", STDERR: stem + ".stderr.log"}
        output = WorkerOutput(rank, self.console, config.console_streams(local_rank), logs)
        worker = spawn(config.command, env, rank, local_rank, output)
        self.guardian.watch(worker.pid)
        self._pump.add(worker)
        return worker

    def _watch(self, workers: list[Worker], round_: int) -> RoundEnd:
        interval = self.config.monitor_interval
        reported_done = False
        next_board_look = 0.0
        while True:
            self._pump.wait(interval)
            self.console.flush()  # unfinished lines held long enough (a progress bar)
            for signum in self.inbox.take():
                if signum in STOP_SIGNALS:
                    return self.board.publish_end(round_, RoundEnd(
                        "signal", signal=signal.Signals(signum).name,
                        node=self.node_rank, host=self._host))
                self._forward(workers, signum)
            if self.store is not None:
                self.store.check()
            failed = first_failure(workers)
            if failed is not None:
                return self.board.publish_end(round_, self._exit_record(failed, workers))
            if not reported_done and all(w.returncode == 0 for w in workers):
                self.board.report_done(round_)
                reported_done = True
            if time.monotonic() >= next_board_look:
                next_board_look = time.monotonic() + interval
                record = self.board.end_record(round_)
                if record is not None:
                    return record
                if reported_done and self.board.all_done(round_):
                    return RoundEnd("succeeded")  # first: a node that saw it may be gone already
                change = self.board.membership(round_)
                if change is not None:
                    return self.board.publish_end(round_, change)

    def _exit_record(self, worker: Worker, workers: list[Worker]) -> RoundEnd:
        self._pump.drain([worker])  # its last words may still sit in the pipe
        code = worker.returncode
        recorded = recorded_error(worker.error_file)
        # a hang report blames a rank: the failing worker's own, else one its peers here wrote
        diagnosis = next(filter(None, map(read_diagnosis, [worker.error_file] + [
            w.error_file for w in workers if w is not worker])), None)
        culprits, report = (diagnosis[1], diagnosis[0]) if diagnosis else ([], "")
        return RoundEnd(
            "preempted" if code == PREEMPTED_EXIT_CODE else "failed",
            node=self.node_rank, host=self._host, rank=worker.rank,
            local_rank=worker.local_rank, returncode=code,
            traceback=(traceback_tail(recorded, self._entry) if recorded
                       else worker.output.traceback(self._entry)),
            source="error file (torch elastic @record)" if recorded else "stderr",
            culprits=culprits, report=report,
        )

    def _forward(self, workers: list[Worker], signum: int) -> None:
        """Pass ``signum`` to each running worker's main process (see :mod:`.workers`)."""
        for worker in workers:
            worker.signal(signum)

    def _stop(self, workers: list[Worker], record: RoundEnd) -> None:
        """Signal the running workers, give them ``shutdown_timeout``, then SIGKILL."""
        signum = signal.SIGTERM
        if record.kind == "signal" and record.node == self.node_rank:
            signum = signal.Signals[record.signal]
        self._forward(workers, signum)
        deadline = time.monotonic() + self.config.shutdown_timeout
        while any(w.returncode is None for w in workers):
            left = deadline - time.monotonic()
            if left <= 0:
                for worker in workers:
                    worker.kill_tree()
                break
            self._pump.wait(min(left, self.config.monitor_interval))
            self.console.flush()
            for again in self.inbox.take():  # passed on; the timeout still bounds the wait
                if again in STOP_SIGNALS or again in FORWARD_SIGNALS:
                    self._forward(workers, again)

    def _clean_up(self, workers: list[Worker]) -> None:
        for worker in workers:  # the whole tree, leftovers of clean exits included
            worker.kill_tree()
        for worker in workers:
            worker.popen.wait()
        self._pump.remove(workers)
        self.console.flush(older_than=0.0)  # their last unfinished lines
        for worker in workers:
            worker.output.close()
            self.guardian.release(worker.pid)
        if self.store is not None:
            self.store.close_round()

    def _finish(self, record: RoundEnd, workers: list[Worker], round_: int) -> int:
        self.board.check_out()  # node 0 may be gone by now: fine
        kind = record.kind
        if kind == "succeeded":
            if round_ > 0:
                self.console.note(f"succeeded on attempt {round_ + 1}")
            return 0
        states = ", ".join(f"rank {w.rank}: {describe_exit(w.returncode)}" for w in workers)
        if kind == "preempted":
            self.console.note(
                f"preempted: {record.who()} exited with {PREEMPTED_EXIT_CODE} "
                f"(preempted, resumable; not a failure). Run the same command again to resume. "
                f"Workers on this node: {states}"
            )
            return PREEMPTED_EXIT_CODE
        if kind == "signal":
            codes = [w.returncode for w in workers]
            preempted = PREEMPTED_EXIT_CODE in codes and set(codes) <= {0, PREEMPTED_EXIT_CODE}
            self.console.note(
                f"{record.signal} received by the launcher of node {record.node}: "
                f"stopped every worker. Workers on this node: {states}"
                + (" (preempted, resumable)" if preempted else "")
            )
            return PREEMPTED_EXIT_CODE if preempted else 128 + signal.Signals[record.signal]
        self.console.note(self._failure_summary(record, workers, states, round_))
        return shell_status(record.returncode)

    def _failure_summary(self, record: RoundEnd, workers: list[Worker], states: str,
                         round_: int) -> str:
        """The report of a failed run; the root cause's traceback is in it unless the console
        has shown it already, as the worker printed it (the traceback appears once)."""
        name = self.config.entrypoint
        cause = f"root cause: {record.cause(_exits(workers))}"
        alike = self._alike(record, workers)
        if len(alike) > 1:  # one error raised on several ranks: said once, naming them all
            cause = (f"root cause: {record.who(alike)}, the same error on each: "
                     f"{describe_exit(record.returncode)} from rank {record.rank}, the first to end")
        if record.report:
            trace = [cause, "the hang report:", *("  " + line for line in record.report.splitlines())]
        elif self._shown_live(record, workers):
            trace = [f"{cause}{_last_line(record)}; its traceback is above, as rank "
                     f"{record.rank} printed it"]
        else:
            trace = [cause, f"from rank {record.rank}'s {record.source}:",
                     *("  " + line for line in (record.traceback or "(empty)").splitlines())]
        return "\n".join([
            _RULE,
            f"{name} failed on attempt {round_ + 1} of {self.config.max_restarts + 1}",
            *trace,
            f"workers on node {self.node_rank}: {states}",
            _RULE,
        ])

    def _alike(self, record: RoundEnd, workers: list[Worker]) -> list[tuple[int, int]]:
        """``(rank, local rank)`` of this node's workers whose traceback ends with the root
        cause's exception line, the root cause's worker first (phalanx's checks across ranks
        raise the same error on every rank); none after a hang report or on another node."""
        line = record.exception_line()
        if record.node != self.node_rank or record.culprits or not line:
            return []
        return [(record.rank, record.local_rank)] + [
            (w.rank, w.local_rank) for w in workers
            if w.rank != record.rank and w.output.exception_line(self._entry) == line]

    def _shown_live(self, record: RoundEnd, workers: list[Worker]) -> bool:
        """Whether this node's console showed the end of ``record``'s traceback as the
        worker printed it on stderr."""
        lines = record.traceback.strip().splitlines()
        if record.node != self.node_rank or not lines:
            return False
        worker = next((w for w in workers if w.rank == record.rank), None)
        if worker is None or not worker.output.console_streams & STDERR:
            return False
        return lines[-1].strip() in worker.output.tail.decode("utf-8", errors="replace")


def _run_log_dir(log_dir: str, run_id: str) -> str:
    """A new folder in ``log_dir`` for this run, named after its id (as torchrun's), so a
    second run keeps the first one's logs."""
    os.makedirs(log_dir, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{run_id.replace(os.sep, '_')}_", dir=log_dir)


def _exits(workers: list[Worker]) -> dict[int, int | None]:
    """Each worker's exit status, by rank (``None``: still running)."""
    return {w.rank: w.returncode for w in workers}


def _last_line(record: RoundEnd) -> str:
    line = record.exception_line()
    return f" ({line})" if line else ""


def launch(config: LaunchConfig) -> int:
    """Run ``config`` on this node until it succeeds, fails for good or is stopped.

    Returns:
        The launcher's exit status: 0; the failing worker's exit code (128 + N for signal N);
        :data:`~phalanx.errors.PREEMPTED_EXIT_CODE` when preempted; 128 + N after the launcher
        received stop signal N.

    Raises:
        LaunchConfigError: the master port is in use, or the master address is not this host's.
        RendezvousError: the master or another node could not be reached in time.
        UsageError: called on another thread than the main one (a ``RuntimeError`` too).
    """
    if threading.current_thread() is not threading.main_thread():
        raise UsageError(
            "launch() must run on the main thread: it handles signals, and the workers' "
            "parent-death signal is tied to the thread that forks them; it was called on thread "
            f"{threading.current_thread().name!r}"
        )
    console = Console(sys.stdout.buffer, sys.stderr.buffer, rank_prefix=config.rank_prefix)
    if config.watchdog is not None:  # once, before any worker: torch-made groups ignore it
        console.note(watchdog_note(config.watchdog))
    scratch = tempfile.mkdtemp(prefix="phalanx-")
    guardian = Guardian(scratch)  # first, while this process has no threads and no workers
    try:
        with SignalInbox() as inbox:
            return _meet_and_run(config, console, inbox, guardian, scratch)
    finally:
        guardian.close()


def _meet_and_run(config: LaunchConfig, console: Console, inbox: SignalInbox,
                  guardian: Guardian, scratch: str) -> int:
    store = board = agent = None
    try:
        board, store = meet(config, config.nproc_per_node, inbox.pending_stop, guardian,
                            console.note)
        agent = Agent(config, board, store, console, inbox, guardian, scratch)
        board.start()
        return agent.run()
    except Interrupted as e:
        console.note(f"{signal.Signals(e.signum).name} received while waiting for the other nodes")
        return 128 + e.signum
    finally:
        if board is not None:
            _leave(board, store)
        for part in (agent, board, store):
            if part is not None:
                part.close()


def _leave(board, store) -> None:
    """Check out; node 0's store stays up (bounded) until the others have too, so that they
    learn how the job ended even once this launcher is gone."""
    board.check_out()
    if isinstance(board, MovingBoard):
        board = board.current
    if isinstance(board, LeaderBoard):
        try:
            store.linger(board.awaited_check_outs())
        except RendezvousError:  # its own store helper is gone: nobody to wait for
            pass
