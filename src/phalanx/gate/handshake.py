"""The gate's handshake: proof of the job secret before a single byte reaches the store.

It happens once per connection, before the connection is spliced through to torch's
``TCPStore``; after it, the bytes on the wire are the store's own, untouched (this is not a
store protocol: it never carries a key or a value). Three lines of ASCII::

    gate   -> client   "phalanx-gate/1 <gate nonce>"
    client -> gate     "<store> <node> <client nonce> <HMAC-SHA256(secret, client fields)>"
    gate   -> client   "ok <HMAC-SHA256(secret, gate fields)>"   or   "refused"

Both sides prove they hold the secret, each over the other's fresh nonce, so a recorded
handshake cannot be replayed and a client learns whether it reached its own job's gate.
``store`` says which store the connection is for (``rdzv``: the launchers'; ``workers``: the
workers' store of the current round; ``probe``: none, a check of the secret); ``node`` is the
connecting launcher's id (``-`` for none), so the gate knows which node a connection speaks for.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import socket

GREETING = "phalanx-gate/1"
STORES = ("rdzv", "workers", "probe")
# Handshakes are three short lines; 10 s is ample on any network a job runs on, and bounds
# what a silent client can hold.
HANDSHAKE_TIMEOUT_S = 10.0
_NONCE_BYTES = 16  # 128 bits: never repeats
_LINE_MAX = 512  # the longest valid line is under 200 bytes
_NODE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class Refused(Exception):
    """The other side does not hold our secret (or is not a phalanx gate)."""


class Silent(ConnectionError):
    """The other side closed the connection before it sent anything."""


def _mac(key: bytes, *fields: str) -> str:
    return hmac.new(key, "\0".join(fields).encode(), hashlib.sha256).hexdigest()


def _read_line(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)  # byte by byte: nothing after the line may be consumed
        if not chunk:
            raise (ConnectionError if data else Silent)(
                "the other side closed the connection during the handshake")
        data += chunk
        if len(data) > _LINE_MAX:
            raise Refused("handshake line too long")
    return data[:-1].decode("ascii", errors="replace")


def serve(sock: socket.socket, key: bytes) -> tuple[str, str] | None:
    """The gate's side. Returns ``(store, node)`` for a client that proved the secret, else
    ``None`` (it has been told ``refused``). Raises ``OSError`` on a broken connection."""
    nonce = secrets.token_hex(_NONCE_BYTES)
    sock.sendall(f"{GREETING} {nonce}\n".encode())
    try:
        store, node, theirs, mac = _read_line(sock).split(" ")
    except (ValueError, Refused):
        store = node = theirs = mac = ""
    valid = store in STORES and _NODE.fullmatch(node) and len(theirs) == 2 * _NONCE_BYTES
    expected = _mac(key, "client", nonce, theirs, store, node)
    if not valid or not hmac.compare_digest(mac, expected):
        sock.sendall(b"refused\n")
        return None
    sock.sendall(f"ok {_mac(key, 'gate', theirs, nonce)}\n".encode())
    return store, node


def greet(sock: socket.socket, key: bytes, store: str, node: str = "-") -> None:
    """The client's side: prove the secret for ``store``; return once the gate has proved it
    too. Afterwards the socket carries the store's bytes.

    Raises:
        Refused: the gate refused our secret, or it is not a gate of this job.
        OSError: the connection broke.
    """
    greeting = _read_line(sock).split(" ")
    if len(greeting) != 2 or greeting[0] != GREETING:
        raise Refused(f"not a phalanx gate (it said {' '.join(greeting)[:40]!r})")
    nonce, mine = greeting[1], secrets.token_hex(_NONCE_BYTES)
    sock.sendall(f"{store} {node} {mine} {_mac(key, 'client', nonce, mine, store, node)}\n".encode())
    answer = _read_line(sock).split(" ")
    if answer[0] == "refused":
        raise Refused("the gate refused this job secret")
    if answer[0] != "ok" or len(answer) != 2 or not hmac.compare_digest(
            answer[1], _mac(key, "gate", mine, nonce)):
        raise Refused("the gate does not hold this job secret (another job's store?)")
