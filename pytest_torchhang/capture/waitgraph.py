"""Read from /proc, before anything is signalled, what every thread of a tree waits for, and for whom."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from stat import S_ISFIFO

from .. import clock
from ..report import waits as w
from ..report.model import TaskWait, WaitEdge
from . import procfs, sockets
from .syscalls import F_SETLKW, FD_READS, FD_WRITES, FUTEX_PRIVATE, SLEEPS, SYSCALLS, timed

#: The whole read is bounded: past this, threads keep their syscall but objects are not resolved.
BUDGET_S = 0.5
#: At most this many threads are read per process (a torch process may run dozens of idle ones).
MAX_TASKS = 64
#: At most this many descriptors of one poll/select are followed.
MAX_POLL_FDS = 64

_LITTLE = sys.byteorder == "little"


@dataclass
class Member:
    """One process of the tree as /proc showed it at the deadline."""

    pid: int
    ppid: int = 0
    state: str = "?"  # the letter of /proc/PID/stat
    wait_status: int | None = None  # zombies: what wait() will return (the status word)
    cpu_ticks: int = 0
    tasks: list[TaskWait] = field(default_factory=list)

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")

    @property
    def gone(self) -> bool:
        return self.state in ("Z", "X", "gone")


@dataclass
class Evidence:
    """Every member's threads and the edges between them; read in one bounded pass."""

    members: dict[int, Member] = field(default_factory=dict)
    read_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def describe_exit(status: int | None) -> str:
    """``exited with code 1`` / ``killed by SIGKILL`` from a wait status word."""
    if status is None:
        return "gone (exit status unknown)"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(sig).name}"
        return f"killed by signal {sig}"
    return f"exited with code {os.WEXITSTATUS(status)}"


_read = procfs.text  # files that never block; maps and mem go through the bounded reader


