"""The store's gate, doors and locked inner store (phalanx.gate), in one process and its
children: a client without the secret, or a process the door does not know, reads and writes
nothing."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from phalanx.gate import handshake, peers
from phalanx.gate.inner import InnerStore
from phalanx.gate.listen import listen
from phalanx.gate.relay import Door, Gate, dial_gate, splice, wait_for_gate
from phalanx.gate.secret import check_secret, read_secret_file

KEY = b"unit-test-secret-0123456789"
# A plain TCPStore client that must not get in gives up after this long.
_SHORT = timedelta(seconds=1)


def test_secrets_too_short_or_open_to_others_are_refused(tmp_path):
    with pytest.raises(ValueError, match="has 5 characters; expected at least 16"):
        check_secret(" short\n", "PHALANX_JOB_SECRET")
    assert check_secret(" a-long-enough-secret\n", "x") == b"a-long-enough-secret"
    path = tmp_path / "secret"
    path.write_text("a-long-enough-secret\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"has mode 0644: others may read or change it; "
                                         r"expected 0600 \(chmod 600 "):
        read_secret_file(str(path))
    path.chmod(0o600)
    assert read_secret_file(str(path)) == "a-long-enough-secret\n"
    with pytest.raises(ValueError, match="is not a regular file"):
        read_secret_file(str(tmp_path))


def _pair_handshake(server_key: bytes, client_key: bytes):
    gate_end, client_end = socket.socketpair()
    served = {}
    thread = threading.Thread(target=lambda: served.update(r=handshake.serve(gate_end, server_key)))
    thread.start()
    try:
        handshake.greet(client_end, client_key, "workers", "node-a")
        outcome = "ok"
    except handshake.Refused as e:
        outcome = str(e)
    thread.join()
    return served["r"], outcome


def test_handshake_proves_the_secret_both_ways():
    assert _pair_handshake(KEY, KEY) == (("workers", "node-a"), "ok")
    assert _pair_handshake(KEY, b"another-job-secret-123") == (None, "the gate refused this job secret")
    gate_end, client_end = socket.socketpair()
    gate_end.sendall(b"SSH-2.0-OpenSSH_9.6\n")
    with pytest.raises(handshake.Refused, match="not a phalanx gate"):
        handshake.greet(client_end, KEY, "rdzv")


_CONNECT = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("connected", flush=True)
time.sleep(5)
"""


def test_a_door_knows_which_process_connected():
    listener = listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    mine = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    assert peers.connected_by(conn, [os.getpid()]) == os.getpid()
    child = subprocess.Popen([sys.executable, "-c", _CONNECT, str(port)], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        theirs, _ = listener.accept()
        assert peers.connected_by(theirs, [os.getpid()]) is None
        assert peers.connected_by(theirs, peers.descendants(os.getpid())) == child.pid
    finally:
        child.kill()
        child.wait()
    for sock in (mine, conn, theirs, listener):
        sock.close()


def _refused(make_client) -> str:
    try:
        make_client().set("evil", "1")
    except (RuntimeError, OSError) as e:  # DistNetworkError, DistStoreError, timeouts
        return type(e).__name__
    return "wrote a key"


_OTHER_PROCESS = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
s.sendall(b"any bytes at all")
try:
    print("closed unread" if s.recv(1) == b"" else "answered")
except ConnectionResetError:  # closed with our bytes unread: the kernel answers with a reset
    print("closed unread")
"""


def test_without_the_secret_nothing_is_read_or_written():
    inner = InnerStore(30, pytest.fail)
    assert inner.signed  # this kernel has TCP-MD5: the loopback store is locked
    gate = listen("127.0.0.1", 0)
    gate_port = gate.getsockname()[1]
    refusals, left = [], []
    Gate(gate, KEY, lambda store: inner.connect(), lambda node, closed: left.append((node, closed)),
         refusals.append)
    door = Door(listen("127.0.0.1", 0), lambda: [os.getpid()],
                lambda: dial_gate("127.0.0.1", gate_port, KEY, "rdzv", "n1"), refusals.append, "d")
    wait_for_gate("127.0.0.1", gate_port, KEY, time.monotonic() + 10)
    # the secret's holder, through its door: reads and writes
    member = dist.TCPStore("127.0.0.1", door.port, None, False, timedelta(seconds=10))
    member.set("k", "v")
    assert inner.store.get("k") == b"v"
    keys = inner.store.num_keys()
    # a plain client at the gate, at the locked store itself, and another process at the door
    assert _refused(lambda: dist.TCPStore("127.0.0.1", gate_port, None, False, _SHORT)) != "wrote a key"
    assert _refused(lambda: dist.TCPStore("127.0.0.1", inner.port, None, False, _SHORT)) != "wrote a key"
    with pytest.raises(handshake.Refused):
        dial_gate("127.0.0.1", gate_port, b"another-job-secret-123", "rdzv")
    other = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(door.port)],
                           capture_output=True, text=True, timeout=60)
    assert other.stdout.strip() == "closed unread", other.stdout + other.stderr
    assert inner.store.num_keys() == keys and not inner.store.check(["evil"])
    assert any("did not prove this job's secret" in r for r in refusals), refusals
    assert any("not a process of this job" in r for r in refusals), refusals
    del member  # the node's last rdzv connection closes: the gate reports it gone
    deadline = time.monotonic() + 10
    while not left and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == [("n1", True)]  # closed by its end: exited, not unreachable


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with listen("127.0.0.1", 0) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    return client, accepted


@pytest.mark.parametrize("how", ["close", "reset"])
def test_splice_says_the_other_end_ended_it(how):
    """A peer that closes (FIN) or resets (RST: its process is gone, its machine answers)
    ended the connection itself: True, which the gate reports as ``exited``, not as
    ``unreachable`` (a silent peer dropped by keepalive, which the network tests cut)."""
    remote, near = _tcp_pair()
    store, far = _tcp_pair()
    result = []
    thread = threading.Thread(target=lambda: result.append(splice(near, store)))
    thread.start()
    remote.sendall(b"x")
    assert far.recv(1) == b"x"
    if how == "reset":  # linger on, for 0 s: close sends a reset
        remote.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    remote.close()
    thread.join(10)
    assert result == [True]
    far.close()
