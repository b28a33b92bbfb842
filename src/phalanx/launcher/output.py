"""Workers' output: rank-prefixed on the console, raw in log files, the stderr tail kept.

Every worker's stdout and stderr are pipes the launcher reads. Each chunk goes to

* the console (the launcher's own stdout/stderr), every line prefixed ``[rankN]: ``;
  a carriage return (``\\r``, how tqdm redraws its bar in place) starts a new prefixed
  segment on the same terminal line, so a progress bar stays one updating line;
* the worker's log files under ``--log-dir``, unchanged;
* a bounded tail of stderr, from which the failure summary takes the end of the traceback.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import BinaryIO

from .config import STDERR, STDOUT

# Enough stderr to hold the end of any traceback, small enough to keep per worker and to send
# to the other nodes in a round's end record.
_TAIL_BYTES = 64 * 1024
# Lines of traceback the summary shows: the exception line and the frames nearest to it.
TRACEBACK_LINES = 20
_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|[\r\n])?")


@dataclass
class _Source:
    rank: int
    stream: int
    mid_line: bool = False  # a prefix and some text are out, with no terminator yet


class Console:
    """Rank-prefixed writing of workers' output to the launcher's stdout and stderr.

    Output of one worker may interleave with another's. When a worker writes while another's
    line is unfinished (a progress bar, a prompt), that line is ended first, so no text lands
    in the middle of another rank's line.

    Args:
        out (binary file): where workers' stdout goes.
        err (binary file): where workers' stderr and the launcher's own messages go.
    """

    def __init__(self, out: BinaryIO, err: BinaryIO) -> None:
        self._files = {STDOUT: out, STDERR: err}
        self._sources: dict[tuple[int, int], _Source] = {}
        self._owner: _Source | None = None  # the source whose line the cursor is on

    def write(self, rank: int, stream: int, data: bytes) -> None:
        """Show ``data`` from ``rank``'s ``stream`` (STDOUT or STDERR)."""
        source = self._sources.setdefault((rank, stream), _Source(rank, stream))
        out = self._files[stream]
        for segment in _SEGMENT.findall(data):
            if not segment:
                continue
            text = segment.rstrip(b"\r\n")
            end = segment[len(text):]
            self._take_line(source)
            if text:
                if not source.mid_line:
                    prefix = b"[rank%d]: " % rank
                    # torch's excepthook prefixes traceback lines itself once a group exists
                    if not text.startswith(prefix.rstrip()):
                        out.write(prefix)
                    source.mid_line = True
                out.write(text)
            if end:
                out.write(end)
                source.mid_line = False
                # after "\r" the cursor sits on a line that still shows this source's text
                self._owner = source if end == b"\r" else None
        out.flush()

    def _take_line(self, source: _Source) -> None:
        owner = self._owner
        if owner is not None and owner is not source:
            self._files[owner.stream].write(b"\n")
            self._files[owner.stream].flush()
            owner.mid_line = False
        self._owner = source

    def note(self, message: str) -> None:
        """A message of the launcher's own, on stderr, each line prefixed ``[phalanx]``."""
        self._take_line(_Source(-1, STDERR))
        self._owner = None
        err = self._files[STDERR]
        for line in message.splitlines() or [""]:
            err.write(f"[phalanx] {line}\n".encode())
        err.flush()


@dataclass
class WorkerOutput:
    """Where one worker's two streams go: console (per stream), log files, stderr tail."""

    rank: int
    console: Console
    console_streams: int
    log_paths: dict[int, str] = field(default_factory=dict)
    tail: bytearray = field(default_factory=bytearray)

    def __post_init__(self) -> None:
        self._logs: dict[int, BinaryIO] = {}
        for stream, path in self.log_paths.items():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._logs[stream] = open(path, "wb")

    def feed(self, stream: int, data: bytes) -> None:
        if stream == STDERR:
            self.tail += data
            del self.tail[:-_TAIL_BYTES]
        log = self._logs.get(stream)
        if log is not None:
            log.write(data)
            log.flush()
        if self.console_streams & stream:
            self.console.write(self.rank, stream, data)

    def close(self) -> None:
        for log in self._logs.values():
            log.close()
        self._logs.clear()

    def traceback(self, max_lines: int = TRACEBACK_LINES) -> str:
        """The end of this worker's stderr: its last traceback, or the last lines."""
        return traceback_tail(self.tail.decode("utf-8", errors="replace"), max_lines)


def traceback_tail(text: str, max_lines: int = TRACEBACK_LINES) -> str:
    """The last traceback in ``text`` (at most ``max_lines``, keeping its end, where the
    exception line is), or its last ``max_lines // 2`` non-empty lines if it holds none.

    Lines are taken as a terminal shows them: only what follows a line's last ``\\r``.
    """
    lines = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]
    lines = [line for line in lines if line.strip()]
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last):" in line]
    if starts:
        block = lines[starts[-1]:]
        if len(block) > max_lines:
            block = [block[0], "  ..."] + block[-(max_lines - 2):]
        return "\n".join(block)
    return "\n".join(lines[-(max_lines // 2):])
