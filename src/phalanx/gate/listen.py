"""Sockets bound to one interface, never to all of them, and connections that notice a
vanished peer.

Every listening socket phalanx opens is bound to a named address (the master's, or
loopback), so nothing listens on ``0.0.0.0``/``::``. Long-lived connections between
machines get TCP keepalive, so a peer whose machine died (no FIN, no RST) is noticed within
about :data:`DEAD_PEER_S` seconds instead of the kernel's two hours.
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"
# Keepalive: first probe after 5 s idle, then every 2 s; 3 unanswered probes drop the
# connection, so a dead peer is noticed ~11 s after it fell silent (Linux defaults: 2 h).
_KEEPIDLE_S, _KEEPINTVL_S, _KEEPCNT = 5, 2, 3
DEAD_PEER_S = _KEEPIDLE_S + _KEEPINTVL_S * _KEEPCNT
# Unacknowledged data for this long also drops it (TCP_USER_TIMEOUT, in ms; RFC 5482).
_USER_TIMEOUT_MS = DEAD_PEER_S * 1000


def resolve(host: str, port: int) -> tuple[int, tuple]:
    """``(family, sockaddr)`` of ``host:port``; raises ``socket.gaierror``."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host.strip("[]"), port,
                                                   type=socket.SOCK_STREAM)[0]
    return family, sockaddr


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``'s interface only, at ``port`` (0: a free one).

    Raises:
        OSError: EADDRINUSE (port taken), EADDRNOTAVAIL (not an address of this host)...
        socket.gaierror: ``host`` does not resolve.
    """
    family, sockaddr = resolve(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Lets a relaunch bind a port whose previous connections linger in TIME_WAIT; a port
        # someone listens on is still refused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)  # every worker of every node may connect at once
    except OSError:
        sock.close()
        raise
    return sock


def keepalive(sock: socket.socket) -> socket.socket:
    """Turn on keepalive probes and the user timeout (see the module docstring)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in ((socket.TCP_KEEPIDLE, _KEEPIDLE_S), (socket.TCP_KEEPINTVL, _KEEPINTVL_S),
                          (socket.TCP_KEEPCNT, _KEEPCNT), (socket.TCP_USER_TIMEOUT, _USER_TIMEOUT_MS)):
        sock.setsockopt(socket.IPPROTO_TCP, option, value)
    return sock
