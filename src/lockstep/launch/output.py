"""Show the ranks' output on the launcher's terminal, each line marked with its rank.

Every worker writes its stdout and stderr to its own log file (torch's agent redirects them);
:class:`OutputRelay` follows those files in one thread and copies each complete line to the
launcher's stdout or stderr as ``[rankN]: line``. A line ends at ``\\n`` or at ``\\r``, so a
progress bar that redraws itself with ``\\r`` keeps redrawing one prefixed line.

A rank's native crash report (a C++ ``terminate``, Python's ``Fatal Python error`` with every
thread's stack and the extension modules: forty lines of gloo's abort on a desync) is held back:
one line stands for it where it happened, and the launcher prints it after its own summary, which
names the cause (:class:`CrashReports`).

Why not torch's own ``tee``: its tail threads sleep 0.1 s between reads and cannot be woken, and
the agent stops the stdout and the stderr tailer one after the other, so every job (and every
restart) ended 0.1-0.2 s after its last rank did. :meth:`OutputRelay.stop` wakes the thread at
once, copies what is left (a last line without an ending included) and returns.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, TextIO

__all__ = ["OutputRelay", "Source", "relay_for", "CrashReports"]

_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")
# a line still without its ending after this long is shown as it is (a prompt, a slow printer)
_HOLD_PARTIAL_S = 0.5
_FINAL_DRAIN_S = 5.0  # past what the files held at stop, at most this long for a writer still going
_CHUNK = 1 << 20  # read at most this much per file and pass: a flood of output stays bounded in memory


_CRASH_STARTS = (b"terminate called after throwing", b"terminate called without", b"Fatal Python error: ")
_CRASH_ENDS = b"Extension modules: "  # faulthandler's last line


class CrashReports:
    """The native crash reports the relay held back, by rank prefix, for after the launcher's summary."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, list[str]]] = []
        self._lock = threading.Lock()

    def start(self, prefix: str, line: str) -> list[str]:
        """A report begins with ``line``; returns the list its lines go to."""
        lines = [line]
        with self._lock:
            self.reports.append((prefix, lines))
        return lines

    def take(self, says: str = "") -> list[str]:
        """Each report's lines, prefixed, after a line that says whose it is (``says``: the launcher's prefix);
        the reports are then forgotten (a restarted attempt's are its own)."""
        out = []
        with self._lock:
            reports, self.reports = self.reports, []
            for prefix, lines in reports:
                who = prefix.strip().strip("[]:").replace("rank", "rank ") or "a rank"
                out.append(f"{says}{who}'s native crash report ({len(lines)} lines):")
                out += [prefix + line.rstrip("\r\n") for line in lines]
        return out


