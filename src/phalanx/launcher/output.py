"""Workers' output: rank-prefixed on the console, raw in log files, the stderr tail kept.

Every worker's stdout and stderr are pipes the launcher reads. Each chunk goes to

* the console (the launcher's own stdout/stderr), every line prefixed ``[rankN]: ``;
  a carriage return (``\\r``, how tqdm redraws its bar in place) starts a new prefixed
  segment on the same terminal line, so a progress bar stays one updating line;
* the worker's log files under ``--log-dir``, unchanged;
* a bounded tail of stderr, from which the failure summary takes the end of the traceback.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import BinaryIO

from .config import STDERR, STDOUT

# Enough stderr to hold the end of any traceback, small enough to keep per worker and to send
# to the other nodes in a round's end record.
_TAIL_BYTES = 64 * 1024
# Lines of traceback the summary shows: the exception line and the frames nearest to it.
TRACEBACK_LINES = 20
_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|[\r\n])?")


# An unterminated line is held back this long for the rest of it: print() writes its
# arguments in separate writes, which would otherwise be cut apart by another rank's line.
# Longer-lived partial lines (a progress bar between redraws) are shown after this delay.
PARTIAL_LINE_S = 0.2


@dataclass
class _Source:
    rank: int
    stream: int
    mid_line: bool = False  # a prefix and some text are out, with no terminator yet
    held: bytes = b""  # the start of a line not shown yet
    held_since: float = 0.0


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
        """Show the complete lines of ``data`` from ``rank``'s ``stream`` (STDOUT or STDERR);
        hold an unfinished last line back (see :meth:`flush`)."""
        source = self._sources.setdefault((rank, stream), _Source(rank, stream))
        data = source.held + data
        cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1  # after the last terminator
        if cut < len(data) and (cut or not source.held):  # a new unfinished line begins
            source.held_since = time.monotonic()
        source.held = data[cut:]
        if cut:
            self._show(source, data[:cut])

    def flush(self, older_than: float = PARTIAL_LINE_S) -> None:
        """Show the unfinished lines held back for at least ``older_than`` seconds."""
        now = time.monotonic()
        for source in self._sources.values():
            if source.held and now - source.held_since >= older_than:
                held, source.held = source.held, b""
                self._show(source, held)

    def _show(self, source: _Source, data: bytes) -> None:
        rank, out = source.rank, self._files[source.stream]
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

    def traceback(self, entry: str | None = None, max_lines: int = TRACEBACK_LINES) -> str:
        """The traceback that ended this worker, from its stderr (see :func:`traceback_tail`)."""
        return traceback_tail(self.tail.decode("utf-8", errors="replace"), entry, max_lines)


def traceback_tail(text: str, entry: str | None = None, max_lines: int = TRACEBACK_LINES) -> str:
    """The traceback in ``text`` that ended the process, cut at its exception line, at most
    ``max_lines`` (its header, then the frames nearest to the exception); or the last
    ``max_lines // 2`` non-empty lines if ``text`` holds no traceback.

    A worker's stderr may hold several tracebacks: one printed and survived, a child's
    (multiprocessing's resource tracker complains at exit), chained exceptions, and warnings
    after the last. The one shown is the last among the first non-empty of: those with a frame
    in the file ``entry`` (the worker's script), those with a frame at a module's top level
    (``in <module>``: the exception reached the main script's top), all of them.

    Lines are taken as a terminal shows them: only what follows a line's last ``\\r``.
    """
    lines = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]
    lines = [line for line in lines if line.strip()]
    blocks = _traceback_blocks(lines)
    if not blocks:
        return "\n".join(lines[-(max_lines // 2):])
    entry = os.path.realpath(entry) if entry else None
    frames = [[_FRAME.match(_body(line)) for line in block] for block in blocks]
    in_entry = [b for b, f in zip(blocks, frames)
                if entry and any(m and os.path.realpath(m["file"]) == entry for m in f)]
    at_top = [b for b, f in zip(blocks, frames) if any(m and m["where"] == "<module>" for m in f)]
    block = (in_entry or at_top or blocks)[-1]
    if len(block) > max_lines:
        block = [block[0], "  ..."] + block[-(max_lines - 2):]
    return "\n".join(block)


_HEADER = "Traceback (most recent call last):"
# torch's excepthook prefixes every line of a rank's traceback with "[rankN]: ".
_RANK_PREFIX = re.compile(r"\[rank\d+\]: ?")
_FRAME = re.compile(r'\s*[|]?\s*File "(?P<file>[^"]+)", line \d+, in (?P<where>\S+)')


def _body(line: str) -> str:
    """A line without torch's rank prefix."""
    prefix = _RANK_PREFIX.match(line)
    return line[prefix.end():] if prefix else line


def _traceback_blocks(lines: list[str]) -> list[list[str]]:
    """Every traceback in ``lines``: from its header to its exception line, the first line after
    the header that is not indented (frames and source lines are). An exception group's
    traceback (``  + Exception Group Traceback``) puts a ``  | `` margin before its lines, which
    is taken off first; the tracebacks of its sub-exceptions, further in, belong to it."""
    blocks, i = [], 0
    while i < len(lines):
        body = _body(lines[i])
        margin = re.match(r"[ |+]*", body).group()
        if _HEADER not in body or "|" in margin:
            i += 1
            continue
        margin = margin.replace("+", "|")
        end = i + 1
        while end < len(lines) and _HEADER not in _body(lines[end]):
            rest = _body(lines[end])
            end += 1
            if rest.startswith(margin) and rest[len(margin):][:1] not in (" ", "\t", ""):
                break  # the exception line
        blocks.append(lines[i:end])
        i = end
    return blocks


def recorded_error(path: str) -> str | None:
    """What a script decorated with torch elastic's ``@record`` wrote to its
    ``TORCHELASTIC_ERROR_FILE`` when it failed: the traceback (``py_callstack``), else the
    message; ``None`` when there is no such file (undecorated scripts write none)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):  # torch's ErrorHandler.record_exception writes this shape
        message = (message.get("extraInfo") or {}).get("py_callstack") or message.get("message")
    return message if isinstance(message, str) and message.strip() else None
