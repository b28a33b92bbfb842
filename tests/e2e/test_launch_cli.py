"""phalanx run's command line: parsing, bad input (exit 2), rendezvous errors, console output.

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
from phalanx.launcher import LaunchConfig, StreamChoice
from phalanx.launcher.output import Console, traceback_tail
from tests.e2e.launch_helpers import BEHAVE, ROOT, base_env
from tests.harness import free_port


def _main(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


def _config(*argv: str) -> LaunchConfig:
    return cli.config_from_args(cli.build_parser().parse_args(["run", *argv]))


def test_dashed_and_underscored_spellings_mean_the_same():
    dashed = _config("--nproc-per-node", "3", "--nnodes", "2", "--node-rank", "1",
                     "--master-addr", "10.1.2.3", "--master-port", "1234", "--max-restarts", "2",
                     "--monitor-interval", "0.5", "--shutdown-timeout", "7", "--rdzv-timeout", "9",
                     "--rdzv-id", "job", "--log-dir", "/tmp/x", "--tee", "1", BEHAVE, "a", "--b")
    under = _config("--nproc_per_node", "3", "--nnodes", "2", "--node_rank", "1",
                    "--master_addr", "10.1.2.3", "--master_port", "1234", "--max_restarts", "2",
                    "--monitor_interval", "0.5", "--shutdown_timeout", "7", "--rdzv_timeout", "9",
                    "--rdzv_id", "job", "--log_dir", "/tmp/x", "--tee", "1", BEHAVE, "a", "--b")
    assert dashed == under
    assert (dashed.nproc_per_node, dashed.nnodes, dashed.node_rank) == (3, 2, 1)
    assert (dashed.master_addr, dashed.master_port, dashed.max_restarts) == ("10.1.2.3", 1234, 2)
    assert (dashed.monitor_interval, dashed.shutdown_timeout, dashed.rdzv_timeout) == (0.5, 7, 9)
    assert dashed.args == ("a", "--b") and dashed.console == StreamChoice(1)
    assert dashed.command == [sys.executable, BEHAVE, "a", "--b"]


def test_defaults_module_mode_and_stream_choices():
    config = _config(BEHAVE)
    assert (config.nproc_per_node, config.master_addr, config.master_port) == (1, "127.0.0.1", 29500)
    assert (config.monitor_interval, config.shutdown_timeout, config.max_restarts) == (0.1, 30, 0)
    assert _config("-m", "json.tool", "x").command == [sys.executable, "-m", "json.tool", "x"]
    assert _config("--nproc-per-node", "cpu", BEHAVE).nproc_per_node >= 1
    hidden = _config("--log-dir", "/tmp/x", "--redirects", "0:1", BEHAVE).console
    assert [hidden.for_rank(r) for r in (0, 1)] == [2, 3]  # rank 0's stdout off the console
    shown = _config("--log-dir", "/tmp/x", "--tee", "0:3,2:2", BEHAVE).console
    assert [shown.for_rank(r) for r in (0, 1, 2)] == [3, 0, 2]


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
    (["--tee", "3", "--redirects", "1", "--log-dir", "d", BEHAVE], "not both"),
    (["--tee", "1", BEHAVE], "need --log-dir"),
    (["--log-dir", "d", "--tee", "9", BEHAVE], "Invalid --tee '9'"),
    (["--bogus", BEHAVE], "unrecognized arguments: --bogus"),
    (["--nnodes", "two", BEHAVE], "argument --nnodes: invalid int value: 'two'"),
    ([], "the following arguments are required: script"),
])
def test_bad_input_exits_2_with_a_clear_message(capsys, argv, message):
    code, err = _main(capsys, "run", *argv)
    assert code == 2
    assert message in err


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


def test_unreachable_master_fails_within_the_timeout_naming_it(capsys):
    port = free_port()  # nothing listens there
    began = time.monotonic()
    code, err = _main(capsys, "run", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                      "127.0.0.1", "--master-port", str(port), "--rdzv-timeout", "1.5",
                      BEHAVE, "--record", ".")
    took = time.monotonic() - began
    assert code == 1
    assert f"Node 1 could not reach the master at 127.0.0.1:{port} within 1.5 s (--rdzv-timeout)" in err
    assert 1.5 <= took < 6, took


def test_the_launcher_starts_without_importing_torch():
    # torch costs seconds of CPU to import; the launcher of one node never needs it itself
    code = ("import sys, phalanx.cli, phalanx.launcher.agent; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", code], env=base_env(), cwd=ROOT)
    assert done.returncode == 0, "phalanx.cli imports torch: keep phalanx/__init__.py lazy"


def test_console_prefixes_lines_and_keeps_progress_bars_on_one_line():
    out, err = io.BytesIO(), io.BytesIO()
    console = Console(out, err)
    console.write(0, 2, b"\rbar 1/3")
    console.write(0, 2, b"\rbar 2/3")
    console.write(1, 1, b"hello\nwor")  # another rank: the bar's line is ended first
    console.write(1, 1, b"ld\n")
    console.write(0, 2, b"\rbar 3/3\n")
    console.write(2, 2, b"[rank2]: torch's own prefix\n")  # not doubled
    console.note("restarting\nnow")
    assert out.getvalue() == b"[rank1]: hello\n[rank1]: world\n"
    assert err.getvalue() == (b"\r[rank0]: bar 1/3\r[rank0]: bar 2/3\n"
                              b"\r[rank0]: bar 3/3\n[rank2]: torch's own prefix\n"
                              b"[phalanx] restarting\n[phalanx] now\n")


def test_traceback_tail_takes_the_last_traceback_as_a_terminal_shows_it():
    text = ("progress\r 50%\r100%\nTraceback (most recent call last):\n  old\nKeyError: 1\n"
            "During handling...\n[rank1]: Traceback (most recent call last):\n"
            + "".join(f'[rank1]:   File "f.py", line {i}\n' for i in range(30))
            + "[rank1]: ValueError: boom\n")
    tail = traceback_tail(text, max_lines=6).splitlines()
    assert tail[0] == "[rank1]: Traceback (most recent call last):" and tail[1] == "  ..."
    assert tail[-1] == "[rank1]: ValueError: boom" and len(tail) == 6
    assert traceback_tail("a\nb\r c\n\n", max_lines=20) == "a\n c"
