"""``python -m phalanx.launcher.storehost FD HOST PORT``: serve one round's workers' store.

Node 0's launcher starts one of these for every round, handing it the listening socket
(file descriptor ``FD``, bound to ``HOST:PORT``), and kills it when the round ends, so each
round starts from an empty store. Hosting the store in this child rather than in the launcher
keeps torch's import (seconds of CPU) off the launcher: the child imports torch while the
workers import theirs, and the launcher never waits for it.
"""

from __future__ import annotations

import signal
import sys
from datetime import timedelta

# The server's own client (a TCPStore master connects to itself) uses this for its operations;
# torch's TCPStore default.
_TIMEOUT = timedelta(seconds=300)


def main(argv: list[str] | None = None) -> None:
    fd, host, port = (argv if argv is not None else sys.argv[1:])
    import torch.distributed as dist

    store = dist.TCPStore(  # noqa: F841 - serves for as long as it exists
        host, int(port), None, True, _TIMEOUT, wait_for_workers=False, master_listen_fd=int(fd)
    )
    while True:  # until the launcher ends the round (SIGKILL) or dies (parent-death signal)
        signal.pause()


if __name__ == "__main__":
    main()
