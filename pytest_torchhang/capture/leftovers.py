"""What a killed tree leaves in /dev/shm and in $TMPDIR, removed by ownership, never by pattern.

Before the kill, each frozen process of the tree is read: the /dev/shm files it maps or has open
(by inode: glibc's ``sem_open`` maps a temporary name and renames it) and the unix sockets it has
open under a multiprocessing ``pymp-*`` directory (a Manager's ``listener-*``). After the kill,
only those are removed, each after its inode is checked again, plus torch's ``torch_<pid>_*``
segments of killed pids (their names carry the pid that made them). Nothing else of the host is
listed or read: another program's segment, handed over by name and open by nobody, stays.

The parsers, ``shm_to_unlink`` and ``sockets_to_remove`` are pure, so the rules are tested on
recorded listings; ``read_holding`` and ``remove`` do the I/O.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .. import clock
from . import procfs

SHM_DIR = "/dev/shm"
#: Segment names the multiprocess stack creates: multiprocessing named semaphores (spawn and
#: forkserver), torch's file_system sharing strategy, multiprocessing.shared_memory.
SHM_PREFIXES = ("sem.mp-", "torch_", "psm_")
_TORCH_SHM_PID = re.compile(r"^torch_(\d+)_")
#: A multiprocessing listener's socket: ``<tempdir>/pymp-XXXX/listener-XXXX``.
LISTENER_DIR_PREFIX = "pymp-"
LISTENER_PREFIX = "listener-"
#: File times come from a coarse clock, a tick behind ``time.time()`` at most.
_CLOCK_SLACK_S = 0.05


@dataclass(frozen=True)
class Holding:
    """What one process of the tree held when it was frozen, before it was killed."""

    pid: int
    started: float  # wall time it started: its own ``torch_<pid>_*`` names are younger
    shm_inodes: frozenset[int]  # /dev/shm files it mapped or had open
    sockets: frozenset[tuple[str, int]]  # (path, inode of the path) of its pymp listeners


@dataclass(frozen=True)
class ShmEntry:
    """One name in /dev/shm as listed at cleanup."""

    name: str
    inode: int
    ctime: float


# --- the rules (pure) ----------------------------------------------------------------------------


def shm_to_unlink(
    holdings: Iterable[Holding],
    killed: Iterable[int],
    entries: Iterable[ShmEntry],
    since: float,
    kept_inodes: Iterable[int] = (),
) -> list[str]:
    """The /dev/shm names a kill may unlink: made since ``since`` (wall time the test began),
    with a multiprocessing/torch name, and either mapped or open by a killed process or named
    ``torch_<pid>_*`` for a killed ``pid`` (and younger than it). ``kept_inodes``: files that a
    process of the tree that lives on (the test's own process, a spared torch_shm_manager) still
    maps or has open; they are its to unlink."""
    dead = set(killed)
    held = {ino for h in holdings if h.pid in dead for ino in h.shm_inodes}
    started = {h.pid: h.started for h in holdings if h.pid in dead}
    keep = set(kept_inodes)
    out = []
    for entry in entries:
        if not entry.name.startswith(SHM_PREFIXES) or entry.inode in keep:
            continue
        if entry.ctime < since - _CLOCK_SLACK_S:
            continue  # older than the test: a fixture's or another program's
        match = _TORCH_SHM_PID.match(entry.name)
        by_name = (
            match is not None
            and int(match.group(1)) in dead
            and entry.ctime >= started.get(int(match.group(1)), since) - _CLOCK_SLACK_S
        )
        if entry.inode in held or by_name:
            out.append(entry.name)
    return sorted(out)


def sockets_to_remove(
    holdings: Iterable[Holding],
    killed: Iterable[int],
    present: Mapping[str, tuple[int, float]],
    since: float,
) -> list[str]:
    """Listener sockets of killed processes, bound since ``since`` (wall time the test began),
    that are still the files they were (``present``: path -> (inode, ctime) of the socket files
    there now). A listener bound before the test is a fixture's or an earlier test's (a
    forkserver whose fork for this test still held its socket when it was killed): it stays."""
    dead = set(killed)
    return sorted(
        {
            path
            for h in holdings
            if h.pid in dead
            for path, inode in h.sockets
            if path in present
            and present[path][0] == inode
            and present[path][1] >= since - _CLOCK_SLACK_S
        }
    )


# --- reading a process (before the kill) ---------------------------------------------------------


def parse_unix_sockets(text: str) -> dict[int, str]:
    """``/proc/net/unix``: socket inode -> path, for sockets bound to a path."""
    out: dict[int, str] = {}
    for line in text.splitlines()[1:]:
        fields = line.split(None, 7)
        if len(fields) == 8 and fields[6].isdigit() and fields[7].startswith("/"):
            out[int(fields[6])] = fields[7]
    return out


def shm_inodes_in_maps(text: str) -> set[int]:
    """Inodes of the /dev/shm files mapped in ``/proc/PID/maps`` (a semaphore's shows the
    temporary name glibc made it under, ``(deleted)``: its inode is the one /dev/shm lists)."""
    inodes = set()
    for line in text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith(SHM_DIR + "/") and fields[4].isdigit():
            inodes.add(int(fields[4]))
    return inodes


def unix_sockets(pid: int) -> dict[int, str]:
    """Bound unix sockets of ``pid``'s network namespace: socket inode -> path."""
    raw = procfs.read(f"/proc/{pid}/net/unix", 8 << 20) or b""
    return parse_unix_sockets(raw.decode(errors="replace"))


def is_listener(path: str) -> bool:
    """A multiprocessing listener's socket (``.../pymp-XXXX/listener-XXXX``)."""
    parent, name = os.path.split(path)
    return name.startswith(LISTENER_PREFIX) and os.path.basename(parent).startswith(
        LISTENER_DIR_PREFIX
    )


def read_holding(
    pid: int, started: float, reader: procfs.ProcReader, sockets: Mapping[int, str]
) -> Holding:
    """What ``pid`` maps and has open now (``sockets``: from ``unix_sockets``). Bounded: a
    process whose maps cannot be read in time is known by its open files only."""
    maps = reader.file(pid, "maps", 16 << 20) or b""
    inodes = shm_inodes_in_maps(maps.decode(errors="replace"))
    listeners: set[tuple[str, int]] = set()
    base = f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):
        for fd in os.listdir(base):
            with contextlib.suppress(OSError, ValueError):
                link = os.readlink(f"{base}/{fd}")
                if link.startswith(SHM_DIR + "/"):
                    inodes.add(os.stat(f"{base}/{fd}").st_ino)
                elif link.startswith("socket:[") and (path := sockets.get(int(link[8:-1]))):
                    if is_listener(path):
                        listeners.add((path, os.lstat(path).st_ino))
    return Holding(pid, started, frozenset(inodes), frozenset(listeners))


