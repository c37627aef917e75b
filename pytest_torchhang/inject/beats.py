"""Progress beats for stall detection: timestamps on a shared page every guarded process writes.

Standard library only and cheap to import: the injected start-up hook loads it in children when
``PYTEST_TORCH_HANG_PROGRESS`` names a board. A beat is a few stores into a ``MAP_SHARED`` page
(no lock, no system call): per kind a count with its first and last time, then the last beat
(kind, pid, number and epoch packed in one 64-bit word, so it is always one beat's), then its
time, stored last of all, so a reader never sees progress that did not happen. Concurrent
beats of one kind may lose a count (a lower bound, never more than were made). Each test gets a
board file of its own (:func:`new_board`): a process an earlier test left running beats into
that test's board, never into the next one's, and no file is ever shrunk while mapped (a
writer would die of SIGBUS). Without a board every beat returns at once, and nothing is
patched: stall detection off costs nothing.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import struct
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from .hook import child_note
from .imports import C10D, after_import

# PROGRESS_ENV names the session's pointer to the guarded test's board (a link); set once, at
# the first test with stall detection, and left alone until the session ends.
from .protocol import PROGRESS_ENV as PROGRESS_ENV

BOARD_BYTES = 4096
#: Kinds of progress, in board order.
KINDS = ("DataLoader batch", "optimizer step", "collective", "progress()")
DATALOADER, OPTIMIZER, COLLECTIVE, EXPLICIT = range(len(KINDS))
# The page as signed 64-bit words: 0 the last beat's time (monotonic ns, 0: none yet), 1 the
# last beat (below); per kind k from word 8: count, first time, last time. From byte 512 the
# last note: its length and CRC-32 (two 32-bit words), then its bytes, written in one copy.
_KIND_BASE = 8
_OPTIMIZER_BASE = _KIND_BASE + 3 * OPTIMIZER
_NOTE_AT, _NOTE_BYTES = 512, 256
_NOTE_HEADER = struct.Struct("<II")
_NOTE_END = _NOTE_AT + _NOTE_HEADER.size + _NOTE_BYTES
# The last beat, one word (one store, so never torn): bits 0-2 kind + 1, 3-24 pid (Linux pids
# are below 2**22), 25-36 epoch, 37-62 number; epoch and number wrap past their widths. The
# hot paths below spell these shifts and masks as literals (a global lookup costs more).
_PID_SHIFT, _EPOCH_SHIFT, _NUMBER_SHIFT = 3, 25, 37
_PID_MASK, _EPOCH_MASK, _NUMBER_MASK = (1 << 22) - 1, (1 << 12) - 1, (1 << 26) - 1
#: A note that keeps changing while it is read is given up after this many reads.
_NOTE_READS = 5

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "barrier",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "broadcast_object_list",
    "monitored_barrier",
)


class _Board:
    """This process's view of the board, if any (kept across fork: the page is shared)."""

    path: str | None = None
    page: mmap.mmap | None = None
    words: Any = None  # the page as signed 64-bit integers; set last, cleared first
    tag = 0  # this process's pid, in its place in the last-beat word
    installed = False
    #: The board the pointer named when this process first looked ("": none); None: not yet
    looked: str | None = None
    #: What could not be patched here, said again by every fork child (its own report entry)
    failures: list[str] = []  # noqa: RUF012 - one list per process, on purpose