@dataclass
class Source:
    """One log file to follow.

    Args:
        path: the file the worker writes (it may not exist yet when the relay starts).
        dst: where its lines go (the launcher's ``sys.stdout`` or ``sys.stderr``).
        prefix: put in front of every line, e.g. ``"[rank3]: "``.
        crashes: where a native crash report goes instead of the terminal (``None``: shown as it comes).
    """

    path: str
    dst: TextIO
    prefix: str
    crashes: CrashReports | None = None
    _held: list[str] | None = field(default=None, repr=False)
    _file: IO[bytes] | None = field(default=None, repr=False)
    _partial: bytes = field(default=b"", repr=False)
    _partial_since: float = field(default=0.0, repr=False)
    _midline: bool = field(default=False, repr=False)
    _after_cr: bool = field(default=False, repr=False)
    _dead: bool = field(default=False, repr=False)

    def pump(self, final: bool) -> bool:
        """Copy the complete lines written since the last call; True when anything was read."""
        if self._dead:
            return False
        try:
            if self._file is None:
                self._file = open(self.path, "rb")  # noqa: SIM115 - held open while following
            new = self._file.read(_CHUNK)
        except FileNotFoundError:
            return False
        except OSError:
            self._dead = True  # unreadable: the other ranks' output still flows
            return False
        now = time.monotonic()
        if new and not self._partial:
            self._partial_since = now
        data = self._partial + new
        lines = _LINE.findall(data)
        rest = data[sum(len(x) for x in lines) :]
        at_end = final and len(new) < _CHUNK  # the worker is gone and the file is read to its end
        if lines and not rest and lines[-1].endswith(b"\r") and not at_end:
            rest = lines.pop()  # perhaps the first half of "\r\n": wait for the next read
        out = [text for line in lines if (text := self._show(line))]
        if rest and at_end:
            out.append(self._render(rest + b"\n", partial=False))
            rest = b""
        elif rest and now - self._partial_since >= _HOLD_PARTIAL_S:
            # shown as it is (a prompt, a slow progress bar): the line's rest follows it later
            out.append(self._render(rest, partial=True))
            rest = b""
        self._partial = rest
        if rest and lines:
            self._partial_since = now
        if out:
            try:
                self.dst.write("".join(out))
                self.dst.flush()
            except (OSError, ValueError):
                pass  # the terminal went away: the log file still has every line
        return bool(new)

    def _show(self, line: bytes) -> str:
        """A complete line as the terminal gets it; a native crash report's lines are held (one line instead)."""
        if self.crashes is not None:
            if self._held is not None:
                self._held.append(line.decode(errors="replace"))
                if line.startswith(_CRASH_ENDS):
                    self._held = None
                return ""
            if line.startswith(_CRASH_STARTS):
                text = line.decode(errors="replace")
                self._held = self.crashes.start(self.prefix, text)
                return self._render(
                    f"{text.rstrip()} (a native crash report: it follows the summary)\n".encode(), partial=False
                )
        return self._render(line, partial=False)

    def _render(self, line: bytes, partial: bool) -> str:
        # a bare "\r" (a progress bar about to redraw) and the rest of a line already shown
        # need no prefix
        bare = line == b"\r" or (line == b"\n" and self._after_cr)  # or the end of a split "\r\n"
        prefix = "" if self._midline or bare else self.prefix
        self._midline = partial and not line.endswith(b"\r")
        self._after_cr = line.endswith(b"\r")
        return prefix + line.decode(errors="replace")

    def size(self) -> int:
        """The file's size now (0 when it does not exist yet)."""
        try:
            return os.path.getsize(self.path)
        except OSError:
            return 0

    def read_to(self) -> int:
        """How far the file has been read."""
        return self._file.tell() if self._file is not None else 0

    def finish(self) -> None:
        """End a line left open (shown without its ending) so that what follows starts afresh."""
        if self._midline:
            self._midline = False
            try:
                self.dst.write("\n")
                self.dst.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """Stop following the file."""
        if self._file is not None:
            self._file.close()
            self._file = None


class OutputRelay:
    """Follow several log files in one thread and copy their lines, prefixed, to the terminal.

    Args:
        sources: the files to follow.
        interval: seconds to wait when no file had anything new.
    """

    def __init__(self, sources: list[Source], interval: float = 0.05) -> None:
        self.sources = sources
        self.interval = interval
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lockstep-output", daemon=True)

    def start(self) -> OutputRelay:
        """Start following; returns ``self``."""
        if self.sources:
            self._thread.start()
        return self

    def stop(self) -> None:
        """Copy everything the files still hold, then stop (safe to call twice)."""
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        try:
            while not self._halt.is_set():
                busy = False
                for source in self.sources:
                    busy = source.pump(final=False) or busy
                if not busy:
                    self._halt.wait(self.interval)
            # the workers are gone: what the files hold now is copied whole, however slow the
            # machine; anything written after that only until the deadline (a writer still going)
            deadline = time.monotonic() + _FINAL_DRAIN_S
            for source in self.sources:
                held = source.size()
                while source.pump(final=True) and (source.read_to() < held or time.monotonic() < deadline):
                    pass
                source.finish()
        finally:
            for source in self.sources:
                source.close()


def relay_for(
    pcontext: Any,
    workers: list[Any],
    stdout: TextIO,
    stderr: TextIO,
    shown: set[int] | None,
    crashes: CrashReports | None = None,
) -> OutputRelay:
    """An :class:`OutputRelay` for the log files of torch's process context ``pcontext``.

    Args:
        pcontext: the agent's process context (``stdouts``/``stderrs``: local rank -> path).
        workers: the agent's workers (``local_rank`` and ``global_rank`` each).
        stdout: where the ranks' stdout lines go.
        stderr: where the ranks' stderr lines go.
        shown: the local ranks to show; ``None`` shows all.
        crashes: where the ranks' native crash reports (on stderr) are held for after the summary.
    """
    sources = []
    for worker in sorted(workers, key=lambda w: w.local_rank):
        if shown is not None and worker.local_rank not in shown:
            continue
        prefix = f"[rank{worker.global_rank}]: "
        for paths, dst, held in ((pcontext.stdouts, stdout, None), (pcontext.stderrs, stderr, crashes)):
            path = paths.get(worker.local_rank)
            if path:
                sources.append(Source(path, dst, prefix, held))
    return OutputRelay(sources)
