"""phalanx's log records follow the program's logging set-up (each case in a fresh interpreter,
as pytest configures logging itself)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.launch_helpers import base_env

_LOG = ("from phalanx._logging import get_logger\n"
        "log = get_logger('phalanx.demo')\n"
        "log.debug('debug line'); log.info('info line'); log.warning('warning line')\n")


def _run(setup: str, **env: str | None) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", "import logging, sys\n" + setup + "\n" + _LOG],
                          env=base_env(**env), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


@pytest.mark.parametrize("setup, out, err", [
    # nothing configured: phalanx writes INFO and up itself, with the rank
    ("", "", "[rank0] phalanx.demo: info line\n[rank0] phalanx.demo: warning line\n"),
    # the program's handler and format, at the program's level; phalanx's handler stands aside
    ("logging.basicConfig(stream=sys.stdout, level=logging.DEBUG,"
     " format='%(levelname)s %(name)s rank=%(rank)s %(message)s')",
     "INFO phalanx.demo rank=0 info line\nWARNING phalanx.demo rank=0 warning line\n", ""),
    ("logging.basicConfig(stream=sys.stdout, level=logging.WARNING)",
     "WARNING:phalanx.demo:warning line\n", ""),
    # phalanx's level, set the usual way, with or without a configuration
    ("logging.getLogger('phalanx').setLevel(logging.WARNING)",
     "", "[rank0] phalanx.demo: warning line\n"),
    ("logging.basicConfig(stream=sys.stdout, level=logging.WARNING);"
     " logging.getLogger('phalanx').setLevel(logging.DEBUG)",
     "DEBUG:phalanx.demo:debug line\nINFO:phalanx.demo:info line\n"
     "WARNING:phalanx.demo:warning line\n", ""),
    # a handler on "phalanx" itself: phalanx's level (INFO), whatever the root's, and the
    # records propagate to the root's handlers as any logger's with a level of its own
    ("logging.basicConfig(stream=sys.stdout, level=logging.WARNING);"
     " logging.getLogger('phalanx').addHandler(logging.StreamHandler(sys.stderr))",
     "INFO:phalanx.demo:info line\nWARNING:phalanx.demo:warning line\n",
     "info line\nwarning line\n"),
    # a handler on "phalanx" itself, not propagating: only the program's handler writes
    ("h = logging.StreamHandler(sys.stdout); logging.getLogger('phalanx').addHandler(h);"
     " logging.getLogger('phalanx').propagate = False",
     "info line\nwarning line\n", ""),
])
def test_records_follow_the_programs_logging_configuration(setup, out, err):
    assert _run(setup) == (out, err)


def test_under_phalanx_run_the_launcher_prefixes_the_rank():
    assert _run("", PHALANX_RANK_PREFIX="1", RANK="1", WORLD_SIZE="2", MASTER_ADDR="h",
                MASTER_PORT="1") == ("", "phalanx.demo: info line\nphalanx.demo: warning line\n")
