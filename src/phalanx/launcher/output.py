"""Workers' output: to the console, raw in log files, the stderr tail kept; and the
traceback that ended a worker, found in that tail or in torch elastic's error file.

Every worker's stdout and stderr are pipes the launcher reads. Each chunk goes to

* the console (:class:`~phalanx.launcher.console.Console`), every line prefixed ``[rankN]: ``;
* the worker's log files under ``--log-dir``, unchanged;
* a bounded tail of stderr, from which the failure summary takes the end of the traceback.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import BinaryIO

from ..env import DIAGNOSIS_NAME
from .config import STDERR
from .console import Console

# Enough stderr to hold the end of any traceback, small enough to keep per worker and to send
# to the other nodes in a round's end record.
_TAIL_BYTES = 64 * 1024
# Lines of traceback the summary shows: the exception line and the frames nearest to it.
TRACEBACK_LINES = 20


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

    def exception_line(self, entry: str | None = None) -> str:
        """The exception line of :meth:`traceback` (see :func:`exception_line`)."""
        return exception_line(self.traceback(entry))


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


def exception_line(traceback: str) -> str:
    """A traceback's last line, its exception, without torch's rank prefix (``""``: none)."""
    lines = traceback.strip().splitlines()
    return _body(lines[-1]).strip() if lines else ""


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


def read_diagnosis(error_file: str) -> tuple[str, list[int]] | None:
    """The hang report a worker wrote beside its ``TORCHELASTIC_ERROR_FILE`` before it failed
    (:mod:`phalanx.diagnostics.hang`): ``(report, the ranks it blames)``, or ``None``."""
    path = os.path.join(os.path.dirname(error_file), DIAGNOSIS_NAME)
    try:
        with open(path) as f:
            data = json.load(f)
        return str(data["report"]), [int(r) for r in data["culprits"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
