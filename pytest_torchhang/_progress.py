"""Progress beats for stall detection: timestamps on a shared page every guarded process writes.

Standard library only and cheap to import: the injected start-up hook loads it in children when
``PYTEST_TORCH_HANG_PROGRESS`` names a board. A beat is a few stores into a ``MAP_SHARED`` page
(no lock, no system call): the last beat's time, kind and numbers, and per kind a count with its
first and last time. Concurrent beats may interleave their numbers; a beat's time is stored last
of all, so a reader never sees progress that did not happen. Without a board every beat returns
at once, and nothing is patched: stall detection off costs nothing.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import mmap
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

#: Names the board file of the guarded test; set in the test's environment while it runs.
PROGRESS_ENV = "PYTEST_TORCH_HANG_PROGRESS"
BOARD_BYTES = 4096
#: Kinds of progress, in board order.
KINDS = ("DataLoader batch", "optimizer step", "collective", "progress()")
DATALOADER, OPTIMIZER, COLLECTIVE, EXPLICIT = range(len(KINDS))
# 8-byte slots: 0 last time, 1 last kind + 1, 2 last pid, 3 last number, 4 last epoch,
# 5 note length; per kind k from slot 8: count, first time, last time. The note from byte 512.
_KIND_BASE = 8
_NOTE_AT, _NOTE_BYTES = 512, 256
_OPTIMIZER_BASE = _KIND_BASE + 3 * OPTIMIZER

_COLLECTIVES = (
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
    floats: Any = None  # memoryview of the page as doubles
    ints: Any = None  # the same page as signed 64-bit integers
    pid = 0
    installed = False


def attach(path: str | None = None) -> bool:
    """Use the board at ``path`` (default: from the environment); False when there is none."""
    path = path or os.environ.get(PROGRESS_ENV)
    if not path:
        return False
    if path == _Board.path and _Board.page is not None:
        return True
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        page = mmap.mmap(fd, BOARD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)
    view = memoryview(page)
    _Board.path, _Board.page = path, page
    _Board.floats, _Board.ints = view.cast("d"), view.cast("q")
    _Board.pid = os.getpid()
    return True


def create(path: str) -> None:
    """Make (or wipe) a board file: a fresh test starts with no progress."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 0)
        os.ftruncate(fd, BOARD_BYTES)
    finally:
        os.close(fd)


def beat(
    kind: int, number: int = 0, epoch: int = 0, _now: Callable[[], float] = time.monotonic
) -> None:
    """Record one unit of progress of ``kind`` (the hot path: a handful of stores)."""
    floats = _Board.floats
    if floats is None:
        return
    ints = _Board.ints
    now = _now()
    base = _KIND_BASE + 3 * kind
    count = ints[base] + 1
    ints[base] = count
    if count == 1:
        floats[base + 1] = now
    floats[base + 2] = now
    ints[1] = kind + 1
    ints[2] = _Board.pid
    ints[3] = number or count
    ints[4] = epoch
    floats[0] = now  # last: a reader that sees this time sees a beat that happened


def progress(note: str | None = None) -> None:
    """Tell pytest-torchhang's stall detection that this process made progress.

    Callable from any process of a guarded test's tree (the test itself, a DataLoader worker, a
    rank, a child it spawned); ``note`` (say ``"epoch 3, step 120"``) appears in a stall report
    as the last progress seen. Costs about a microsecond; does nothing where no stall detection
    is armed.
    """
    if _Board.floats is None and not attach():
        return
    if note is not None and _Board.page is not None:
        data = note.encode("utf-8", "replace")[:_NOTE_BYTES]
        _Board.page[_NOTE_AT : _NOTE_AT + _NOTE_BYTES] = data.ljust(_NOTE_BYTES, b"\0")
        _Board.ints[5] = len(data)
    beat(EXPLICIT)


def _after_fork() -> None:
    _Board.pid = os.getpid()


# --- reading the board (the plugin's side) ---------------------------------------------------