def attach(path: str | None = None) -> bool:
    """Use the board at ``path`` (default: the one the environment's pointer named when this
    process first looked); False when there is none.

    A process never moves on by itself to a later test's board: one an earlier test left
    running cannot hide this test's stall. Cheap when the board is the one in use.
    """
    if path is None:
        pointer = os.environ.get(PROGRESS_ENV)
        if not pointer:
            return False
        if _Board.looked is None:
            _Board.looked = _resolve(pointer)
        board = _Board.looked
    else:
        board = _resolve(path)
    if not board:
        return False  # no test had a board when this process first looked
    if board == _Board.path and _Board.words is not None:
        return True
    try:
        fd = os.open(board, os.O_RDWR)
    except FileNotFoundError:
        return False  # its test is over: this process was left running after it
    except OSError as exc:
        _failed(f"could not open the progress board {board} ({exc})", "its beats")
        return False
    try:
        page = mmap.mmap(fd, BOARD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as exc:
        _failed(f"could not map the progress board {board} ({exc})", "its beats")
        return False
    finally:
        os.close(fd)
    _Board.tag = os.getpid() << _PID_SHIFT
    _Board.path, _Board.page = board, page
    _Board.words = memoryview(page).cast("q")  # last: a beat sees a whole board or none
    return True


def _resolve(path: str) -> str:
    """The board ``path`` names: a pointer's board, ``path`` itself when it is a board, and
    ``""`` when it names none (a pointer between tests)."""
    try:
        return os.path.join(os.path.dirname(path), os.readlink(path))
    except FileNotFoundError:
        return ""
    except OSError:  # not a link: a board
        return path


def look_again() -> None:
    """Take the board the pointer names now at the next :func:`attach` (a new test in this
    process; a runner child, forked from a zygote that looked long ago)."""
    _Board.looked = None


def detach() -> None:
    """Beat into no board from now on; a beat under way in another thread ends on the old page
    (it stays mapped until nothing refers to it)."""
    _Board.words = None
    _Board.page = None
    _Board.path = None


def board_path(dump_dir: str, serial: int) -> str:
    """The board file of this pytest process's ``serial``-th guarded test."""
    return os.path.join(dump_dir, f"progress-{os.getpid()}-{serial}")


def pointer_path(dump_dir: str) -> str:
    """The link that names the current test's board, for the whole session: the environment
    names it once (a ``setenv`` per test would race native threads that read the environment)."""
    return os.path.join(dump_dir, f"progress-{os.getpid()}")


def new_board(dump_dir: str, serial: int) -> Reader:
    """A fresh board for the test about to run: made, named by the session's pointer (which the
    environment names from the first board on), and beaten into by this process too (a test
    iterates its DataLoader here). Call :func:`end_board` after it.

    A new file each test: a process an earlier test left running keeps beating into that test's
    board, so it cannot hide this test's stall, and no file is ever shrunk while mapped.
    """
    path = board_path(dump_dir, serial)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # an earlier process's with this pid: a new inode, never truncated
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, BOARD_BYTES)  # zeros: no progress; nobody can have mapped it yet
    finally:
        os.close(fd)
    reader = Reader(path)
    pointer = pointer_path(dump_dir)
    _point(pointer, os.path.basename(path))
    if os.environ.get(PROGRESS_ENV) != pointer:
        os.environ[PROGRESS_ENV] = pointer  # once a session: it never changes afterwards
    known = list(_Board.failures)
    look_again()
    install()
    for text in known:  # a capture keeps only its own test's notes: say them again for this one
        child_note(text)
    return reader


def _point(pointer: str, board: str) -> None:
    """Make ``pointer`` name ``board`` (a relative link, replaced in one step)."""
    new = f"{pointer}.new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(new)
    os.symlink(board, new)
    os.replace(new, pointer)


def end_board(reader: Reader) -> None:
    """The test of ``reader``'s board is over: the pointer names no board any more, and the board
    leaves this process and the disk (processes that still map it keep a valid page); ``reader``
    keeps its last state for a report made later."""
    pointer = pointer_path(os.path.dirname(reader.path))
    if _resolve(pointer) == reader.path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pointer)
    if _Board.path == reader.path:
        detach()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(reader.path)
    reader.close()


def end_session(dump_dir: str) -> None:
    """The session is over: its environment names no pointer any more."""
    if os.environ.get(PROGRESS_ENV) == pointer_path(dump_dir):
        del os.environ[PROGRESS_ENV]


