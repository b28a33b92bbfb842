"""A torch-free worker for launcher tests: does what its flags say, records what happened.

Files it writes under --record DIR: ``pid.RANK`` (its pid), ``child.RANK`` (a grandchild's pid),
``env.RANK.json`` (its environment), ``signal.RANK`` (the signal it got), and one line per
attempt in ``attempts.log``.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--record", required=True)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--fail-rank", type=int, default=None)
p.add_argument("--fail-after", type=float, default=0.0)
p.add_argument("--only-first-attempt", action="store_true")
p.add_argument("--exit-code", type=int, default=None, help="exit with this code instead of raising")
p.add_argument("--on-sigterm-exit", type=int, default=None)
p.add_argument("--ignore-sigterm", type=int, default=None, metavar="RANK")
p.add_argument("--grandchild", action="store_true")
p.add_argument("--progress", action="store_true")
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
if args.on_sigterm_exit is not None:
    def _on_term(signum, frame):
        write(f"signal.{rank}", signal.Signals(signum).name)
        sys.exit(args.on_sigterm_exit)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(s, _on_term)
if args.ignore_sigterm == rank:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
    if args.exit_code is not None:
        sys.exit(args.exit_code)
    raise ValueError(f"boom from rank {rank} on attempt {attempt}")
time.sleep(args.sleep)
print(f"worker {rank} done", flush=True)
