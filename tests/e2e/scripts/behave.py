"""A torch-free worker for launcher tests: does what its flags say, records what happened.

Files it writes under --record DIR: ``pid.RANK`` (its pid), ``child.RANK`` (a grandchild's pid),
``env.RANK.json`` (its environment), ``signal.RANK`` (the first signal it got), ``sigterm_at.RANK``
(when an ignored SIGTERM arrived, time.time()), and one line per attempt in ``attempts.log``.
"""

import argparse
import atexit
import json
import os
import signal
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--record", required=True)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--first-sleep", type=float, default=None, help="on attempt 0, sleep this instead")
p.add_argument("--fail-rank", type=int, default=None)
p.add_argument("--fail-after", type=float, default=0.0)
p.add_argument("--only-first-attempt", action="store_true")
p.add_argument("--exit-code", type=int, default=None, help="exit with this code instead of raising")
p.add_argument("--on-sigterm-exit", type=int, default=None,
               help="on SIGTERM/INT/HUP/USR1 exit with this code; with --grandchild, only if the "
                    "grandchild survived the signal (else exit 1 naming what killed it)")
p.add_argument("--ignore-sigterm", type=int, default=None, metavar="RANK")
p.add_argument("--secondary", action="store_true",
               help="on SIGTERM, die of an exception (a secondary error, as a peer's would be)")
p.add_argument("--grandchild", action="store_true", help="start a child sleeping 300 s")
p.add_argument("--progress", action="store_true")
p.add_argument("--exit-noise", action="store_true",
               help="at exit, print an unrelated traceback and warnings to stderr (as "
                    "multiprocessing's resource tracker does)")
p.add_argument("--error-file", action="store_true",
               help="the failing rank writes TORCHELASTIC_ERROR_FILE as torch's @record does")
args = p.parse_args()

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rec = args.record


def write(name, text):
    with open(os.path.join(rec, name), "w") as f:
        f.write(text)


with open(os.path.join(rec, "attempts.log"), "a") as f:
    f.write(f"attempt {attempt} rank {rank}\n")
write(f"env.{rank}.json", json.dumps(dict(os.environ)))
child = None
if args.on_sigterm_exit is not None:
    def _on_term(signum, frame):
        if os.path.exists(os.path.join(rec, f"signal.{rank}")):
            return  # already on its way out: the signal that came first is the one recorded
        write(f"signal.{rank}", signal.Signals(signum).name)
        if child is not None:
            try:  # a signal sent to the whole process group kills it at once
                child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            else:
                sys.exit(f"rank {rank}: my child died of {signal.Signals(-child.returncode).name}")
        sys.exit(args.on_sigterm_exit)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(s, _on_term)
if args.secondary:
    def _secondary(signum, frame):
        raise RuntimeError(f"rank {rank}: secondary error, my peer is gone")
    signal.signal(signal.SIGTERM, _secondary)
if args.ignore_sigterm == rank:
    signal.signal(signal.SIGTERM, lambda *_: write(f"sigterm_at.{rank}", repr(time.time())))
if args.exit_noise:  # what multiprocessing's resource tracker prints when a worker dies
    atexit.register(sys.stderr.write, (
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3/multiprocessing/resource_tracker.py", line 209, in main\n'
        "    cache[rtype].remove(name)\n"
        "KeyError: '/mp-unrelated'\n"
        "/usr/lib/python3/multiprocessing/resource_tracker.py:254: UserWarning: "
        "resource_tracker: There appear to be 1 leaked semaphore objects to clean up at shutdown\n"
        "  warnings.warn('resource_tracker: There appear to be %d '\n"))
if args.grandchild:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    write(f"child.{rank}", str(child.pid))
write(f"pid.{rank}", str(os.getpid()))  # last: its presence means everything above is done
print(f"worker {rank} attempt {attempt} ready", flush=True)
if args.progress and rank == 0:
    for i in range(3):
        sys.stderr.write(f"\rstep {i}/3")
        sys.stderr.flush()
        time.sleep(0.05)
    sys.stderr.write("\n")
failing = rank == args.fail_rank and (attempt == 0 or not args.only_first_attempt)
if failing:
    time.sleep(args.fail_after)
    if args.error_file:
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": "ValueError: recorded", "extraInfo": {
                "py_callstack": "Traceback (most recent call last):\n  File \"x.py\", line 1, "
                                "in main\nValueError: recorded by @record\n",
                "timestamp": str(int(time.time()))}}}, f)
    if args.exit_code is not None:
        sys.exit(args.exit_code)
    raise ValueError(f"boom from rank {rank} on attempt {attempt}")
time.sleep(args.sleep if attempt or args.first_sleep is None else args.first_sleep)
print(f"worker {rank} done", flush=True)