class _Reader:
    """One pass over the tree; caches what several threads share (fd tables, maps, sockets)."""

    def __init__(
        self, pids: list[int], skip_tids: set[int], deadline: float, proc: procfs.ProcReader
    ) -> None:
        self.pids = pids
        self.proc = proc
        self.skip_tids = skip_tids
        self.deadline = deadline
        self._fds: dict[int, dict[int, str]] = {}
        self._holders: dict[str, list[tuple[int, int]]] | None = None
        self._maps: dict[int, list[tuple[int, int, str, str]]] = {}
        self._tcp: dict[str, tuple[str, str, str]] | None = None  # inode -> local, remote, state
        self._unix_peers: dict[str, str] | None = None
        self._locks: list[tuple[bool, str, str, int]] | None = None
        self.members: dict[int, Member] = {}
        #: when the test began, on the clock of /proc's start times (boot time, seconds)
        self.began_boot_s: float | None = None

    def late(self) -> bool:
        return clock.monotonic() > self.deadline

    # --- per-process tables -------------------------------------------------------------------

    def fds(self, pid: int) -> dict[int, str]:
        if pid not in self._fds:
            table: dict[int, str] = {}
            base = f"/proc/{pid}/fd"
            with contextlib.suppress(OSError):
                for name in os.listdir(base):
                    with contextlib.suppress(OSError, ValueError):
                        table[int(name)] = os.readlink(f"{base}/{name}")
            self._fds[pid] = table
        return self._fds[pid]

    def holders(self, obj: str) -> list[tuple[int, int]]:
        """Every (pid, fd) of the tree that holds ``obj`` (``pipe:[123]``, a path, ...)."""
        if self._holders is None:
            index: dict[str, list[tuple[int, int]]] = {}
            for pid in self.pids:
                for fd, target in self.fds(pid).items():
                    index.setdefault(target, []).append((pid, fd))
            self._holders = index
        return self._holders.get(obj, [])

    def writable(self, pid: int, fd: int) -> bool | None:
        text = _read(f"/proc/{pid}/fdinfo/{fd}", 512)
        match = re.search(r"^flags:\s*([0-7]+)", text, re.M)
        if not match:
            return None
        return int(match.group(1), 8) & 3 != 0  # O_WRONLY or O_RDWR

    def maps(self, pid: int) -> list[tuple[int, int, str, str]]:
        """Shared file mappings of ``pid``: (start, end, inode key, path)."""
        if pid not in self._maps:
            out = []
            raw = self.proc.file(pid, "maps", 4 << 20) or b""
            for line in raw.decode(errors="replace").splitlines():
                parts = line.split(None, 5)
                if len(parts) < 6 or parts[1][3] != "s" or parts[4] == "0":
                    continue
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, f"{parts[3]}:{parts[4]}", parts[5]))
            self._maps[pid] = out
        return self._maps[pid]

    def tcp(self) -> dict[str, tuple[str, str, str]]:
        if self._tcp is None:
            table: dict[str, tuple[str, str, str]] = {}
            for name in ("tcp", "tcp6"):
                for line in _read(f"/proc/net/{name}", 8 << 20).splitlines()[1:]:
                    parts = line.split()
                    if len(parts) >= 10:
                        table[parts[9]] = (parts[1], parts[2], parts[3])
            self._tcp = table
        return self._tcp

    def unix_peers(self) -> dict[str, str]:
        if self._unix_peers is None:
            self._unix_peers = sockets.unix_peers()
        return self._unix_peers

    def locks(self) -> list[tuple[bool, str, str, int]]:
        """/proc/locks as (blocked?, kind, dev:inode, pid)."""
        if self._locks is None:
            out = []
            for line in _read("/proc/locks", 1 << 20).splitlines():
                parts = line.split()
                blocked = len(parts) > 1 and parts[1] == "->"
                if blocked:
                    parts = parts[:1] + parts[2:]
                if len(parts) < 6:
                    continue
                with contextlib.suppress(ValueError):
                    major, minor, inode = parts[5].split(":")
                    key = f"{int(major, 16)}:{int(minor, 16)}:{inode}"
                    out.append((blocked, parts[1], key, int(parts[4])))
            self._locks = out
        return self._locks

    # --- one thread ---------------------------------------------------------------------------

    def task(self, pid: int, tid: int) -> TaskWait:
        base = f"/proc/{pid}/task/{tid}"
        stat = procfs.stat(pid, tid)
        task = TaskWait(
            tid=tid,
            name=_read(f"{base}/comm", 64).strip(),
            state=stat.state if stat else "?",
        )
        raw = _read(f"{base}/syscall", 256).split()
        wchan = _read(f"{base}/wchan", 128).strip()
        task.wchan = "" if wchan == "0" else wchan
        if not raw:
            task.call = "" if task.state != "R" else "running"
            return task
        if raw[0] == "running":
            task.call = "running"
            return task
        try:
            nr = int(raw[0])
            args = [int(x, 16) for x in raw[1:7]]
            task.sp = int(raw[7], 16) if len(raw) > 7 else 0
        except ValueError:
            return task
        if nr == -1:
            task.call = "running"  # in user space, between system calls
            return task
        task.call = SYSCALLS.get(nr, f"syscall {nr}")
        task.args = args
        task.timed = timed(task.call, args)
        if not self.late():
            with contextlib.suppress(OSError, ValueError, IndexError):
                self._resolve(pid, task)
        return task

    def _resolve(self, pid: int, task: TaskWait) -> None:
        call, args = task.call, task.args
        if call in FD_READS or call in FD_WRITES:
            self._fd_wait(pid, task, args[0], write=call in FD_WRITES)
        elif call in ("poll", "ppoll"):
            for fd in self._poll_fds(pid, args[0], args[1]):
                self._fd_wait(pid, task, fd, write=False)
        elif call in ("select", "pselect6"):
            for fd in self._select_fds(pid, args[0], args[1]):
                self._fd_wait(pid, task, fd, write=False)
        elif call.startswith("epoll"):
            info = _read(f"/proc/{pid}/fdinfo/{args[0]}", 16384)
            for fd in re.findall(r"^tfd:\s*(\d+)", info, re.M)[:MAX_POLL_FDS]:
                self._fd_wait(pid, task, int(fd), write=False)
        elif call == "futex":
            self._futex(pid, task, args[0], args[1])
        elif call == "flock" or (call == "fcntl" and args[1] in F_SETLKW):
            self._file_lock(pid, task, args[0])
        elif call in ("wait4", "waitid"):
            self._wait_child(pid, task, args)
        elif call in ("open", "openat"):
            # open(path, flags) or openat(dirfd, path, flags): only a FIFO's open blocks
            self._fifo_open(pid, task, *(args[0:2] if call == "open" else args[1:3]))
        elif call in SLEEPS:
            self._set(task, w.Sleep())

    @staticmethod
    def _set(task: TaskWait, wait: w.WaitObject) -> None:
        """The thread's wait object, and its text (several descriptors of a poll: the first is
        the object, the text names them all)."""
        if task.wait is None:
            task.wait = wait
            task.obj = wait.summary()
        else:
            task.obj = f"{task.obj}, {wait.summary()}"

    def _fd_wait(self, pid: int, task: TaskWait, fd: int, write: bool) -> None:
        target = self.fds(pid).get(fd)
        if target is None:
            return
        is_fifo = not target.startswith("pipe:") and _is_fifo(pid, fd)
        if target.startswith("pipe:"):
            self._set(task, w.Pipe(fd, target[len("pipe:[") : -1]))
        elif is_fifo:
            self._set(task, w.Fifo(target, fd))
        elif not target.startswith("socket:"):
            self._set(task, w.OtherFile(fd, target))
        if target.startswith("pipe:") or is_fifo:
            want_writer = not write
            ends = []
            for holder, hfd in self.holders(target):
                writes = self.writable(holder, hfd)
                if writes is None or writes == want_writer:
                    ends.append(holder)
            role = "write" if want_writer else "read"
            kind = w.HOLDS_WRITE_END if want_writer else w.HOLDS_READ_END
            pids = sorted(set(ends))
            if not pids:
                # a blocked read means a writer exists (else it would read EOF): outside the tree
                task.waits_for.append(
                    WaitEdge(
                        -1,
                        0,
                        f"{target}, whose {role} end only processes outside the tree hold",
                        w.OUTSIDE,
                    )
                )
            for other in pids:
                own = " (its own copy)" if other == pid else ""
                task.waits_for.append(
                    WaitEdge(other, 0, f"{target}, whose {role} end it holds{own}", kind)
                )
        elif target.startswith("socket:"):
            inode = target[len("socket:[") : -1]
            peer = self._socket_peer(inode)
            if peer is None:
                self._set(task, w.Socket(fd, inode))
                return
            kind, peer_inode, where = peer
            self._set(task, self._socket(fd, inode, kind))
            owners = sorted({h for h, _ in self.holders(f"socket:[{peer_inode}]")})
            if kind.startswith("listening"):
                task.waits_for.append(
                    WaitEdge(-1, 0, f"{kind} {target}{where}: a client to connect", w.LISTENING)
                )
            elif not owners:
                task.waits_for.append(
                    WaitEdge(
                        -1, 0, f"{kind} {target}{where}, whose peer is outside the tree", w.OUTSIDE
                    )
                )
            for other in owners:
                via = f"{kind} {target}{where}, whose peer it holds"
                task.waits_for.append(WaitEdge(other, 0, via, w.SOCKET_PEER))
        elif target.startswith("/") and not target.startswith(("/dev/", "/proc/")):
            task.waits_for.append(WaitEdge(-1, 0, f"file {target}", w.FILE))

    def _socket(self, fd: int, inode: str, kind: str) -> w.Socket:
        """The socket as data: its family, and its TCP addresses (``host:port``)."""
        tcp = self.tcp().get(inode)
        if tcp is None:
            return w.Socket(fd, inode, family="unix" if kind.startswith("unix") else "")
        local, remote, _state = tcp
        listening = kind.startswith("listening")
        return w.Socket(
            fd,
            inode,
            family="tcp",
            local=sockets.address(local),
            remote="" if listening else sockets.address(remote),
            listening=listening,
        )

    def _socket_peer(self, inode: str) -> tuple[str, str, str] | None:
        tcp = self.tcp().get(inode)
        if tcp is not None:
            local, remote, _state = tcp
            for other, (l2, r2, _s2) in self.tcp().items():
                if l2 == remote and r2 == local:
                    return (
                        "tcp socket",
                        other,
                        f" ({sockets.address(local)} -> {sockets.address(remote)})",
                    )
            if remote.endswith(":0000"):
                return "listening tcp socket", "", f" ({sockets.address(local)})"
            return "tcp socket", "", f" ({sockets.address(local)} -> {sockets.address(remote)})"
        peer = self.unix_peers().get(inode)
        if peer is not None:
            return "unix socket", peer, ""
        return None

    def _fifo_open(self, pid: int, task: TaskWait, addr: int, flags: int) -> None:
        """An open that blocks: a FIFO waiting for a process to open its other end. The object
        says which end it opens and who holds the FIFO already (``FIFO /p, opening it for
        reading; open for reading in pid 12``); no edge: nobody in the tree is its releaser."""
        path = self._c_string(pid, addr)
        if not path:
            return
        if not path.startswith("/"):  # relative to the working directory (AT_FDCWD)
            path = os.path.join(os.readlink(f"/proc/{pid}/cwd"), path)
        if not S_ISFIFO(os.stat(path).st_mode):
            return
        reading = flags & 3 == os.O_RDONLY
        held = []
        for holder, hfd in self.holders(os.path.realpath(path)):
            end = self.writable(holder, hfd)
            held.append(f"pid {holder} ({'?' if end is None else 'write' if end else 'read'})")
        self._set(
            task,
            w.Fifo(
                path,
                opening="reading" if reading else "writing",
                held=f"open in {', '.join(held)}" if held else "no process of the tree has it open",
            ),
        )

    def _c_string(self, pid: int, addr: int) -> str:
        """A NUL-terminated string of ``pid``'s memory (a path), read a page at a time (a read
        across an unmapped page stops there); empty when unreadable."""
        data = b""
        while addr and len(data) < 4096:
            chunk = self._mem(pid, addr + len(data), 4096 - (addr + len(data)) % 4096)
            data += chunk
            if not chunk or b"\0" in chunk:
                break
        end = data.find(b"\0")
        return data[:end].decode(errors="replace") if end > 0 else ""

    def _mem(self, pid: int, addr: int, size: int) -> bytes:
        return self.proc.mem(pid, addr, size) or b""  # not read: the reader notes why

    def _poll_fds(self, pid: int, addr: int, nfds: int) -> list[int]:
        nfds = min(nfds, MAX_POLL_FDS)
        data = self._mem(pid, addr, 8 * nfds)
        fds = [struct.unpack_from("i", data, 8 * i)[0] for i in range(len(data) // 8)]
        return [fd for fd in fds if fd >= 0]

    def _select_fds(self, pid: int, nfds: int, addr: int) -> list[int]:
        if not addr:
            return []
        data = self._mem(pid, addr, (min(nfds, 1024) + 7) // 8)
        return [i for i in range(len(data) * 8) if data[i // 8] >> (i % 8) & 1][:MAX_POLL_FDS]

    def _futex(self, pid: int, task: TaskWait, addr: int, op: int) -> None:
        if op & FUTEX_PRIVATE:
            self._set(task, w.Futex(addr))
            others = [t for t in os.listdir(f"/proc/{pid}/task") if int(t) != task.tid]
            others = [t for t in others if int(t) not in self.skip_tids]
            if not others:
                task.waits_for.append(
                    WaitEdge(0, 0, "no other thread in this process can release it", w.NOBODY)
                )
            else:  # one edge for all of them: any other thread of this process may release it
                via = f"one of the {len(others)} other thread(s) of this process"
                task.waits_for.append(WaitEdge(pid, 0, via, w.THREAD))
            return
        mapping = next(((k, p) for s, e, k, p in self.maps(pid) if s <= addr < e), None)
        if mapping is None:
            unread = any(u.pid == pid and u.what == "maps" for u in self.proc.unread)
            self._set(
                task, w.Futex(addr, private=False, note="its maps were not read" if unread else "")
            )
            return
        key, path = mapping
        if path.startswith("/dev/shm/sem."):
            self._set(task, self._semaphore(pid, addr, path))
        else:
            self._set(task, w.Futex(addr, private=False, path=path))
        sharers = [
            p for p in self.pids if p != pid and any(k == key for _, _, k, _ in self.maps(p))
        ]
        threads = len(os.listdir(f"/proc/{pid}/task"))
        if not sharers and threads <= 1:
            task.waits_for.append(
                WaitEdge(0, 0, f"{path}, which no other process of the tree maps", w.NOBODY)
            )
        if threads > 1:
            task.waits_for.append(
                WaitEdge(pid, 0, f"{path}, which another thread of this process may post", w.THREAD)
            )
        for other in sharers:
            task.waits_for.append(WaitEdge(other, 0, f"{path}, which it maps too", w.MAPS))

    def _semaphore(self, pid: int, addr: int, path: str) -> w.Semaphore:
        """A POSIX semaphore and its count: glibc keeps the count in the 32-bit word the
        waiters sleep on (the low half of ``sem_t``'s 64-bit value, the waiters' count in the
        high half), read from the process's memory."""
        if self.late():
            return w.Semaphore(addr, path, unread="the capture's time ran out")
        data = self._mem(pid, addr, 4)
        if len(data) < 4:
            return w.Semaphore(addr, path, unread="its memory could not be read")
        return w.Semaphore(addr, path, value=struct.unpack("<I" if _LITTLE else ">I", data)[0])

    def _file_lock(self, pid: int, task: TaskWait, fd: int) -> None:
        path = self.fds(pid).get(fd, f"fd {fd}")
        st = os.stat(f"/proc/{pid}/fd/{fd}")
        key = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}:{st.st_ino}"
        self._set(task, w.FileLock(path))
        held = sorted({p for blocked, _k, k, p in self.locks() if k == key and not blocked})
        for holder in held:
            known = holder in self.pids or holder <= 0
            task.waits_for.append(
                WaitEdge(
                    holder if known else -1,
                    0,
                    f"the lock it holds on {path}",
                    w.LOCK_HOLDER if known else w.OUTSIDE,
                )
                if holder > 0
                else WaitEdge(-1, 0, f"an open-file-description lock on {path}", w.OUTSIDE)
            )

    def _wait_child(self, pid: int, task: TaskWait, args: list[int]) -> None:
        if task.call == "wait4":
            target = args[0] if args[0] < 1 << 31 else args[0] - (1 << 64)
        else:  # waitid(idtype, id, ...): P_PID = 1
            target = args[1] if args[0] == 1 else -1
        children = procfs.children(pid)
        wanted = [target] if target > 0 else children
        self._set(task, w.ChildExit(target if target > 0 else -1))
        for child in wanted:
            task.waits_for.append(
                WaitEdge(child, 0, "its exit (the parent waits for its child)", w.CHILD)
            )
        if not wanted:
            task.waits_for.append(WaitEdge(0, 0, "no child left to wait for", w.NOBODY))


def _is_fifo(pid: int, fd: int) -> bool:
    try:
        return S_ISFIFO(os.stat(f"/proc/{pid}/fd/{fd}").st_mode)
    except OSError:
        return False


#: Start times in /proc count clock ticks (10 ms): a process started with the test may read
#: up to a tick earlier than the test's own start.
_TICK_SLACK_S = 0.05


def _started_before(began_boot_s: float, pid: int, tid: int | None = None) -> bool:
    """Whether ``pid`` (or its thread ``tid``) started before the test began (``began_boot_s``,
    boot-clock seconds). Both sides are instants, not ages: how late the capture reads them
    changes nothing (ages taken at two moments made a busy machine's answer differ)."""
    stat = procfs.stat(pid, tid)
    if stat is None:
        return True
    return stat.start_ticks / procfs.TICKS < began_boot_s - _TICK_SLACK_S


def _member(reader: _Reader, pid: int) -> Member:
    stat = procfs.stat(pid)
    if stat is None:
        return Member(pid, state="gone")
    member = Member(pid, ppid=stat.ppid, state=stat.state, cpu_ticks=stat.cpu_ticks)
    if member.state in ("Z", "X"):
        member.wait_status = stat.wait_status
        return member
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return member
    for tid in tids[:MAX_TASKS]:
        if tid in reader.skip_tids:
            continue
        task = reader.task(pid, tid)
        if reader.began_boot_s is not None and tid != pid:
            task.before_test = _started_before(reader.began_boot_s, pid, tid)
        member.tasks.append(task)
    return member


def read(
    pids: Iterable[int],
    skip_tids: set[int] | None = None,
    budget_s: float = BUDGET_S,
    began: float | None = None,
    proc: procfs.ProcReader | None = None,
) -> Evidence:
    """What every thread of ``pids`` (and their zombie children) waits for, bounded by ``budget_s``.

    ``skip_tids``: threads of the calling process that belong to the capture itself;
    ``began``: when the test began (``clock.monotonic()``); zombies older than that are left
    out (an earlier test's leftovers), and threads older than that are marked ``before_test``.
    Nothing is signalled or traced; files that cannot be read leave their fields empty. Reads
    that can block go through ``proc`` (a capture's reader, which then holds their notes).
    """
    start = clock.monotonic()
    wanted = list(dict.fromkeys(pids))
    own_reader = proc is None
    proc = proc or procfs.ProcReader(deadline=start + budget_s)
    reader = _Reader(wanted, skip_tids or set(), start + budget_s, proc)
    if began is not None:  # the monotonic instant on the boot clock, both read at one moment
        reader.began_boot_s = began + clock.boottime() - clock.monotonic()
    evidence = Evidence()
    for pid in wanted:
        evidence.members[pid] = _member(reader, pid)
    # zombie children of members: a rank, a Pool worker, a DataLoader worker that is gone but
    # whose exit status is still there to read
    for pid in list(wanted):
        for child in procfs.children(pid):
            if child not in evidence.members:
                member = _member(reader, child)
                # (start times are counted in clock ticks: allow one)
                began_boot_s = reader.began_boot_s
                if member.gone and (
                    began_boot_s is None or not _started_before(began_boot_s, child)
                ):
                    evidence.members[child] = member
    if reader.late():
        evidence.notes.append(
            f"wait-for graph: the {budget_s:.1f}s budget ran out; some objects were not resolved"
        )
    if own_reader:
        evidence.notes += proc.notes()
    evidence.read_s = clock.monotonic() - start
    return evidence


def cpu_s(pid: int, skip_tids: set[int] | None = None) -> float:
    """CPU seconds of ``pid``'s threads, without ``skip_tids`` (the capture's own threads)."""
    ticks = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        if skip_tids and int(tid) in skip_tids:
            continue
        stat = procfs.stat(pid, int(tid))
        ticks += stat.cpu_ticks if stat is not None else 0
    return ticks / procfs.TICKS