def create(path: str) -> None:
    """Make a board file, or wipe one in place (superseded by :func:`new_board`).

    Never shrinks the file: a process writing to a mapping of it while it is truncated dies of
    SIGBUS.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < BOARD_BYTES:
            os.ftruncate(fd, BOARD_BYTES)
        os.pwrite(fd, bytes(BOARD_BYTES), 0)
    finally:
        os.close(fd)


def beat(
    kind: int, number: int = 0, epoch: int = 0, _now: Callable[[], int] = time.monotonic_ns
) -> None:
    """Record one unit of progress of ``kind`` (the hot path: a handful of stores)."""
    words = _Board.words
    if words is None:
        return
    now = _now()
    base = _KIND_BASE + 3 * kind
    count = words[base] + 1
    words[base] = count
    if count == 1:
        words[base + 1] = now
    words[base + 2] = now
    words[1] = ((number or count) & 0x3FFFFFF) << 37 | (epoch & 0xFFF) << 25 | _Board.tag | kind + 1
    words[0] = now  # last: a reader that sees this time sees a beat that happened


def progress(note: str | None = None) -> None:
    """Tell pytest-torchhang's stall detection that this process made progress.

    Callable from any process of a guarded test's tree (the test itself, a DataLoader worker, a
    rank, a child it spawned); ``note`` (say ``"epoch 3, step 120"``) appears in a stall report
    as the last progress seen. Costs about a microsecond; does nothing where no stall detection
    is armed.
    """
    if _Board.words is None and not attach():
        return
    page = _Board.page
    if note is not None and page is not None:
        data = note.encode("utf-8", "replace")[:_NOTE_BYTES]
        # header and text in one copy: whole to the other threads here (the GIL); a reader
        # checks the CRC against another process writing at the same moment
        record = _NOTE_HEADER.pack(len(data), zlib.crc32(data)) + data
        page[_NOTE_AT : _NOTE_AT + len(record)] = record
    beat(EXPLICIT)


def _after_fork() -> None:
    _Board.tag = os.getpid() << _PID_SHIFT
    for text in _Board.failures:  # this process's report entry must say it too
        child_note(text)


def _failed(what: str, counted: str) -> None:
    """Say, in the report, that ``counted`` will not count as progress in this process."""
    text = (
        f"pytest-torchhang {what}: {counted} do not count as progress in this process, so a "
        "stall may be declared while they go on"
    )
    if text in _Board.failures:  # progress() retries a board it could not open: say it once
        return
    _Board.failures.append(text)
    child_note(text)


# --- reading the board (the plugin's side) ---------------------------------------------------


class Snapshot:
    """What a board says at one moment."""

    def __init__(self, words: Sequence[int], note: str = "") -> None:
        self.last = words[0] / 1e9  # monotonic time of the last beat; 0.0: none yet
        record = words[1]
        self.kind = (record & 7) - 1  # -1: none yet
        self.pid = record >> _PID_SHIFT & _PID_MASK
        self.epoch = record >> _EPOCH_SHIFT & _EPOCH_MASK
        self.number = record >> _NUMBER_SHIFT & _NUMBER_MASK
        self.note = note
        self.counts = [words[_KIND_BASE + 3 * k] for k in range(len(KINDS))]
        self.first = [words[_KIND_BASE + 3 * k + 1] / 1e9 for k in range(len(KINDS))]
        self.latest = [words[_KIND_BASE + 3 * k + 2] / 1e9 for k in range(len(KINDS))]

    def rate(self, kind: int) -> float | None:
        """Beats per second of ``kind`` between its first and its last beat."""
        span = self.latest[kind] - self.first[kind]
        return (self.counts[kind] - 1) / span if self.counts[kind] > 1 and span > 0 else None

    def describe_last(self) -> str:
        """``DataLoader batch 812 of epoch 3``, ``progress() 'epoch 3'``, ..."""
        if not 0 <= self.kind < len(KINDS):
            return ""
        text = f"{KINDS[self.kind]} {self.number}"
        if self.kind == DATALOADER and self.epoch:
            text += f" of epoch {self.epoch}"
        if self.kind == EXPLICIT and self.note:
            text = f"progress({self.note!r})"
        return f"{text} (pid {self.pid})"


_NO_PROGRESS = Snapshot([0] * (BOARD_BYTES // 8))


def _read_note(page: mmap.mmap) -> str:
    """The last note, whole: a copy that another process was writing into is read again."""
    for _ in range(_NOTE_READS):
        record = page[_NOTE_AT:_NOTE_END]
        length, crc = _NOTE_HEADER.unpack_from(record)
        data = record[_NOTE_HEADER.size : _NOTE_HEADER.size + length]
        if length <= _NOTE_BYTES and zlib.crc32(data) == crc:
            return data.decode("utf-8", "replace")
    return ""  # rewritten all the while: say no note rather than a mixed one


class Reader:
    """The plugin's read-only view of one board file."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDONLY)
        try:
            page = mmap.mmap(fd, BOARD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        # one attribute, so a read in the watchdog's thread and close() in another never mix
        self._view: tuple[mmap.mmap, Any] | None = (page, memoryview(page).cast("q"))
        self._final = _NO_PROGRESS

    def last(self) -> float:
        """Monotonic time of the last beat, 0.0 when there was none."""
        view = self._view
        return view[1][0] / 1e9 if view is not None else self._final.last

    def snapshot(self) -> Snapshot:
        """Everything the board says now (after :meth:`close`: what it said then)."""
        view = self._view
        if view is None:
            return self._final
        page, words = view
        # word 0 (the last time) is read first: what a beat stored before it is there by then
        return Snapshot(words.tolist(), _read_note(page))

    def close(self) -> None:
        """Keep what the board says now and let its mapping go once no read uses it."""
        if self._view is not None:
            self._final = self.snapshot()
            self._view = None


# --- automatic beats: DataLoader batches, optimizer steps, collectives -------------------------


def _patch_dataloader(module: ModuleType) -> None:
    iterator = module._BaseDataLoaderIter  # AttributeError: a torch without it, said in the report
    if getattr(iterator, "_torchhang_beats", False):
        return
    next_batch = iterator.__next__
    reset = iterator._reset

    def __next__(self: Any, _now: Callable[[], int] = time.monotonic_ns) -> Any:
        data = next_batch(self)
        # beat(DATALOADER, ...), inlined: this runs for every batch of every loader of the tree
        words = _Board.words
        if words is not None:
            now = _now()
            count = words[8] + 1  # _KIND_BASE + 3 * DATALOADER
            words[8] = count
            if count == 1:
                words[9] = now
            words[10] = now
            words[1] = (
                (self._num_yielded & 0x3FFFFFF) << 37
                | (getattr(self, "_torchhang_epoch", 0) & 0xFFF) << 25
                | _Board.tag
                | 1  # DATALOADER + 1
            )
            words[0] = now
        return data

    def _reset(self: Any, loader: Any, *args: Any, **kwargs: Any) -> Any:
        epoch = getattr(loader, "_torchhang_epochs", 0) + 1
        loader.__dict__["_torchhang_epochs"] = epoch  # past DataLoader.__setattr__'s checks
        self._torchhang_epoch = epoch
        return reset(self, loader, *args, **kwargs)

    iterator.__next__ = __next__
    iterator._reset = _reset
    iterator._torchhang_beats = True


def _optimizer_step(
    optimizer: Any, args: Any, kwargs: Any, _now: Callable[[], int] = time.monotonic_ns
) -> None:
    # beat(OPTIMIZER), inlined: this runs after every optimizer step of the tree
    words = _Board.words
    if words is None:
        return
    now = _now()
    count = words[11] + 1  # _OPTIMIZER_BASE
    words[11] = count
    if count == 1:
        words[12] = now
    words[13] = now
    words[1] = (count & 0x3FFFFFF) << 37 | _Board.tag | 2  # OPTIMIZER + 1
    words[0] = now


def _patch_optimizer(module: ModuleType) -> None:
    if not getattr(module, "_torchhang_beats", False):
        module.register_optimizer_step_post_hook(_optimizer_step)
        module._torchhang_beats = True  # type: ignore[attr-defined]


def _beating(fn: Callable[..., Any]) -> Callable[..., Any]:
    def collective(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        beat(COLLECTIVE)
        return result

    collective.__wrapped__ = fn  # type: ignore[attr-defined]
    collective.__name__ = getattr(fn, "__name__", "collective")
    collective.__qualname__ = getattr(fn, "__qualname__", collective.__name__)
    collective.__doc__ = getattr(fn, "__doc__", None)
    return collective


def _patch_collectives(module: ModuleType) -> None:
    if getattr(module, "_torchhang_beats", False):
        return
    package = sys.modules.get("torch.distributed")
    found = 0
    for name in COLLECTIVES:
        original = getattr(module, name, None)
        if original is None:
            continue  # an older torch may lack a few
        found += 1
        wrapped = _beating(original)
        setattr(module, name, wrapped)
        if package is not None and getattr(package, name, None) is original:
            setattr(package, name, wrapped)
    module._torchhang_beats = True  # type: ignore[attr-defined]
    if not found:
        raise AttributeError(f"none of {', '.join(COLLECTIVES[:3])}, ... found")


#: Module -> its patch and what goes uncounted when the patch fails.
_PATCHES: dict[str, tuple[Callable[[ModuleType], None], str]] = {
    "torch.utils.data.dataloader": (_patch_dataloader, "DataLoader batches"),
    "torch.optim.optimizer": (_patch_optimizer, "optimizer steps"),
    C10D: (_patch_collectives, "collectives"),
}


def _apply(name: str, module: ModuleType) -> None:
    patch, counted = _PATCHES[name]
    try:
        patch(module)
    except Exception as exc:  # progress beats must never break an import: the report says it
        _failed(f"could not patch {name} ({type(exc).__name__}: {exc})", counted)


def install() -> bool:
    """Attach the board and beat on batches, steps and collectives in this process (idempotent).

    Modules already imported are patched now, the others when they are first imported. A patch
    that fails leaves a note for the report (a stall there may be a false one), never an error.
    """
    if not attach():
        return False
    if _Board.installed:
        return True
    _Board.installed = True
    os.register_at_fork(after_in_child=_after_fork)
    for name in _PATCHES:
        module = after_import(name, "beats", functools.partial(_apply, name))
        if module is not None:
            _apply(name, module)
    return True
