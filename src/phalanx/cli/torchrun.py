"""torchrun's options that are not phalanx's own: mapped onto phalanx's, or refused with what
phalanx does instead, so a command copied from torchrun never meets argparse's bare
"unrecognized arguments".

Every option of torchrun 2.13 (``torch/distributed/run.py``) is either one of ``phalanx run``'s
own (``--nproc-per-node``, ``--nnodes``, ``--node-rank``, ``--master-addr``...), added here
with torchrun's meaning, or refused here by name.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from ..errors import LaunchConfigError

# torchrun's c10d rendezvous listens on this port when --rdzv-endpoint names none
# (torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py, DEFAULT_PORT).
C10D_DEFAULT_PORT = 29400
# The signals phalanx run handles, whatever --signals-to-handle says (launcher/events.py):
# the first four stop the workers, the last two are forwarded to them.
_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
# torchrun's --start-method choices (torch/distributed/run.py).
START_METHODS = ("spawn", "fork", "forkserver")
# --rdzv-conf keys phalanx understands: the first two mean "how long to wait for the other
# nodes" (--rdzv-timeout); last_call_timeout is torchrun's elastic last call.
_TIMEOUT_KEYS = ("join_timeout", "timeout")
_LAST_CALL_KEY = "last_call_timeout"

# torchrun options phalanx refuses, with what it does instead (option names, nargs, message).
_REFUSED: tuple[tuple[tuple[str, ...], int | None, str], ...] = (
    (("--local-addr", "--local_addr"), None,
     "phalanx needs no address of the local node: node 0 hosts the stores on --master-addr's "
     "interface and the other nodes connect there; drop it"),
    (("--logs-specs", "--logs_specs"), None,
     "phalanx's log layout is fixed: --log-dir D writes D/<run id>_*/attempt_K/rankN.stdout.log "
     "and .stderr.log"),
    (("--duplicate-stdout-filters", "--duplicate_stdout_filters",
      "--duplicate-stderr-filters", "--duplicate_stderr_filters"), None,
     "phalanx does not copy matching lines to another file; with --log-dir every line is in "
     "the rank's log files, to grep"),
    (("--numa-binding", "--numa_binding"), None,
     "phalanx does not bind workers to NUMA nodes; start them through numactl instead: "
     "phalanx run --no-python numactl --cpunodebind=0 python train.py"),
    (("--virtual-local-rank", "--virtual_local_rank"), 0,
     "phalanx gives each worker its own LOCAL_RANK and pins it to cuda:LOCAL_RANK; to show each "
     "worker only its GPU, set CUDA_VISIBLE_DEVICES in a wrapper started with --no-python"),
)


def refusal(option: str) -> str:
    """What phalanx says of torchrun's option ``option`` (``"--local-addr"``), which it refuses."""
    return next(message for names, _, message in _REFUSED if option in names)


def _refusal(message: str) -> type[argparse.Action]:
    class Refused(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"torchrun's {option_string} is not supported: {message}")

    return Refused


def add_options(parser: argparse.ArgumentParser) -> None:
    """Add torchrun's options that ``phalanx run`` does not spell itself."""
    group = parser.add_argument_group(
        "torchrun's options", "accepted with torchrun's meaning, or refused saying what to do instead")
    add = group.add_argument
    add("--rdzv-backend", "--rdzv_backend", default=None, metavar="static|c10d",
        help="both mean node 0 hosts the store at --rdzv-endpoint (or --master-addr/port); "
             "with c10d, nodes without --node-rank are numbered as they join")
    add("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST[:PORT][,HOST:PORT...]",
        help=f"node 0's address and port, as --master-addr/--master-port (c10d's port "
             f"{C10D_DEFAULT_PORT} when none is given); a list: where a launcher started "
             "while its job runs looks for it (the store moves when node 0 is lost)")
    add("--rdzv-conf", "--rdzv_conf", default=None, metavar="KEY=VALUE,...",
        help="join_timeout=S or timeout=S: as --rdzv-timeout S; last_call_timeout=S: elastic's "
             "wait for more nodes; other keys are refused")
    add("--role", default="default", help="the workers' ROLE_NAME (default %(default)s)")
    add("--no-python", "--no_python", action="store_true",
        help="run the entry point as a command, not with python (e.g. a wrapper script)")
    add("--run-path", "--run_path", action="store_true",
        help="accepted: each worker runs the script in a fresh interpreter, as it does anyway")
    add("--start-method", "--start_method", default="spawn", choices=START_METHODS,
        help="accepted, no effect: torchrun uses it only for Python functions, never for scripts; "
             "every worker is a new process")
    add("--local-ranks-filter", "--local_ranks_filter", default=None, metavar="R,R,...",
        help="show only these local ranks' output on the console (log files keep everything)")
    add("--signals-to-handle", "--signals_to_handle", default=None, metavar="SIG,...",
        help="accepted when it names only signals phalanx handles anyway: "
             + ", ".join(_HANDLED_SIGNALS))
    add("--event-log-handler", "--event_log_handler", default="null",
        help="only 'null' (torchrun's default): phalanx emits no torch elastic events")
    for names, nargs, message in _REFUSED:
        add(*names, nargs=nargs, action=_refusal(message), help=argparse.SUPPRESS)


