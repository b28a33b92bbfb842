"""The launcher's console: every worker's lines, rank-prefixed, on its stdout and stderr.

* Each line starts with ``[rankN]: `` (unless turned off). A line a worker writes in pieces
  is held back a moment so another rank's line does not cut it apart, and a worker writing
  while another's line is unfinished gets a line of its own.
* A carriage return (``\\r``, how tqdm redraws its bar in place) starts a new prefixed segment
  on the same line, so in a terminal a progress bar stays one updating line; a bar cleared
  with blanks (tqdm's ``leave=False``) leaves an empty line behind, never a lone prefix.
* When the console is not a terminal (a file, a pipe, a CI log), redraws would pile up as
  lines: only a bar's last state is written when it ends or is cleared, and meanwhile at most
  one state every :data:`STATE_EVERY_S` seconds.
* After a failure the launcher can :meth:`Console.hold` the other ranks' output and
  :meth:`Console.release` it after its report, so the root cause comes first.
* A long line on stderr that another rank has printed already (the same error raised on every
  rank: phalanx's checks across ranks do that) is shown once; the next ranks' copies become
  ``(the same N-character line as rank R's above)``. The log files keep every copy.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import BinaryIO, Iterable

from .config import STDERR, STDOUT

_SEGMENT = re.compile(rb"[^\r\n]*(?:\r\n|[\r\n])?")
# An unterminated line is held back this long for the rest of it: print() writes its
# arguments in separate writes, which would otherwise be cut apart by another rank's line.
# Longer-lived partial lines (a progress bar between redraws) are shown after this delay.
PARTIAL_LINE_S = 0.2
# Off a terminal, one state of a redrawn line at most this often (seconds): a progress bar
# over a 10-minute epoch leaves 20 lines in a log instead of one per redraw.
STATE_EVERY_S = 30.0
# Held-back output of other ranks kept after a failure, at most (the rest is in --log-dir).
_HOLD_BYTES = 1 << 20
_ERASE_LINE = b"\r\x1b[K"  # to column 0, then clear to the end of the line (ANSI)
# A stderr line this long, printed by several ranks, is shown once: phalanx's reports that name
# many ranks or parameters run to 400-1,500 characters (issue 25 item 6 saw 1,489, on every
# rank), while its log lines, and traceback frames, stay under 300.
FOLD_MIN = 300
_FOLD_KEEP = 64  # long lines remembered, the oldest forgotten first
_TORCH_PREFIX = re.compile(rb"\[rank\d+\]: ?")  # torch's excepthook's, inside the text


@dataclass
class _Source:
    rank: int
    stream: int
    mid_line: bool = False  # a prefix and some text are out, with no terminator yet
    held: bytes = b""  # the start of a line not shown yet
    held_since: float = 0.0
    redrawn: bool = False  # the line now held or shown follows a "\r": a state to redraw
    blank: bool = False  # in a terminal: this source's current line shows nothing
    state: bytes = b""  # off a terminal: the latest state of a redrawn line, not written yet
    state_at: float = float("-inf")  # off a terminal: when a state was last written


def _isatty(file: BinaryIO) -> bool:
    isatty = getattr(file, "isatty", None)
    return bool(isatty and isatty())


class Console:
    """Rank-prefixed writing of workers' output to the launcher's stdout and stderr.

    Args:
        out (binary file): where workers' stdout goes.
        err (binary file): where workers' stderr and the launcher's own messages go.
        rank_prefix (bool): start each line with ``[rankN]: ``. Default ``True``.
    """

    def __init__(self, out: BinaryIO, err: BinaryIO, rank_prefix: bool = True) -> None:
        self._files = {STDOUT: out, STDERR: err}
        self._terminal = {STDOUT: _isatty(out), STDERR: _isatty(err)}
        self._rank_prefix = rank_prefix
        self._sources: dict[tuple[int, int], _Source] = {}
        self._owner: _Source | None = None  # the source whose line the cursor is on
        self._held_ranks: set[int] = set()
        self._held: list[tuple[int, int, bytes]] = []
        self._held_bytes = self._dropped = 0
        self._long_lines: dict[bytes, int] = {}  # a long stderr line -> the rank that showed it

    def write(self, rank: int, stream: int, data: bytes) -> None:
        """Show the complete lines of ``data`` from ``rank``'s ``stream`` (STDOUT or STDERR);
        hold an unfinished last line back (see :meth:`flush`)."""
        if rank in self._held_ranks:
            self._keep(rank, stream, data)
            return
        source = self._sources.setdefault((rank, stream), _Source(rank, stream))
        data = source.held + data
        cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1  # after the last terminator
        if cut < len(data) and (cut or not source.held):  # a new unfinished line begins
            source.held_since = time.monotonic()
        source.held = data[cut:]
        if cut:
            self._show(source, data[:cut])

    def flush(self, older_than: float = PARTIAL_LINE_S) -> None:
        """Show the unfinished lines held back for at least ``older_than`` seconds (``0``:
        everything held, the last states of redrawn lines included)."""
        now = time.monotonic()
        for source in self._sources.values():
            if not self._terminal[source.stream] and source.redrawn:
                self._flush_state(source, now, final=older_than <= 0, held=True)
                self._files[source.stream].flush()
            elif source.held and now - source.held_since >= older_than:
                held, source.held = source.held, b""
                self._show(source, held)

    def hold(self, ranks: Iterable[int]) -> None:
        """Keep what ``ranks`` write from now on until :meth:`release`."""
        self._held_ranks.update(ranks)

    def release(self, heading: str) -> None:
        """Show what the held ranks wrote, after a note with ``heading`` (if they wrote any)."""
        held, self._held, self._held_ranks = self._held, [], set()
        if held:
            self.note(heading)
        for rank, stream, data in held:
            self.write(rank, stream, data)
        if self._dropped:
            self.note(f"... and {self._dropped} more bytes (all of it is in --log-dir's files)")
        self._held_bytes = self._dropped = 0

    def note(self, message: str) -> None:
        """A message of the launcher's own, on stderr, each line prefixed ``[phalanx]``."""
        self._take_line(_Source(-1, STDERR))
        self._owner = None
        err = self._files[STDERR]
        for line in message.splitlines() or [""]:
            err.write(f"[phalanx] {line}\n".encode())
        err.flush()

    def _keep(self, rank: int, stream: int, data: bytes) -> None:
        room = _HOLD_BYTES - self._held_bytes
        self._held.append((rank, stream, data[:room]))
        self._held_bytes += min(len(data), room)
        self._dropped += max(0, len(data) - room)

    def _show(self, source: _Source, data: bytes) -> None:
        terminal = self._terminal[source.stream]
        for segment in _SEGMENT.findall(data):
            if not segment:
                continue
            text = segment.rstrip(b"\r\n")
            end = segment[len(text):]
            if terminal:
                self._segment(source, text, end)
            else:
                self._plain_segment(source, text, end)
            source.redrawn = end == b"\r" or (source.redrawn and not end)
        self._files[source.stream].flush()

    def _segment(self, source: _Source, text: bytes, end: bytes) -> None:
        """One segment in a terminal: as it comes, a blank redraw erasing the line."""
        out = self._files[source.stream]
        self._take_line(source)
        if end == b"\r" and not text.strip():  # a line cleared with blanks (tqdm leave=False)
            if source.mid_line or text:
                out.write(_ERASE_LINE)
            else:
                out.write(end)
            source.mid_line, source.blank = False, True
            self._owner = source
            return
        self._text(source, self._fold(source, text, end))
        if end:
            out.write(end)
            source.mid_line = False
            # after "\r" the cursor sits on a line that still shows this source's text
            self._owner = source if end == b"\r" else None

    def _plain_segment(self, source: _Source, text: bytes, end: bytes) -> None:
        """One segment off a terminal: states of a redrawn line kept back (see the module)."""
        if end == b"\r":
            if text.strip():  # a state, about to be redrawn
                source.state = text
                self._flush_state(source, time.monotonic(), final=False)
            elif text:  # the line cleared with blanks (tqdm leave=False): its last state
                self._flush_state(source, time.monotonic(), final=True)
            return  # a bare "\r" only starts the next state
        source.state = b""  # the line's final text follows: it supersedes any state
        self._take_line(source)
        self._text(source, self._fold(source, text, end))
        if end:
            self._files[source.stream].write(b"\n")
            source.mid_line = False
            self._owner = None

    def _flush_state(self, source: _Source, now: float, final: bool, held: bool = False) -> None:
        """Write the latest state of ``source``'s redrawn line (with the one held back since
        its last ``\r`` when ``held``) if ``final`` or :data:`STATE_EVERY_S` have passed."""
        if source.state_at == float("-inf"):
            source.state_at = now  # the clock starts at the first state: never a "0%" line
        if not (final or now - source.state_at >= STATE_EVERY_S):
            return
        state = source.held if held and source.held.strip() else source.state
        if held:
            source.held = b""
        source.state = b""
        if state:
            self._take_line(source)
            self._text(source, state)
            self._files[source.stream].write(b"\n")
            source.mid_line, source.state_at = False, now
            self._owner = None

    def _fold(self, source: _Source, text: bytes, end: bytes) -> bytes:
        """``text``, or, for a whole long stderr line another rank showed already, a pointer
        to that one (see :data:`FOLD_MIN`)."""
        if (source.stream != STDERR or source.mid_line or end not in (b"\n", b"\r\n")
                or len(text) < FOLD_MIN):
            return text
        prefix = _TORCH_PREFIX.match(text)
        head, body = (text[:prefix.end()], text[prefix.end():]) if prefix else (b"", text)
        first = self._long_lines.setdefault(body, source.rank)
        if len(self._long_lines) > _FOLD_KEEP:
            del self._long_lines[next(iter(self._long_lines))]
        if first == source.rank:
            return text
        return head + b"(the same %d-character line as rank %d's above)" % (len(body), first)

    def _text(self, source: _Source, text: bytes) -> None:
        if not text:
            return
        out = self._files[source.stream]
        if not source.mid_line and self._rank_prefix:
            prefix = b"[rank%d]: " % source.rank
            # torch's excepthook prefixes traceback lines itself once a group exists
            if not text.startswith(prefix.rstrip()):
                out.write(prefix)
        out.write(text)
        source.mid_line, source.blank = True, False

    def _take_line(self, source: _Source) -> None:
        owner = self._owner
        if owner is not None and owner is not source:
            # a line another source left blank is reused; one showing text is ended
            self._files[owner.stream].write(b"\r" if owner.blank else b"\n")
            self._files[owner.stream].flush()
            owner.mid_line = False
        self._owner = source
