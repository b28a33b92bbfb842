"""phalanx run supervising real worker processes: failures, restarts, signals, orphans, logs.

The workers here (tests/e2e/scripts/behave.py) do not import torch, so each launch takes a
fraction of a second; the launcher is the thing under test. A worker's failure, a restart and
a SIGKILLed launcher stay in the fast tier (`pytest -m "not slow"`); the rest is marked slow.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import psutil
import pytest

from phalanx.errors import PREEMPTED_EXIT_CODE
from tests.e2e.launch_helpers import (
    BEHAVE,
    ROOT,
    SCRIPTS,
    alive,
    base_env,
    finish,
    phalanx_cmd,
    run,
    start,
    wait_all_gone,
    wait_for_files,
)


def _launch(tmp_path, *worker_args, opts=("--standalone", "--nproc-per-node", "2")):
    return phalanx_cmd(*opts, BEHAVE, "--record", str(tmp_path), *worker_args)


def _attempts(tmp_path) -> list[str]:
    return sorted((tmp_path / "attempts.log").read_text().splitlines())


def test_worker_failure_stops_the_others_and_reports_the_root_cause(tmp_path):
    # rank 0 would sleep 60 s; rank 1 raises after 1 s (rank 0 has started by then, even on a
    # loaded machine). Rank 0 must be stopped (SIGTERM) well within the 10 s shutdown timeout,
    # and the launcher must exit 1, naming rank 1 and its exception, though an unrelated
    # traceback and warnings follow it on rank 1's stderr. Rank 0 dies of SIGTERM with a
    # traceback of its own, a secondary error: it is shown after the report.
    res = run(_launch(tmp_path, "--sleep", "60", "--fail-rank", "1", "--fail-after", "1",
                      "--exit-noise", "--secondary",
                      opts=("--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "10")))
    assert res.code == 1, res.err
    assert res.seconds < 10, res.seconds
    # the root cause's traceback once: as rank 1 printed it, before the report
    assert res.err.count('raise ValueError(f"boom') == 1
    assert res.err.count("[rank1]: ValueError: boom from rank 1 on attempt 0") == 1
    live = res.err.index("[rank1]: ValueError: boom from rank 1 on attempt 0")
    assert live < res.err.index("[phalanx] ====")
    summary = res.err[res.err.index("[phalanx] ===="):].splitlines()
    assert summary[2].startswith("[phalanx] root cause: rank 1 (local rank 1) on node 0"), summary
    assert summary[2].endswith(": exit code 1 (ValueError: boom from rank 1 on attempt 0); its "
                               "traceback is above, as rank 1 printed it"), summary
    assert summary[3].startswith("[phalanx] workers on node 0: rank 0: exit code 1"), summary
    # then the secondary error, under a heading of its own
    assert summary[5].startswith("[phalanx] what the other workers wrote after rank 1"), summary
    assert "[rank0]: RuntimeError: rank 0: secondary error, my peer is gone" in summary[6:]
    assert "secondary error" not in res.err[:res.err.index("[phalanx] ====")]
    assert "[rank0]: worker 0 attempt 0 ready" in res.out
    assert "[rank1]: worker 1 attempt 0 ready" in res.out
    assert not alive(int((tmp_path / "pid.0").read_text()))


def test_restart_after_a_first_attempt_failure_succeeds(tmp_path):
    res = run(_launch(tmp_path, "--fail-rank", "1", "--only-first-attempt", "--exit-code", "4",
                      opts=("--standalone", "--nproc-per-node", "2", "--max-restarts", "2")))
    assert res.code == 0, res.err
    # (rank 1 may fail before rank 0 of attempt 0 has even started and noted its attempt)
    attempts = set(_attempts(tmp_path))
    assert {"attempt 0 rank 1", "attempt 1 rank 0", "attempt 1 rank 1"} <= attempts
    assert attempts <= {"attempt 0 rank 0", "attempt 0 rank 1", "attempt 1 rank 0",
                        "attempt 1 rank 1"}
    assert "attempt 1 of 3 failed: rank 1 (local rank 1) on node 0" in res.err
    assert "exit code 4; restarting every worker (2 restarts left)" in res.err
    assert "succeeded on attempt 2" in res.err


@pytest.mark.slow
def test_a_worker_that_always_fails_gets_exactly_three_attempts(tmp_path):
    # It writes torch elastic's error file, as a script decorated with @record does: the
    # launcher shows that file's traceback.
    res = run(_launch(tmp_path, "--fail-rank", "0", "--exit-code", "7", "--error-file",
                      opts=("--standalone", "--nproc-per-node", "2", "--max-restarts", "2")))
    assert res.code == 7, res.err
    ranks0 = [line for line in _attempts(tmp_path) if line.endswith("rank 0")]
    assert ranks0 == ["attempt 0 rank 0", "attempt 1 rank 0", "attempt 2 rank 0"]
    assert res.err.count("restarting every worker") == 2
    assert "exit code 7 (ValueError: recorded by @record); restarting" in res.err
    assert "failed on attempt 3 of 3" in res.err
    assert "root cause: rank 0 (local rank 0) on node 0" in res.err
    assert ("[phalanx] from rank 0's error file (torch elastic @record):\n"
            "[phalanx]   Traceback (most recent call last):\n"
            '[phalanx]     File "x.py", line 1, in main\n'
            "[phalanx]   ValueError: recorded by @record\n") in res.err


@pytest.mark.slow
def test_a_preempted_worker_is_reported_as_resumable_and_not_restarted(tmp_path):
    res = run(_launch(tmp_path, "--sleep", "60", "--fail-rank", "1",
                      "--exit-code", str(PREEMPTED_EXIT_CODE),
                      opts=("--standalone", "--nproc-per-node", "2", "--max-restarts", "2")))
    assert res.code == PREEMPTED_EXIT_CODE, res.err
    # one attempt, no restart (rank 0 may be stopped before it notes its attempt)
    attempts = _attempts(tmp_path)
    assert "attempt 0 rank 1" in attempts
    assert not [line for line in attempts if not line.startswith("attempt 0 ")], attempts
    assert "preempted, resumable; not a failure" in res.err
    assert "failed" not in res.err


def _start_and_wait(tmp_path, *worker_args, opts):
    began = time.monotonic()
    proc = start(_launch(tmp_path, *worker_args, opts=opts))
    wait_for_files([tmp_path / "pid.0", tmp_path / "pid.1"])
    return proc, began


def _children(tmp_path) -> list[int]:
    return [int((tmp_path / f"child.{r}").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_sigterm_to_the_launcher_is_forwarded_and_preemption_reported(tmp_path):
    # The workers catch SIGTERM and exit 75, as phalanx's preemption handler makes them do,
    # after checking that the child each started (a DataLoader worker, say) is still alive:
    # the signal goes to a worker's main process, not to its whole process group.
    proc, _ = _start_and_wait(tmp_path, "--sleep", "60", "--grandchild", "--on-sigterm-exit",
                              str(PREEMPTED_EXIT_CODE),
                              opts=("--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "5"))
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    res = finish(proc, began=sent)
    assert res.seconds < 5, res.seconds
    assert res.code == PREEMPTED_EXIT_CODE, res.err
    assert [(tmp_path / f"signal.{r}").read_text() for r in (0, 1)] == ["SIGTERM", "SIGTERM"]
    assert "SIGTERM received by the launcher of node 0" in res.err
    assert "(preempted, resumable)" in res.err
    assert not wait_all_gone(_children(tmp_path), timeout=5)  # the leftovers killed after


@pytest.mark.slow
def test_sigusr1_is_only_forwarded_and_the_preempted_exit_reported(tmp_path):
    # Slurm's --signal announces preemption with SIGUSR1: the launcher passes it on to each
    # worker's main process and keeps watching; the workers, whose children must not die of
    # it, save and exit 75 on their own.
    proc, _ = _start_and_wait(tmp_path, "--sleep", "60", "--grandchild", "--on-sigterm-exit",
                              str(PREEMPTED_EXIT_CODE), opts=("--standalone", "--nproc-per-node", "2"))
    proc.send_signal(signal.SIGUSR1)
    res = finish(proc, timeout=30)
    assert res.code == PREEMPTED_EXIT_CODE, res.err
    assert [(tmp_path / f"signal.{r}").read_text() for r in (0, 1)] == ["SIGUSR1", "SIGUSR1"]
    assert "exited with 75 (preempted, resumable; not a failure)" in res.err
    assert not wait_all_gone(_children(tmp_path), timeout=5)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM])
def test_stop_signals_end_every_worker_within_the_shutdown_timeout(tmp_path, signum):
    proc, _ = _start_and_wait(tmp_path, "--sleep", "60",
                              opts=("--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "5"))
    workers = [int((tmp_path / f"pid.{r}").read_text()) for r in (0, 1)]
    sent = time.monotonic()
    proc.send_signal(signum)
    res = finish(proc, began=sent)
    assert res.seconds < 5, res.seconds
    assert res.code == 128 + signum, res.err
    assert not [pid for pid in workers if alive(pid)]
    assert f"signal {signum.name}" in res.err  # each worker died of the forwarded signal


@pytest.mark.slow
def test_a_worker_ignoring_sigterm_is_killed_after_the_configured_timeout(tmp_path):
    timeout = 2.0
    proc, _ = _start_and_wait(tmp_path, "--sleep", "60", "--ignore-sigterm", "0", "--grandchild",
                              "--fail-rank", "1", "--fail-after", "0.5",
                              opts=("--standalone", "--nproc-per-node", "2",
                                    "--shutdown-timeout", str(timeout)))
    res = finish(proc)
    ended = time.time()
    assert res.code == 1, res.err
    assert "rank 0: signal SIGKILL" in res.err
    # Not before the timeout: rank 1 failed at least 0.5 s after writing its pid file, and the
    # launcher's SIGTERM came after that.
    assert ended - (os.stat(tmp_path / "pid.1").st_mtime + 0.5) >= timeout
    # Not much after it, counted from the SIGTERM's arrival at rank 0 (which notes the time):
    # the 8 s margin absorbs a loaded machine, far below the 30 s default a launcher ignoring
    # --shutdown-timeout would wait.
    assert ended - float((tmp_path / "sigterm_at.0").read_text()) < timeout + 8
    assert not wait_all_gone(_children(tmp_path), timeout=5)  # SIGKILL took its whole tree


def test_no_worker_outlives_a_sigkilled_launcher(tmp_path):
    # torchrun leaves its workers running here; phalanx's get a parent-death SIGKILL, and the
    # guardian kills their whole process groups, grandchildren included.
    proc, _ = _start_and_wait(tmp_path, "--sleep", "300", "--grandchild",
                              opts=("--standalone", "--nproc-per-node", "2"))
    tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    pids = {name: int((tmp_path / f"{name}.{r}").read_text())
            for name in ("pid", "child") for r in (0, 1)}
    assert set(pids.values()) <= set(tree)
    scratch = os.path.dirname(json.loads((tmp_path / "env.0.json").read_text())[
        "TORCHELASTIC_ERROR_FILE"]).split("/attempt_")[0]
    assert os.path.isdir(scratch)
    proc.kill()
    proc.communicate()
    left = wait_all_gone(tree, timeout=5)
    assert not left, [psutil.Process(p).cmdline() for p in left if alive(p)]
    assert not os.path.exists(scratch)  # the launcher's scratch directory went with it


@pytest.mark.slow
def test_log_dir_files_redirects_and_filters_per_rank(tmp_path):
    logs = tmp_path / "logs"
    opts = ("--standalone", "--nproc-per-node", "2", "--log-dir", str(logs), "--rdzv-id", "job")
    res = run(_launch(tmp_path, "--progress", "--fail-rank", "1", "--fail-after", "1",
                      opts=(*opts, "--redirects", "1:3")))
    assert res.code == 1
    [first] = logs.glob("job_*")
    assert f"[phalanx] worker logs: {first}" in res.err
    out0 = (first / "attempt_0" / "rank0.stdout.log").read_text()
    err0 = (first / "attempt_0" / "rank0.stderr.log").read_bytes()
    err1 = (first / "attempt_0" / "rank1.stderr.log").read_text()
    assert out0.startswith("worker 0 attempt 0 ready")
    assert err0.startswith(b"\rstep 0/3\rstep 1/3\rstep 2/3\n")  # raw, unprefixed
    assert "ValueError: boom from rank 1" in err1
    # console: rank 1 redirected to its files only; off a terminal, the progress bar's last
    # state only
    assert "[rank1]:" not in res.out + res.err
    assert "[rank0]: step 2/3\n" in res.err and "step 1/3" not in res.err
    # the report shows rank 1's traceback, which the console did not
    assert "[phalanx]   ValueError: boom from rank 1 on attempt 0" in res.err
    # a second run keeps the first one's logs; no prefix, and rank 1 filtered off the console
    again = run(_launch(tmp_path, opts=(*opts, "--no-rank-prefix", "--local-ranks-filter", "1")))
    assert again.code == 0, again.err
    [second] = set(logs.glob("job_*")) - {first}
    assert (second / "attempt_0" / "rank1.stdout.log").read_text().endswith("worker 1 done\n")
    assert (first / "attempt_0" / "rank0.stdout.log").read_text() == out0
    assert again.out.splitlines() == ["worker 1 attempt 0 ready", "worker 1 done"]


def test_watchdog_says_once_at_start_that_a_torch_made_group_keeps_torchs_timeout(tmp_path):
    # torch reads its default timeout from no variable: a script that keeps
    # torch.distributed.init_process_group never sees --watchdog, and the launcher says so
    res = run(phalanx_cmd("--standalone", "--nproc-per-node", "2", "--watchdog", "10",
                          BEHAVE, "--record", str(tmp_path)))
    assert res.code == 0, res.err
    note = ("[phalanx] --watchdog 10 is the timeout of the process groups that "
            "phalanx.init_process_group makes. A script that calls "
            "torch.distributed.init_process_group keeps torch's (30 min; 10 with NCCL), which no "
            "launcher can change: pass it timeout=datetime.timedelta(seconds=10), or call "
            "phalanx.init_process_group")
    assert res.err.splitlines()[0] == note and res.err.count("--watchdog") == 1, res.err
    quiet = run(phalanx_cmd("--standalone", BEHAVE, "--record", str(tmp_path)))
    assert quiet.code == 0 and "--watchdog" not in quiet.err, quiet.err


@pytest.mark.slow
def test_a_hang_names_the_late_rank_as_the_root_cause():
    res = run(phalanx_cmd("--standalone", "--nproc-per-node", "2", "--watchdog", "5",
                          "--shutdown-timeout", "5", str(SCRIPTS / "hang.py")), timeout=60)
    assert res.code == 1, res.err
    assert res.seconds < 30, res.seconds  # the 5 s limit, the report, the shutdown
    # rank 1 with its own exit status (interrupted by the report, or stopped by the launcher)
    assert re.search(r"root cause: rank 1 \((exit code|signal) \w+\), named by the hang report",
                     res.err), res.err
    assert "the hang report:" in res.err
    assert "Late: rank 1 never reached it" in res.err
    assert "hang.py:12 in <module>; in #2 check before barrier (hang.py:12)" in res.err
    assert "rank 1 (" in res.err and "at hang.py:14 in <module>; never reached #2" in res.err


def test_one_error_raised_on_every_rank_is_said_once_in_the_summary_naming_them_all():
    # issue 25 item 6: both ranks raise the same long UnusedParametersError (24 parameters,
    # folded to 6 names and a count); the line is shown in the traceback of the rank that
    # printed it first (the other's points to it) and once in the summary, for ranks 0 and 1
    # together, with the fix in it
    res = run(phalanx_cmd("--standalone", "--nproc-per-node", "2",
                          str(SCRIPTS / "unused_parameters.py")), timeout=120)
    assert res.code == 1, res.err
    line = ("phalanx.errors.UnusedParametersError: Parameters received no gradient in this "
            "backward pass while find_unused_parameters=False (ranks 0, 1: "
            "'unused_blocks.11.bias', 'unused_blocks.11.weight', 'unused_blocks.10.bias', "
            "'unused_blocks.10.weight', 'unused_blocks.9.bias', 'unused_blocks.9.weight' and 18 "
            "more). Pass find_unused_parameters=True to DistributedDataParallel, or make every "
            "parameter take part in the loss (or freeze it with requires_grad=False)")
    summary = res.err[res.err.index("[phalanx] ===="):]
    assert res.err.count(line) == 2, res.err  # one rank's traceback, the summary
    shown = 0 if f"[rank0]: {line}" in res.err else 1
    assert res.err.count(f"[rank{1 - shown}]: (the same 453-character line as rank {shown}'s "
                         "above)") == 1, res.err
    [cause] = [row for row in summary.splitlines() if "root cause" in row]
    assert cause.startswith("[phalanx] root cause: ranks 0, 1 (local ranks 0, 1) on node 0 ("), cause
    first = 0 if "exit code 1 from rank 0, the first to end" in cause else 1
    assert cause.endswith(f"), the same error on each: exit code 1 from rank {first}, the first "
                          f"to end ({line}); its traceback is above, as rank {first} printed it")


def test_a_quick_run_ends_without_waiting_for_the_store_helpers_torch_import(tmp_path):
    # issue 25 item 10: the store helper imports torch (a second or two) to open the round's
    # store; workers that are done sooner, without a store (a finished run saying so), must
    # not wait for it. Here its torch takes 60 s to import: the launcher ends all the same.
    slow = tmp_path / "slow_torch" / "torch"
    slow.mkdir(parents=True)
    (slow / "__init__.py").write_text("import time\ntime.sleep(60)\n")
    env = base_env(PYTHONPATH=os.pathsep.join([str(slow.parent), str(ROOT / "src")]))
    res = run(_launch(tmp_path), env=env, timeout=90)
    assert res.code == 0, res.err
    # measured 0.3 s; 10 s leaves room for a loaded machine, far below the 60 s import
    assert res.seconds < 10, res.seconds
    assert res.err == "", res.err


@pytest.mark.slow
def test_a_rank_out_of_batches_is_named_with_the_fix_and_each_rank_with_its_exit_code():
    # issue 34 item 5: rank 1 ran out of batches and exited 0 while rank 0 waited for it in a
    # DDP step. The report names that cause (not only "a rank left"), and the summary gives
    # each rank its own exit code (it said rank 1 ended with exit code 1, rank 0's).
    res = run(phalanx_cmd("--standalone", "--nproc-per-node", "2", str(SCRIPTS / "uneven.py")),
              timeout=90)
    assert res.code == 1, res.err
    assert ("Rank 1 ended with no error while rank 0 still had collectives to do: the ranks ran "
            "different numbers of steps. A rank that runs out of batches") in res.err, res.err
    assert "DistributedSampler(drop_last=True)" in res.err and "phalanx.join" in res.err
    assert ("root cause: rank 1 (exit code 0), named by the hang report (rank 0 (local rank 0) "
            "on node 0") in res.err and "stopped waiting for it: exit code 1)" in res.err, res.err
    assert "workers on node 0: rank 0: exit code 1, rank 1: exit code 0" in res.err


@pytest.mark.slow
def test_ctrl_c_says_one_line_and_no_traceback_goes_through_phalanx(tmp_path):
    # issue 34 item 7: SIGINT to the launcher's process group, as a terminal sends it, while
    # the workers train. Each worker's KeyboardInterrupt traceback shows the script's frames
    # and torch's (as under torchrun), not phalanx's; no "collectives still under way" line at
    # exit; the launcher says one line and prints no traceback of its own.
    proc = start(phalanx_cmd("--standalone", "--nproc-per-node", "2",
                             str(SCRIPTS / "train_until_stopped.py"), str(tmp_path)),
                 start_new_session=True)
    wait_for_files([tmp_path / "ready.0", tmp_path / "ready.1"], timeout=90)
    os.killpg(proc.pid, signal.SIGINT)
    res = finish(proc, timeout=60)
    assert res.code == 130, res.err
    tracebacks = [line for line in res.err.splitlines() if "Traceback" in line]
    assert len(tracebacks) == 2 and all(t.startswith("[rank") for t in tracebacks), res.err
    assert res.err.count("KeyboardInterrupt") == 2, res.err
    assert "train_until_stopped.py" in res.err, res.err
    assert str(ROOT / "src" / "phalanx") not in res.err, res.err  # no frame of phalanx's
    assert "still under way" not in res.err, res.err
    launcher = [line for line in res.err.splitlines() if line.startswith("[phalanx]")]
    assert len(launcher) == 1, res.err
    assert "SIGINT received by the launcher of node 0: stopped every worker" in launcher[0]
