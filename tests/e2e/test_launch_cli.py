"""phalanx run's command line: parsing, bad input (exit 2), rendezvous errors, console output,
and the launcher's pieces that need no workers: which traceback and which failure it reports.

Most checks call ``phalanx.cli.main`` in this process: nothing is spawned before an error.
"""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import time

import pytest

from phalanx import cli
from phalanx.errors import RendezvousError
from phalanx.launcher import LaunchConfig, StreamChoice, rendezvous
from phalanx.launcher import console as console_module
from phalanx.launcher.console import Console
from phalanx.launcher.output import recorded_error, traceback_tail
from phalanx.launcher.workers import Worker, first_failure
from tests.e2e.launch_helpers import BEHAVE, ROOT, SECRET, base_env
from tests.harness import free_port


def _main(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


def _config(*argv: str) -> LaunchConfig:
    return cli.config_from_args(cli.build_parser().parse_args(["run", *argv]))


@pytest.fixture
def secret(monkeypatch):
    """A job secret in this process's environment, as launchers of several nodes need."""
    monkeypatch.setenv("PHALANX_JOB_SECRET", SECRET)


def test_dashed_and_underscored_spellings_mean_the_same(secret, tmp_path):
    logs = str(tmp_path / "logs")
    dashed = _config("--nproc-per-node", "3", "--nnodes", "2", "--node-rank", "1",
                     "--master-addr", "10.1.2.3", "--master-port", "1234", "--max-restarts", "2",
                     "--monitor-interval", "0.5", "--shutdown-timeout", "7", "--rdzv-timeout", "9",
                     "--rdzv-id", "job", "--log-dir", logs, "--tee", "1", BEHAVE, "a", "--b")
    under = _config("--nproc_per_node", "3", "--nnodes", "2", "--node_rank", "1",
                    "--master_addr", "10.1.2.3", "--master_port", "1234", "--max_restarts", "2",
                    "--monitor_interval", "0.5", "--shutdown_timeout", "7", "--rdzv_timeout", "9",
                    "--rdzv_id", "job", "--log_dir", logs, "--tee", "1", BEHAVE, "a", "--b")
    assert dashed == under
    assert (dashed.nproc_per_node, dashed.nnodes, dashed.node_rank) == (3, 2, 1)
    assert (dashed.master_addr, dashed.master_port, dashed.max_restarts) == ("10.1.2.3", 1234, 2)
    assert (dashed.monitor_interval, dashed.shutdown_timeout, dashed.rdzv_timeout) == (0.5, 7, 9)
    assert dashed.args == ("a", "--b") and dashed.tee == StreamChoice(1)
    assert dashed.command == [sys.executable, BEHAVE, "a", "--b"]


def test_defaults_module_mode_and_stream_choices(tmp_path):
    config = _config(BEHAVE)
    assert (config.nproc_per_node, config.master_addr, config.master_port) == (1, "127.0.0.1", 29500)
    assert (config.monitor_interval, config.shutdown_timeout, config.max_restarts) == (0.1, 30, 0)
    assert (config.nnodes, config.node_rank, config.rdzv_timeout, config.role) == (1, 0, 600, "default")
    assert _config("-m", "json.tool", "x").command == [sys.executable, "-m", "json.tool", "x"]
    assert _config("--nproc-per-node", "cpu", BEHAVE).nproc_per_node >= 1
    assert _config("--nproc", "3", BEHAVE).nproc_per_node == 3  # phalanx bench's old spelling

    def console(*argv):
        config = _config("--log-dir", str(tmp_path / "logs"), *argv, BEHAVE)
        return [config.console_streams(r) for r in (0, 1, 2)]

    # torchrun's meaning: redirected streams leave the console, teed ones stay on it
    assert console() == [3, 3, 3]
    assert console("--redirects", "0:1") == [2, 3, 3]  # rank 0's stdout off the console
    assert console("-r", "3") == [0, 0, 0]
    assert console("-r", "3", "-t", "0:1,2:3") == [1, 0, 3]  # tee overrides redirects
    assert console("--tee", "0:3,2:2") == [3, 3, 3]  # every stream is in the files already
    assert console("--local-ranks-filter", "0,2", "-r", "2:1") == [3, 0, 2]


@pytest.mark.parametrize("argv, message", [
    (["missing.py"], "Script 'missing.py' not found"),
    (["-m", "no_such_module_xyz"], "Module 'no_such_module_xyz' not found"),
    (["--nproc-per-node", "0", BEHAVE], "Invalid --nproc-per-node 0: expected a positive integer"),
    (["--nproc-per-node", "many", BEHAVE], "Invalid --nproc-per-node 'many'"),
    (["--nnodes", "2", "--node-rank", "2", BEHAVE],
     r"Invalid --node-rank 2: with --nnodes 2 it must be in [0, 1]"),
    (["--standalone", "--nnodes", "2", BEHAVE], "--standalone runs one node"),
    (["--standalone", "--master-port", "1234", BEHAVE], "--standalone picks a free port"),
    (["--master-port", "70000", BEHAVE], "Invalid --master-port 70000"),
    (["--max-restarts", "-1", BEHAVE], "Invalid --max-restarts -1"),
    (["--tee", "3", BEHAVE], "--tee chooses what goes to the log files, so it needs --log-dir D"),
    (["-r", "0:1", BEHAVE], "--redirects chooses what goes to the log files, so it needs --log-dir"),
    (["--log-dir", "d", "--tee", "9", BEHAVE], "Invalid --tee '9'"),
    (["--bogus", BEHAVE], "phalanx run: error: unrecognized arguments: --bogus; not an option "
                          "of phalanx run's, nor of torchrun's\n(`phalanx run -h` for help)\n"),
    (["--nnodes", "two", BEHAVE], "Invalid --nnodes 'two': expected a number of nodes N, or "
                                  "MIN:MAX (elastic: the job runs on MIN to MAX nodes)"),
    (["--nnodes", "3:2", BEHAVE], "Invalid --nnodes 3:2: expected MIN:MAX with 1 <= MIN <= MAX, "
                                  "got MIN 3 and MAX 2"),
    (["--nnodes", "0:2", BEHAVE], "Invalid --nnodes 0:2: expected MIN:MAX with 1 <= MIN <= MAX"),
    (["--nnodes", "1:", BEHAVE], "Invalid --nnodes '1:': expected a number of nodes N, or MIN:MAX"),
    (["--nnodes", "1:2", BEHAVE], "--nnodes 1:2: several nodes need a job secret, the same on "
                                  "every node, so that no one else can join or write the job's "
                                  "store: set PHALANX_JOB_SECRET or pass --job-secret-file PATH"),
    (["--nnodes", "2", "--node-rank", "1", BEHAVE], "--nnodes 2: several nodes need a job secret"),
    # issue 34 item 7: the one line a Kubernetes user needs, in the message
    (["--nnodes", "1:2", BEHAVE], "on Kubernetes, one Secret for every pod: kubectl create secret "
                                  "generic phalanx-job --from-literal=secret=$(python3 -c 'import "
                                  "secrets; print(secrets.token_hex(32))'), and in the container: "
                                  "env: [{name: PHALANX_JOB_SECRET, valueFrom: {secretKeyRef: "
                                  "{name: phalanx-job, key: secret}}}]"),
    (["--nnodes", "2", "--job-secret-file", "/no/such/file", BEHAVE],
     "Cannot read the job secret file '/no/such/file': No such file or directory"),
    ([], "phalanx run: error: script is required: phalanx run [options] script.py [script args...]"),
    (["--nproc-per-node", "2"], "script is required"),
    (["--no-python", "-m", "json.tool"], "--no-python runs a command, -m a Python module"),
    (["--no-python", "no-such-program-xyz"], "Command 'no-such-program-xyz' not found"),
    (["--run-path", "-m", "json.tool"], "--run-path runs a script file, -m a module"),
    (["--role", " ", BEHAVE], "Invalid --role ''"),
    (["--local-ranks-filter", "0;1", BEHAVE], "Invalid --local-ranks-filter '0;1': it must be a "
                                              "comma-separated list of integers"),
])
def test_bad_input_exits_2_with_a_clear_message(capsys, argv, message):
    code, err = _main(capsys, "run", *argv)
    assert code == 2
    assert message in err
    assert "usage:" not in err and "script_args" not in err  # one line, not a screenful


@pytest.mark.parametrize("argv, expected", [
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "10.1.2.3:1234", "--nnodes", "2",
      "--node-rank", "1"], {"master_addr": "10.1.2.3", "master_port": 1234, "nnodes": 2, "node_rank": 1}),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--nnodes", "2"],  # numbered by arrival
     {"min_nnodes": 2, "nnodes": 2, "node_rank": None}),
    (["--nnodes", "1:4", "--rdzv-conf", "last_call_timeout=0.5"],  # elastic
     {"min_nnodes": 1, "nnodes": 4, "node_rank": None, "last_call_timeout": 0.5}),
    (["--nnodes", "2:4", "--node-rank", "3"], {"min_nnodes": 2, "nnodes": 4, "node_rank": 3}),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1"], {"node_rank": 0}),  # static: --node-rank 0
    (["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0"], {"standalone": True}),  # = --standalone
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "node0"], {"master_addr": "node0", "master_port": 29400}),
    (["--nnodes", "2:3", "--rdzv-endpoint", "a:5,b:6, [::1]:7"],  # where a job may have moved
     {"master_addr": "a", "master_port": 5, "rdzv_endpoints": (("a", 5), ("b", 6), ("[::1]", 7))}),
    (["--rdzv-endpoint", "a:5"], {"rdzv_endpoints": ()}),
    (["--rdzv-endpoint", "[::1]:5", "--rdzv-conf", "join_timeout=900"],
     {"master_addr": "[::1]", "master_port": 5, "rdzv_timeout": 900}),
    (["--nnodes", "1:1", "--rdzv-backend", "static"], {"nnodes": 1}),
    (["--role", "trainer"], {"role": "trainer"}),
    (["--start-method", "fork", "--run-path"], {"no_python": False}),
    (["--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1", "--event-log-handler", "null"], {}),
    (["--no-rank-prefix", "--local-ranks-filter", "1, 3"],
     {"rank_prefix": False, "local_ranks_filter": (1, 3)}),
])
def test_torchruns_options_with_torchruns_meaning(secret, argv, expected):
    config = _config(*argv, BEHAVE)
    assert {key: getattr(config, key) for key in expected} == expected
    assert _config("--no-python", "true", "x").command == ["true", "x"]
    assert _config("--no-python", "--run-path", BEHAVE).command == [sys.executable, BEHAVE]