class Snapshot:
    """What a board says at one moment."""

    def __init__(self, page: Sequence[float], counts: Sequence[int], note: str) -> None:
        self.last = page[0]  # monotonic time of the last beat; 0.0: none yet
        self.kind = counts[1] - 1  # -1: none yet
        self.pid = counts[2]
        self.number = counts[3]
        self.epoch = counts[4]
        self.note = note
        self.counts = [counts[_KIND_BASE + 3 * k] for k in range(len(KINDS))]
        self.first = [page[_KIND_BASE + 3 * k + 1] for k in range(len(KINDS))]
        self.latest = [page[_KIND_BASE + 3 * k + 2] for k in range(len(KINDS))]

    def rate(self, kind: int) -> float | None:
        """Beats per second of ``kind`` between its first and its last beat."""
        span = self.latest[kind] - self.first[kind]
        return (self.counts[kind] - 1) / span if self.counts[kind] > 1 and span > 0 else None

    def describe_last(self) -> str:
        """``DataLoader batch 812 of epoch 3``, ``progress() 'epoch 3'``, ..."""
        if self.kind < 0:
            return ""
        text = f"{KINDS[self.kind]} {self.number}"
        if self.kind == DATALOADER and self.epoch:
            text += f" of epoch {self.epoch}"
        if self.kind == EXPLICIT and self.note:
            text = f"progress({self.note!r})"
        return f"{text} (pid {self.pid})"


class Reader:
    """The plugin's read-only view of one board file."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self._page = mmap.mmap(fd, BOARD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        view = memoryview(self._page)
        self._floats, self._ints = view.cast("d"), view.cast("q")

    def last(self) -> float:
        """Monotonic time of the last beat, 0.0 when there was none."""
        return float(self._floats[0])

    def snapshot(self) -> Snapshot:
        length = max(0, min(int(self._ints[5]), _NOTE_BYTES))
        note = bytes(self._page[_NOTE_AT : _NOTE_AT + length]).decode("utf-8", "replace")
        return Snapshot(self._floats.tolist(), self._ints.tolist(), note)


# --- automatic beats: DataLoader batches, optimizer steps, collectives -------------------------


def _patch_dataloader(module: ModuleType) -> None:
    iterator = getattr(module, "_BaseDataLoaderIter", None)
    if iterator is None or getattr(iterator, "_torchhang_beats", False):
        return
    next_batch = iterator.__next__
    reset = iterator._reset

    def __next__(self: Any, _now: Callable[[], float] = time.monotonic) -> Any:
        data = next_batch(self)
        # beat(DATALOADER, ...), inlined: this runs for every batch of every loader of the tree
        floats = _Board.floats
        if floats is not None:
            ints = _Board.ints
            now = _now()
            count = ints[_KIND_BASE] + 1
            ints[_KIND_BASE] = count
            if count == 1:
                floats[_KIND_BASE + 1] = now
            floats[_KIND_BASE + 2] = now
            ints[1] = DATALOADER + 1
            ints[2] = _Board.pid
            ints[3] = self._num_yielded
            ints[4] = getattr(self, "_torchhang_epoch", 0)
            floats[0] = now
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
    optimizer: Any, args: Any, kwargs: Any, _now: Callable[[], float] = time.monotonic
) -> None:
    # beat(OPTIMIZER), inlined: this runs after every optimizer step of the tree
    floats = _Board.floats
    if floats is None:
        return
    ints = _Board.ints
    now = _now()
    count = ints[_OPTIMIZER_BASE] + 1
    ints[_OPTIMIZER_BASE] = count
    if count == 1:
        floats[_OPTIMIZER_BASE + 1] = now
    floats[_OPTIMIZER_BASE + 2] = now
    ints[1] = OPTIMIZER + 1
    ints[2] = _Board.pid
    ints[3] = count
    ints[4] = 0
    floats[0] = now


def _patch_optimizer(module: ModuleType) -> None:
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is not None and not getattr(module, "_torchhang_beats", False):
        register(_optimizer_step)
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
    for name in _COLLECTIVES:
        original = getattr(module, name, None)
        if original is None:
            continue
        wrapped = _beating(original)
        setattr(module, name, wrapped)
        if package is not None and getattr(package, name, None) is original:
            setattr(package, name, wrapped)
    module._torchhang_beats = True  # type: ignore[attr-defined]


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "torch.utils.data.dataloader": _patch_dataloader,
    "torch.optim.optimizer": _patch_optimizer,
    "torch.distributed.distributed_c10d": _patch_collectives,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with contextlib.suppress(Exception):  # progress beats must never break an import
            self._patch(module)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Patches the modules above right after they are first imported."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install() -> bool:
    """Attach the board and beat on batches, steps and collectives in this process (idempotent).

    Modules already imported are patched now, the others when they are first imported.
    """
    if not attach():
        return False
    if _Board.installed:
        return True
    _Board.installed = True
    os.register_at_fork(after_in_child=_after_fork)
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            with contextlib.suppress(Exception):
                patch(module)
    sys.meta_path.insert(0, _PatchingFinder())
    return True