def parse_nnodes(spec: str) -> tuple[int, int]:
    """``--nnodes``: ``N`` (fixed), or torchrun's ``MIN:MAX`` (elastic when MIN < MAX);
    returns ``(MIN, MAX)``."""
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(spec))
    if not match:
        raise LaunchConfigError(
            f"Invalid --nnodes {spec!r}: expected a number of nodes N, or MIN:MAX (elastic: the "
            "job runs on MIN to MAX nodes), e.g. --nnodes 2 or --nnodes 1:4")
    low, high = int(match.group(1)), int(match.group(2) or match.group(1))
    if low < 1 or low > high:
        raise LaunchConfigError(
            f"Invalid --nnodes {spec}: expected MIN:MAX with 1 <= MIN <= MAX, got MIN {low} "
            f"and MAX {high}")
    return low, high


def local_ranks(spec: str | None) -> tuple[int, ...] | None:
    """``--local-ranks-filter 0,1,2`` -> ``(0, 1, 2)``."""
    if spec is None:
        return None
    if not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", spec):
        raise LaunchConfigError(
            f"Invalid --local-ranks-filter {spec!r}: it must be a comma-separated list of "
            "integers, e.g. --local-ranks-filter 0,1,2"
        )
    return tuple(int(r) for r in spec.split(","))


def check_accepted(args: argparse.Namespace) -> None:
    """Refuse the values of accepted options that phalanx cannot honour."""
    if args.event_log_handler != "null":
        raise LaunchConfigError(
            f"--event-log-handler {args.event_log_handler!r}: phalanx emits no torch elastic "
            "events, so only 'null' is accepted; its own report of a failure is on stderr"
        )
    if args.signals_to_handle is not None:
        names = [n.strip().upper() for n in args.signals_to_handle.split(",") if n.strip()]
        other = [n for n in names if n not in _HANDLED_SIGNALS]
        if other:
            raise LaunchConfigError(
                f"--signals-to-handle: phalanx cannot handle {', '.join(other)}. It always stops "
                "the workers on SIGTERM, SIGINT, SIGHUP and SIGQUIT (sending them the signal) "
                "and forwards SIGUSR1 and SIGUSR2 to them"
            )
    if args.module and args.run_path:
        raise LaunchConfigError("--run-path runs a script file, -m a module: give one of them")


def node_rank(args: argparse.Namespace, nnodes: tuple[int, int]) -> int | None:
    """``--node-rank``, or ``None`` (numbered by arrival) for several nodes under elastic
    membership or torchrun's c10d; else node 0, as torchrun's static rendezvous."""
    if args.node_rank is not None:
        return args.node_rank
    several = nnodes[1] > 1
    return None if several and (nnodes[0] < nnodes[1] or args.rdzv_backend == "c10d") else 0


def rendezvous(args: argparse.Namespace) -> dict[str, Any]:
    """``master_addr``/``master_port``/``standalone``/``rdzv_timeout``/``last_call_timeout``
    from torchrun's ``--rdzv-*`` options; only what they set (empty when none is given)."""
    backend = args.rdzv_backend
    if backend is not None and backend not in ("static", "c10d"):
        raise LaunchConfigError(
            f"--rdzv-backend {backend!r} is not supported: phalanx's rendezvous is a TCPStore "
            "hosted by node 0's launcher (torchrun's static and c10d backends); use one of those"
        )
    out: dict[str, Any] = {}
    if args.rdzv_conf:
        out.update(_conf(args.rdzv_conf, timeout_given=args.rdzv_timeout is not None))
    if args.rdzv_endpoint is None:
        return out
    if args.standalone or args.master_addr is not None or args.master_port is not None:
        raise LaunchConfigError(
            "--rdzv-endpoint names node 0's address and port: give it alone, without "
            "--master-addr/--master-port or --standalone"
        )
    default = C10D_DEFAULT_PORT if backend == "c10d" else None
    endpoints = [_endpoint(spec, default) for spec in args.rdzv_endpoint.split(",")]
    host, port = endpoints[0]
    if port == 0 and parse_nnodes(args.nnodes) == (1, 1):  # torchrun's --standalone is c10d on localhost:0
        return {**out, "standalone": True}
    more = {"rdzv_endpoints": tuple(endpoints)} if len(endpoints) > 1 else {}
    return {**out, "master_addr": host, "master_port": port, **more}


def _endpoint(spec: str, default_port: int | None) -> tuple[str, int]:
    match = re.fullmatch(r"(\[[^\]]+\]|[^:\[\]]+)(?::(\d+))?", spec.strip())
    if not match:
        raise LaunchConfigError(f"Invalid --rdzv-endpoint {spec!r}: expected HOST:PORT")
    host, port = match.group(1), match.group(2)
    if port is None and default_port is None:
        raise LaunchConfigError(
            f"--rdzv-endpoint {spec!r} has no port: give HOST:PORT (or --master-port)")
    return host, int(port or default_port)


def _conf(spec: str, *, timeout_given: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in (*_TIMEOUT_KEYS, _LAST_CALL_KEY):
            raise LaunchConfigError(
                f"--rdzv-conf {key}: not supported. phalanx understands join_timeout=S and "
                "timeout=S, which are --rdzv-timeout S, and last_call_timeout=S (elastic: how "
                "long the first round waits for more nodes once MIN are there)"
            )
        try:
            seconds = float(value)
        except ValueError:
            raise LaunchConfigError(f"Invalid --rdzv-conf {item!r}: expected {key}=SECONDS") from None
        if key == _LAST_CALL_KEY:
            out["last_call_timeout"] = seconds
            continue
        if timeout_given:
            raise LaunchConfigError(f"--rdzv-conf {key} and --rdzv-timeout say the same: give one")
        out["rdzv_timeout"] = seconds
    return out