@pytest.mark.parametrize("argv, message", [
    (["--rdzv-backend", "etcd-v2"], "--rdzv-backend 'etcd-v2' is not supported: phalanx's "
                                    "rendezvous is a TCPStore hosted by node 0's launcher"),
    (["--rdzv-endpoint", "h:1", "--master-port", "2"], "--rdzv-endpoint names node 0's address"),
    (["--rdzv-endpoint", "h"], "--rdzv-endpoint 'h' has no port"),
    (["--rdzv-endpoint", "h:1,g"], "--rdzv-endpoint 'g' has no port"),
    (["--rdzv-endpoint", "h:1,,g:2"], "Invalid --rdzv-endpoint '': expected HOST:PORT"),
    (["--rdzv-endpoint", "h:1,g:70000"], "Invalid --rdzv-endpoint g:70000: expected a port in [1, 65535]"),
    (["--rdzv-conf", "read_timeout=5"], "--rdzv-conf read_timeout: not supported"),
    (["--rdzv-conf", "timeout=5", "--rdzv-timeout", "3"], "say the same: give one"),
    (["--local-addr", "10.0.0.2"], "torchrun's --local-addr is not supported: phalanx needs no "
                                   "address of the local node"),
    (["--numa-binding", "node"], "phalanx run --no-python numactl --cpunodebind=0 python train.py"),
    (["--virtual-local-rank"], "set CUDA_VISIBLE_DEVICES in a wrapper"),
    (["--logs-specs", "x"], "phalanx's log layout is fixed"),
    (["--duplicate-stderr-filters", "a"], "every line is in the rank's log files, to grep"),
    (["--event-log-handler", "console"], "phalanx emits no torch elastic events"),
    (["--signals-to-handle", "SIGTERM,SIGPIPE"], "phalanx cannot handle SIGPIPE"),
    (["--start-method", "thread"], "invalid choice: 'thread'"),
])
def test_torchruns_other_options_are_refused_saying_what_to_do(capsys, argv, message):
    code, err = _main(capsys, "run", *argv, BEHAVE)
    assert code == 2
    assert message in err and "usage:" not in err