def held_inodes(pids: Iterable[int], reader: procfs.ProcReader) -> set[int] | None:
    """The /dev/shm inodes that ``pids`` (processes that live on) map or have open now; None
    when the maps of one could not be read in time (then what it uses is unknown)."""
    out: set[int] = set()
    for pid in pids:
        unread = len(reader.unread)
        out |= read_holding(pid, 0.0, reader, {}).shm_inodes
        if len(reader.unread) > unread:
            return None
    return out


# --- removing (after the kill) -------------------------------------------------------------------


def shm_entries() -> list[ShmEntry]:
    """The multiprocessing/torch names in /dev/shm now, with their inodes and change times."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    out = []
    for name in names:
        if name.startswith(SHM_PREFIXES):
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(SHM_DIR, name))
                out.append(ShmEntry(name, st.st_ino, st.st_ctime))
    return out


def _unlink_if_same(path: str, inode: int) -> bool:
    """Unlink ``path`` if it still is the file ``inode`` (a name reused meanwhile stays)."""
    try:
        if os.lstat(path).st_ino != inode:
            return False
        os.unlink(path)
        return True
    except OSError:
        return False


def own_mp_tempdir() -> str | None:
    """This process's multiprocessing temp directory (``pymp-*``), if it made one: it lives on."""
    process = sys.modules.get("multiprocessing.process")
    current = getattr(process, "current_process", None)
    config = getattr(current(), "_config", {}) if current is not None else {}
    tempdir = config.get("tempdir") if isinstance(config, dict) else None
    return tempdir if isinstance(tempdir, str) else None


def remove(
    holdings: Iterable[Holding],
    killed: Iterable[int],
    since: float | None = None,
    living: Iterable[int] = (),
    keep_dirs: Iterable[str] | None = (),
) -> list[str]:
    """Remove what the killed processes left (see the module's docstring); returns what went.

    ``since``: when the test began (wall time); None: when the oldest killed process started (a
    fixture call's children, a session's leftovers). ``living``: processes of the tree that live
    on (their segments stay theirs); ``keep_dirs``: pymp directories that a living process uses
    (None: every directory stays, only the killed processes' sockets go).
    """
    holdings = list(holdings)
    dead = set(killed)
    if since is None:
        since = min((h.started for h in holdings if h.pid in dead), default=clock.wall())
    removed: list[str] = []
    kept = held_inodes(living, procfs.ProcReader(skip_disk_sleep=False)) if living else set()
    # kept None: a living process's maps were not read in time, so no segment is known to be
    # unused: all stay (a segment it maps, unlinked, could not be attached to by name again)
    entries = {e.name: e for e in shm_entries()} if kept is not None else {}
    for name in shm_to_unlink(holdings, dead, entries.values(), since, kept or ()):
        if _unlink_if_same(os.path.join(SHM_DIR, name), entries[name].inode):
            removed.append(name)
    present: dict[str, tuple[int, float]] = {}
    for path in {p for h in holdings if h.pid in dead for p, _ in h.sockets}:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISSOCK(st.st_mode):
                present[path] = (st.st_ino, st.st_ctime)
    dirs: set[str] = set()
    for path in sockets_to_remove(holdings, dead, present, since):
        if _unlink_if_same(path, present[path][0]):
            removed.append(path)
            dirs.add(os.path.dirname(path))
    if keep_dirs is None:
        return removed
    for directory in sorted(dirs - set(keep_dirs)):
        with contextlib.suppress(OSError):
            os.rmdir(directory)  # only when empty: whatever else is there is not ours to judge
            removed.append(directory)
    return removed
