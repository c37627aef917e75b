"""The tail of what a process of a guarded tree writes to ``sys.stderr``, kept in ``PID.stderr``
for the hang report (``protocol.read_stderr_copy`` reads it; ``hook.keep_stderr_tail`` installs
it). Standard library only, like all of ``inject/``: the start-up hook loads it by path.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TextIO

from .protocol import STDERR_HEADER, STDERR_KEEP_BYTES, STDERR_MAP_BYTES, stderr_path

# Bound at import, out of reach of a test's patches of ``time`` (as inject/hook.py does); the
# stamp is compared with a capture's start, read on the host's wall clock.
_realtime = functools.partial(time.time)


class _Off:
    """Where a copy that stopped (or never started) writes: nowhere, at the cost of a call."""

    @staticmethod
    def write(data: bytes) -> int:
        return 0


class StderrTail:
    """``sys.stderr`` as it was, which also keeps the tail of what is written to it in
    ``PID.stderr`` (``protocol.read_stderr_copy`` reads it).

    A child's stderr is usually a file or terminal it shares with the rest of the tree (pytest's
    capture file), so only the child itself can tell which lines are its own: the tracebacks
    that ``threading.excepthook``, ``sys.excepthook`` and multiprocessing's queue feeder thread
    (a batch that cannot be pickled) print there often say why the tree hangs. The user's
    stream is written first and unchanged. The copy costs a few memory stores a write, never a
    system call: the file is mapped (``MAP_SHARED``), so what is copied is in the page cache at
    once, for a capture from outside, whatever the process does next (hangs in C, dies). The
    copy never raises (a failure becomes a note and ends the copying). Writes to
    ``sys.stderr.buffer`` or to fd 2 directly are not seen.
    """

    def __init__(
        self, stream: TextIO, dump_dir: str, note: Callable[[str], None] | None = None
    ) -> None:
        self._torchhang_stream = stream
        self._torchhang_dir = dump_dir
        #: where a failure of the copy is said (``hook.child_note``, passed in: hook imports us)
        self._torchhang_note = note
        #: This process's mapped file (None: not opened yet; ``_Off``: copying stopped)
        self._torchhang_map: Any = None
        self._torchhang_stamp: Any = None  # the header as a float64 view: the last write's time
        _Copies.add(self)

    def write(self, text: str) -> int:
        """Write to the user's stream, then copy ``text`` into this process's mapped file."""
        written = self._torchhang_stream.write(text)
        try:  # the hot path: two C calls and a store (``print`` comes here twice a line)
            self._torchhang_map.write(text.encode("utf-8", "replace"))
            self._torchhang_stamp[0] = _realtime()
        except Exception:
            self._torchhang_slow(text)
        return written

    def writelines(self, lines: Iterable[str]) -> None:
        """Each line through :meth:`write` (the stream's own would bypass the copy)."""
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        # everything else (flush, fileno, encoding, isatty, buffer, ...) is the stream's own
        if name.startswith("_torchhang_"):  # not set yet (a copy made without __init__)
            raise AttributeError(name)
        return getattr(self._torchhang_stream, name)

    def __repr__(self) -> str:
        return repr(self._torchhang_stream)

    @property
    def _torchhang_off(self) -> bool:
        return self._torchhang_map is _Off

    def _torchhang_slow(self, text: object) -> None:
        """What the hot path could not do: open the file at the first write, move the tail to
        the front when the text reaches the end, give up (with a note) on a failure."""
        if self._torchhang_map is _Off or not isinstance(text, str):
            return
        try:
            if self._torchhang_map is None:
                self._torchhang_open()
            data = text.encode("utf-8", "replace")
            try:
                self._torchhang_map.write(data)
            except ValueError:  # no room left: the text reached the end of the file
                self._torchhang_wrap(data)
            self._torchhang_stamp[0] = _realtime()
        except Exception as exc:  # never into user code: say it, and stop copying
            self._torchhang_close()
            self._torchhang_map = _Off
            self._torchhang_stamp = [0.0]
            if self._torchhang_note is not None:
                self._torchhang_note(
                    f"pytest-torchhang stopped keeping the stderr lines of pid {os.getpid()} "
                    f"(the report will not show them): {type(exc).__name__}: {exc}"
                )

    def _torchhang_open(self) -> None:
        """Map this process's own file, emptied (an earlier process may have had this pid)."""
        import mmap

        path = stderr_path(self._torchhang_dir, os.getpid())
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < STDERR_MAP_BYTES:
                # blocks reserved now: a full disk fails here, never as SIGBUS at a write. Never
                # truncated: another mapping of it (an earlier copy of this module) stays valid.
                os.posix_fallocate(fd, 0, STDERR_MAP_BYTES)
            try:  # shared: the capture reads the file; writes need no descriptor
                page = mmap.mmap(fd, STDERR_MAP_BYTES, trackfd=False)  # type: ignore[call-arg,unused-ignore]
            except TypeError:  # before Python 3.13, the map keeps a copy (close-on-exec)
                page = mmap.mmap(fd, STDERR_MAP_BYTES)
        finally:
            os.close(fd)
        page.write(bytes(STDERR_MAP_BYTES))
        page.seek(STDERR_HEADER.size)
        self._torchhang_stamp = memoryview(page)[: STDERR_HEADER.size].cast("d")
        self._torchhang_map = page

    def _torchhang_wrap(self, data: bytes) -> None:
        """Keep the last ``STDERR_KEEP_BYTES`` (from a line's start) at the front, then ``data``
        (its end, when it alone is longer)."""
        page, start = self._torchhang_map, STDERR_HEADER.size
        end = page.tell()
        keep = page[max(end - STDERR_KEEP_BYTES, start) : end]
        if end - STDERR_KEEP_BYTES > start:  # cut in a line: that line is left out
            keep = keep[keep.find(b"\n") + 1 :]
        data = data[-STDERR_KEEP_BYTES:]
        page[start : start + len(keep)] = keep
        page[start + len(keep) : end] = bytes(end - start - len(keep))
        page.seek(start + len(keep))
        page.write(data)

    def _torchhang_close(self) -> None:
        """Stop writing to the mapping (a fork child's copy of its parent's, or a failed one)."""
        if self._torchhang_map not in (None, _Off):
            # Kept, never closed: before Python 3.13 a map closes its own copy of the file's
            # descriptor, whose number other code may have closed and reused since.
            _Copies.kept.append((self._torchhang_map, self._torchhang_stamp))
        self._torchhang_stamp, self._torchhang_map = None, None


class _Copies:
    """The process's stderr copies: a fork child lets go of its parent's mappings (its first
    write then maps its own file), through one at-fork handler, registered at import so that it
    runs before any other handler of the child that could write to stderr."""

    live: ClassVar[list[StderrTail]] = []  # as few as wrappers made (one a process, usually)
    kept: ClassVar[list[tuple[Any, Any]]] = []  # mappings let go of, kept to the end

    @classmethod
    def add(cls, tail: StderrTail) -> None:
        cls.live.append(tail)

    @classmethod
    def forget(cls) -> None:
        for tail in list(cls.live):
            if not tail._torchhang_off:
                tail._torchhang_close()


os.register_at_fork(after_in_child=_Copies.forget)