def _pet(monkeypatch, **variables: str) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(f"PET_{name}", value)


@pytest.mark.parametrize("variables, argv, expected", [
    # the training operator's PyTorchJob with a master (static rendezvous, fixed nodes)
    ({"NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "3", "MASTER_ADDR": "job-master-0",
      "MASTER_PORT": "23456"}, [],
     {"nnodes": 2, "node_rank": 1, "nproc_per_node": 3, "master_addr": "job-master-0",
      "master_port": 23456}),
    # ... with an elastic policy: c10d at an endpoint, MIN:MAX nodes, restarts, an id
    ({"RDZV_BACKEND": "c10d", "RDZV_ENDPOINT": "job-worker-0:29400", "NNODES": "1:3",
      "MAX_RESTARTS": "3", "NPROC_PER_NODE": "1", "RDZV_ID": "job", "RDZV_CONF": "timeout=900",
      "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}, [],  # the endpoint wins, as in torchrun
     {"master_addr": "job-worker-0", "master_port": 29400, "min_nnodes": 1, "nnodes": 3,
      "node_rank": None, "max_restarts": 3, "run_id": "job", "rdzv_timeout": 900}),
    # a value on the command line wins over the variable
    ({"NPROC_PER_NODE": "3", "MAX_RESTARTS": "4", "ROLE": "env-role"},
     ["--nproc_per_node", "2", "--role", "cli-role"],
     {"nproc_per_node": 2, "max_restarts": 4, "role": "cli-role"}),
    # flags: an integer, 0 for off; an empty variable of an option with a value is unset
    ({"STANDALONE": "1", "NO_PYTHON": "0", "RDZV_ENDPOINT": "", "MONITOR_INTERVAL": "0.5",
      "SHUTDOWN_TIMEOUT": "7", "VIRTUAL_LOCAL_RANK": "0"}, [],
     {"standalone": True, "no_python": False, "monitor_interval": 0.5, "shutdown_timeout": 7}),
])
def test_torchruns_pet_variables_set_what_torchrun_reads_them_for(
        monkeypatch, secret, variables, argv, expected):
    _pet(monkeypatch, **variables)
    config = _config(*argv, BEHAVE)
    assert {key: getattr(config, key) for key in expected} == expected


@pytest.mark.parametrize("variables, message", [
    ({"MAX_RESTARTS": "three"}, "Invalid PET_MAX_RESTARTS='three': torchrun's --max-restarts is "
                                "an integer\n"),
    ({"MONITOR_INTERVAL": "fast"}, "Invalid PET_MONITOR_INTERVAL='fast': torchrun's "
                                   "--monitor-interval is a number"),
    ({"STANDALONE": ""}, "Invalid PET_STANDALONE='': expected an integer, as torchrun reads it "
                         "(1: --standalone, 0: without it)"),
    ({"START_METHOD": "thread"}, "Invalid PET_START_METHOD='thread': torchrun's --start-method "
                                 "is one of spawn, fork, forkserver"),
    ({"NPROC_PER_NODE": "0"}, "Invalid --nproc-per-node 0: expected a positive integer "
                              "(--nproc-per-node came from PET_NPROC_PER_NODE='0')"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "Invalid --node-rank 2: with --nnodes 2 it must be in "
     "[0, 1] (--nnodes came from PET_NNODES='2'; --node-rank came from PET_NODE_RANK='2')"),
    ({"NNODES": "2"}, "(--nnodes came from PET_NNODES='2')"),  # no job secret
    ({"LOCAL_ADDR": "10.0.0.2"}, "torchrun's --local-addr is not supported (set by "
                                 "PET_LOCAL_ADDR='10.0.0.2': unset it): phalanx needs no address"),
    ({"DUPLICATE_STDERR_FILTERS": "a"}, "(set by PET_DUPLICATE_STDERR_FILTERS='a': unset it)"),
    ({"VIRTUAL_LOCAL_RANK": "1"}, "torchrun's --virtual-local-rank is not supported"),
])
def test_a_bad_pet_variable_is_named(monkeypatch, capsys, variables, message):
    _pet(monkeypatch, **variables)
    code, err = _main(capsys, "run", BEHAVE)
    assert code == 2 and message in err, err
    assert cli.main(["run", "-h"]) == 0  # the manual needs no valid variable


@pytest.mark.parametrize("argv, message", [
    (["run", "--standalon", BEHAVE], "phalanx run: error: unrecognized arguments: --standalon; "
                                     "did you mean --standalone?"),
    (["run", "--nproc-per-nod=2", BEHAVE], "--nproc-per-nod=2; did you mean --nproc-per-node?"),
    (["run", "--nproc_per_nod", "2", BEHAVE], "did you mean --nproc_per_node?"),
    (["bench", "--step", "3"], "phalanx bench: error: unrecognized arguments: --step 3; did you "
                               "mean --steps?"),
    (["bench", "--bogus"], "phalanx bench: error: unrecognized arguments: --bogus\n"),
])
def test_a_mistyped_option_gets_the_closest_one_and_one_help_pointer(capsys, argv, message):
    code, err = _main(capsys, *argv)
    assert code == 2 and message in err, err
    command = argv[0]
    assert err.endswith(f"\n(`phalanx {command} -h` for help)\n") and err.count(" -h") == 1, err
    assert "torchrun" not in err or command == "run"  # phalanx bench is not torchrun's


def test_version_and_a_help_readable_in_a_terminal(capsys):
    from phalanx import __version__

    with pytest.raises(SystemExit) as version:
        cli.build_parser().parse_args(["--version"])
    assert version.value.code == 0 and capsys.readouterr().out == f"phalanx {__version__}\n"
    for command in ("run", "bench"):
        assert cli.main([command, "-h"]) == 0
        manual = capsys.readouterr().out
        assert "``" not in manual and "**" not in manual and ":class:" not in manual, manual
        assert "--nproc-per-node" in manual
    done = subprocess.run([sys.executable, "-m", "phalanx", "--version"], env=base_env(),
                          capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, f"phalanx {__version__}\n")


def test_the_help_says_node_0_may_be_lost_as_the_docs_do(capsys):
    # issue 34 item 7: `phalanx run -h` said node 0 "cannot be replaced", where the README and
    # docs/launching.md say its store moves to a survivor (tests/e2e/test_store_moves.py)
    assert cli.main(["run", "-h"]) == 0
    manual = " ".join(capsys.readouterr().out.split())
    assert "cannot be replaced" not in manual and "lost the rendezvous store" not in manual
    assert "Node 0 may be lost too: the store it hosts moves to a survivor" in manual, manual
    assert "store moves" in (ROOT / "docs" / "launching.md").read_text()


def test_no_command_prints_help_and_exits_2(capsys):
    code, err = _main(capsys)
    assert code == 2 and "run" in err


def test_master_port_in_use_is_named(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = _main(capsys, "run", "--master-port", str(port), BEHAVE, "--record", ".")
    assert code == 2
    assert f"Master port {port} on 127.0.0.1 is already in use" in err
    assert "--standalone" in err  # the way out


def test_master_address_not_of_this_host(capsys):
    code, err = _main(capsys, "run", "--master-addr", "192.0.2.1", BEHAVE, "--record", ".")
    assert code == 2
    assert "Master address 192.0.2.1 (192.0.2.1) is not an address of this machine" in err


def test_unreachable_master_fails_within_the_timeout_naming_it(capsys, secret):
    port = free_port()  # nothing listens there
    began = time.monotonic()
    code, err = _main(capsys, "run", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                      "127.0.0.1", "--master-port", str(port), "--rdzv-timeout", "1.5",
                      BEHAVE, "--record", ".")
    took = time.monotonic() - began
    assert code == 1
    assert f"Node 1 could not reach the master at 127.0.0.1:{port} within 1.5 s (--rdzv-timeout)" in err
    # Honoured: not before 1.5 s, and nowhere near the 600 s default; the 10 s margin absorbs
    # a loaded machine (the launcher forks its guardian and waits for it to exit).
    assert 1.5 <= took < 1.5 + 10, took


def test_the_launcher_starts_without_importing_torch():
    # torch costs seconds of CPU to import; the launcher of one node never needs it itself
    code = ("import sys, phalanx.cli, phalanx.launcher.agent; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", code], env=base_env(), cwd=ROOT)
    assert done.returncode == 0, "phalanx.cli imports torch: keep phalanx/__init__.py lazy"


class _Terminal(io.BytesIO):
    def isatty(self) -> bool:
        return True


def test_console_prefixes_lines_and_keeps_progress_bars_on_one_line():
    out, err = _Terminal(), _Terminal()
    console = Console(out, err)
    console.write(0, 2, b"\rbar 1/3")
    console.write(0, 2, b"\rbar 2/3")
    console.flush(older_than=0.0)  # the bar, unfinished, shows once it has waited long enough
    console.write(1, 1, b"hello\nwor")  # another rank: the bar's line is ended first
    console.write(1, 1, b"ld\n")
    console.write(0, 2, b"\rbar 3/3\n")
    console.write(2, 2, b"[rank2]: torch's own prefix\n")  # not doubled
    console.note("restarting\nnow")
    assert out.getvalue() == b"[rank1]: hello\n[rank1]: world\n"
    assert err.getvalue() == (b"\r[rank0]: bar 1/3\r[rank0]: bar 2/3\n"
                              b"\r[rank0]: bar 3/3\n[rank2]: torch's own prefix\n"
                              b"[phalanx] restarting\n[phalanx] now\n")
    # tqdm's leave=False clears its bar with blanks: the line is erased and reused, so the
    # next line does not follow an empty "[rank0]: " line
    out, err = _Terminal(), _Terminal()
    console = Console(out, err)
    console.write(0, 2, b"\repoch 1/2: 100% 23/23\r" + b" " * 22 + b"\r")
    console.write(0, 1, b"epoch 1: accuracy 90%\n")
    assert err.getvalue() == b"\r[rank0]: epoch 1/2: 100% 23/23\r\r\x1b[K\r"
    assert out.getvalue() == b"[rank0]: epoch 1: accuracy 90%\n"
    plain = Console(out := io.BytesIO(), io.BytesIO(), rank_prefix=False)
    plain.write(3, 1, b"as printed\n")
    assert out.getvalue() == b"as printed\n"


def test_console_off_a_terminal_writes_a_progress_bars_last_state_only(monkeypatch):
    def epoch(console, n):
        console.write(0, 2, b"\r" + f"epoch {n}: 0/50".encode())
        for step in range(1, 51):
            console.write(0, 2, b"\r" + f"epoch {n}: {step}/50".encode())
            console.flush()  # the launcher's loop: nothing held is shown off a terminal
        console.write(0, 2, b"\r" + b" " * 14 + b"\r")  # cleared (leave=False)
        console.write(0, 1, f"epoch {n} done\n".encode())

    out, err = io.BytesIO(), io.BytesIO()
    console = Console(out, err)
    for n in (1, 2):
        epoch(console, n)
    assert err.getvalue() == b"[rank0]: epoch 1: 50/50\n[rank0]: epoch 2: 50/50\n"
    assert out.getvalue() == b"[rank0]: epoch 1 done\n[rank0]: epoch 2 done\n"
    console.write(0, 2, b"\rsaving 1/2")  # the run ends mid-bar: its last state is kept
    console.write(0, 2, b"\rsaving 2/2")
    console.flush(older_than=0.0)
    assert err.getvalue().endswith(b"epoch 2: 50/50\n[rank0]: saving 2/2\n")
    monkeypatch.setattr(console_module, "STATE_EVERY_S", 0.0)  # a long epoch: a state each time
    console = Console(out := io.BytesIO(), err := io.BytesIO())
    for step in range(4):
        console.write(0, 2, b"\rstep %d" % step)
    console.write(0, 2, b"\rstep 4\n")  # leave=True: the final state ends with a newline
    assert err.getvalue() == b"".join(b"[rank0]: step %d\n" % i for i in range(5))


def test_console_holds_other_ranks_until_the_report():
    out, err = io.BytesIO(), io.BytesIO()
    console = Console(out, err)
    console.hold([0, 2])
    console.write(0, 2, b"RuntimeError: connection closed by peer\n")
    console.write(1, 2, b"ValueError: the root cause\n")
    console.note("root cause: rank 1")
    console.release("what the other workers wrote after rank 1 failed:")
    console.write(0, 1, b"after\n")
    assert err.getvalue() == (b"[rank1]: ValueError: the root cause\n[phalanx] root cause: rank 1\n"
                              b"[phalanx] what the other workers wrote after rank 1 failed:\n"
                              b"[rank0]: RuntimeError: connection closed by peer\n")
    assert out.getvalue() == b"[rank0]: after\n"
    console.release("nothing held: no heading")
    assert err.getvalue().endswith(b"peer\n")


def test_console_shows_a_long_stderr_line_of_several_ranks_once():
    out, err = io.BytesIO(), io.BytesIO()
    console = Console(out, err)
    long = b"x" * console_module.FOLD_MIN
    console.write(1, 2, b"[rank1]: Error: " + long + b"\n")  # torch's prefix, inside the text
    console.write(0, 2, b"[rank0]: Error: " + long + b"\n")
    console.write(2, 2, b"Error: " + long + b"\n")  # no prefix of torch's
    console.write(0, 2, b"Error: " + long[1:] + b"\n")  # another line
    console.write(0, 1, long + b"\n")  # stdout is the script's own: as written
    console.write(1, 1, long + b"\n")
    console.write(1, 2, b"short\n")
    console.write(0, 2, b"short\n")
    n = len(long) + 7
    assert err.getvalue().splitlines() == [
        b"[rank1]: Error: " + long,
        b"[rank0]: (the same %d-character line as rank 1's above)" % n,
        b"[rank2]: (the same %d-character line as rank 1's above)" % n,
        b"[rank0]: Error: " + long[1:],
        b"[rank1]: short", b"[rank0]: short"]
    assert out.getvalue() == b"[rank0]: " + long + b"\n[rank1]: " + long + b"\n"


def test_console_keeps_a_line_written_in_pieces_whole():
    # print("rank", r, "ok") writes its pieces separately; two ranks doing it at once
    out = io.BytesIO()
    console = Console(out, io.BytesIO())
    for piece in (b"rank", b" ", b"1", b" ok"):
        console.write(1, 1, piece)
        console.write(0, 1, piece.replace(b"1", b"0"))
    console.flush()  # not long enough: nothing unfinished is shown yet
    assert out.getvalue() == b""
    console.write(1, 1, b"\n")
    console.write(0, 1, b"\n")
    assert out.getvalue() == b"[rank1]: rank 1 ok\n[rank0]: rank 0 ok\n"
    console.write(0, 1, b"no newline at exit")
    console.flush(older_than=0.0)
    assert out.getvalue().endswith(b"[rank0]: no newline at exit")


def test_traceback_tail_takes_the_last_traceback_as_a_terminal_shows_it():
    text = ("progress\r 50%\r100%\nTraceback (most recent call last):\n  old\nKeyError: 1\n"
            "During handling...\n[rank1]: Traceback (most recent call last):\n"
            + "".join(f'[rank1]:   File "f.py", line {i}\n' for i in range(30))
            + "[rank1]: ValueError: boom\n")
    tail = traceback_tail(text, max_lines=6).splitlines()
    assert tail[0] == "[rank1]: Traceback (most recent call last):" and tail[1] == "  ..."
    assert tail[-1] == "[rank1]: ValueError: boom" and len(tail) == 6
    assert traceback_tail("a\nb\r c\n\n", max_lines=20) == "a\n c"


_REAL = (  # what the worker's stderr held when it died: the traceback that ended it, ...
    "step 1\n"
    "Traceback (most recent call last):\n"  # printed by the script and survived
    '  File "/job/train.py", line 9, in log_step\n    write()\nOSError: disk busy\n'
    "[rank1]: Traceback (most recent call last):\n"
    '[rank1]:   File "/job/train.py", line 20, in <module>\n[rank1]:     main()\n'
    '[rank1]:   File "/job/train.py", line 15, in main\n[rank1]:     step(model)\n'
    '[rank1]:   File "/usr/lib/torch/nn/module.py", line 3, in forward\n[rank1]:     raise x\n'
    "[rank1]: RuntimeError: the real cause\n"
)
_NOISE = (  # ... then a child's traceback at exit, and warnings
    "Traceback (most recent call last):\n"
    '  File "/usr/lib/python3/multiprocessing/resource_tracker.py", line 209, in main\n'
    "    cache[rtype].remove(name)\nKeyError: '/mp-x'\n"
    "/usr/lib/python3/multiprocessing/resource_tracker.py:254: UserWarning: leaked semaphore\n"
    "  warnings.warn(\n"
    "/usr/lib/python3/warnings.py:1: DeprecationWarning: another one\n  import x\n"
)


def test_traceback_tail_shows_the_traceback_that_ended_the_process():
    for entry in ("/job/train.py", None):  # found by its script's frames, or by "in <module>"
        tail = traceback_tail(_REAL + _NOISE, entry).splitlines()
        assert tail[0] == "[rank1]: Traceback (most recent call last):", tail
        assert tail[-1] == "[rank1]: RuntimeError: the real cause", tail
        assert len(tail) == 8 and "KeyError" not in "".join(tail)
    short = traceback_tail(_REAL + _NOISE, "/job/train.py", max_lines=4).splitlines()
    assert short == ["[rank1]: Traceback (most recent call last):", "  ...",
                     "[rank1]:     raise x", "[rank1]: RuntimeError: the real cause"]
    # none names the script nor reaches a module's top: the last traceback, cut at its exception
    assert traceback_tail(_NOISE, "/job/train.py").splitlines()[-1] == "KeyError: '/mp-x'"
    group = ('  + Exception Group Traceback (most recent call last):\n'
             '  |   File "/job/train.py", line 6, in <module>\n  |     raise ExceptionGroup()\n'
             '  | ExceptionGroup: g (1 sub-exception)\n  +-+---------------- 1 ----------------\n'
             '    | Traceback (most recent call last):\n'
             '    |   File "/job/train.py", line 4, in <module>\n    | ValueError: 1\n'
             '    +------------------------------------\n')
    tail = traceback_tail(_REAL + group + _NOISE, "/job/train.py").splitlines()
    assert tail[0].endswith("Exception Group Traceback (most recent call last):")
    assert tail[-1] == "  | ExceptionGroup: g (1 sub-exception)", tail


def test_recorded_error_reads_what_torchs_record_writes(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    path = tmp_path / "error.json"
    assert recorded_error(str(path)) is None  # undecorated scripts write nothing
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ValueError("recorded boom")
    except ValueError as e:
        ErrorHandler().record_exception(e)
    text = recorded_error(str(path))
    assert text.startswith("Traceback (most recent call last):")
    assert text.rstrip().endswith("ValueError: recorded boom")
    path.write_text('{"message": "SIGSEGV", "timestamp": "1"}')  # torch's other shape
    assert recorded_error(str(path)) == "SIGSEGV"
    path.write_text("{trunc")
    assert recorded_error(str(path)) is None


def test_a_failed_rendezvous_gives_node_0s_ports_back(monkeypatch):
    def no_store(*args):
        raise RuntimeError("store failed")

    monkeypatch.setattr(rendezvous, "_tcp_store", no_store)
    port = free_port()
    config = LaunchConfig(BEHAVE, nnodes=2, node_rank=0, master_port=port, job_secret=SECRET)
    with pytest.raises(RendezvousError, match="could not reach its store helper .store failed"):
        rendezvous.meet(config, 1, lambda: None, guardian=None, note=print)
    with socket.socket() as again:  # the gate's port is free at once: its helper is gone
        again.bind(("127.0.0.1", port))


def test_the_failure_named_is_the_first_exit_seen_not_the_lowest_rank():
    def worker(local_rank, *command):
        return Worker(local_rank, local_rank, subprocess.Popen(command), None, "")

    running, late = worker(0, "sleep", "30"), worker(1, "false")
    late.popen.wait()
    assert first_failure([running, late]) is late  # seen failing, at this look
    early = worker(0, "false")
    early.popen.wait()
    assert first_failure([early, late]) is late  # rank 0's exit is seen after rank 1's
    assert first_failure([running, worker(2, "true")]) is None
    running.popen.kill()
    running.popen.wait()
    twins = [worker(0, "false"), worker(1, "false")]
    for twin in twins:
        twin.popen.wait()
    assert first_failure(twins) is twins[0]  # seen in the same look: by local rank
