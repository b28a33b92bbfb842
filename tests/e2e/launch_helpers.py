"""Running ``phalanx run`` (and torchrun) as real processes, for the launcher tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from phalanx.bench import netns

SCRIPTS = Path(__file__).resolve().parent / "scripts"
BEHAVE = str(SCRIPTS / "behave.py")
TRAIN = str(SCRIPTS / "train_tiny.py")
ROOT = Path(__file__).resolve().parents[2]
# The job secret the launchers of several nodes share in these tests (PHALANX_JOB_SECRET).
SECRET = "phalanx-tests-job-secret-0123456789"


@dataclass
class Finished:
    code: int
    out: str
    err: str
    seconds: float


def base_env(**extra: str | None) -> dict[str, str]:
    """This environment, without launcher variables a test runner may carry, plus ``extra``
    (``PHALANX_JOB_SECRET`` among the variables dropped: pass it when a test needs it)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "PET_", "PHALANX_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def node_env(**extra: str | None) -> dict[str, str]:
    """:func:`base_env` with the tests' job secret, for launchers of several nodes."""
    return base_env(PHALANX_JOB_SECRET=SECRET, **extra)


def phalanx_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", "run", *args]


def start(cmd: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    # bytes, decoded below: text mode would turn the "\r" of progress bars into newlines
    return subprocess.Popen(cmd, env=env or base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


def finish(proc: subprocess.Popen, timeout: float = 120, began: float | None = None) -> Finished:
    began = time.monotonic() if began is None else began
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"launcher did not finish in {timeout} s\n{out}\n{err}")
    return Finished(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"),
                    time.monotonic() - began)


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> Finished:
    began = time.monotonic()
    return finish(start(cmd, env), timeout, began)


def wait_for_files(paths: list[Path], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise AssertionError(f"never appeared: {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Running (a zombie is dead: it only waits for init to reap it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_all_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s; return the pids still alive then."""
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@contextlib.contextmanager
def veth_namespaces():
    """Two network namespaces joined by a veth pair: (ns, interface, address) for each
    (phalanx.bench.netns, which the slow-link benchmark uses too); skips without root."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    try:
        with netns.veth_namespaces("phx", "10.213.0") as nodes:
            yield nodes
    except netns.NamespaceError as e:
        if e.nothing_created:  # root, but not allowed to (no CAP_SYS_ADMIN, say)
            pytest.skip(f"cannot create a network namespace: {e}")
        raise


def in_namespace(ns: str, cmd: list[str]) -> list[str]:
    """``cmd`` run inside network namespace ``ns`` (``ip netns exec`` execs it: same pid)."""
    return ["ip", "netns", "exec", ns, *cmd]


def listening_addresses(ss_output: str) -> list[tuple[str, int]]:
    """``(address, port)`` of each listening socket in ``ss -ltnH`` output (IPv6 without
    brackets; ``*`` and ``::``/``0.0.0.0`` are the wildcards)."""
    found = []
    for line in ss_output.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            host, _, port = fields[3].rpartition(":")
            found.append((host.strip("[]").split("%")[0], int(port)))
    return found


WILDCARDS = ("0.0.0.0", "::", "*")


def tree_listeners(pid: int) -> list[tuple[int, str, int]]:
    """``(pid, address, port)`` of every listening TCP socket of ``pid`` and its descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    found = []
    for proc in procs:
        try:
            found += [(proc.pid, c.laddr[0], c.laddr[1]) for c in proc.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return found


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise netns.NamespaceError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}", False)


@contextlib.contextmanager
def bridged_namespaces(count: int):
    """``count`` network namespaces ("machines") on one bridge, which lives in a namespace
    of its own: ``(ns, interface, address)`` for each; skips without root. Cut a machine off
    with :func:`set_link`."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and the `ip` command")
    tag = os.getpid() % 100000  # names are short: interfaces have 15 characters at most
    hub = f"phxh{tag}"
    nodes = [(f"phx{tag}n{i}", f"vphx{tag}n{i}", f"10.214.0.{i + 1}") for i in range(count)]
    created: list[str] = []
    try:
        for ns in [hub, *(n for n, _, _ in nodes)]:
            _ip("netns", "add", ns)
            created.append(ns)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, (ns, dev, addr) in enumerate(nodes):
            port = f"hphx{tag}n{i}"
            _ip("link", "add", dev, "type", "veth", "peer", "name", port)
            _ip("link", "set", dev, "netns", ns)
            _ip("link", "set", port, "netns", hub)
            _ip("-n", hub, "link", "set", port, "master", "br0")
            _ip("-n", hub, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield nodes
    except netns.NamespaceError as e:
        if not created:
            pytest.skip(f"cannot create a network namespace: {e}")
        raise
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def set_link(ns: str, dev: str, state: str) -> None:
    """``ip link set DEV up|down`` in ``ns``: down cuts that machine off (no FIN, no RST)."""
    _ip("-n", ns, "link", "set", dev, state)
