"""What a blocked thread waits on, as tagged values: the capture writes them, rules read them.

Each kind is a small frozen data class with a ``kind`` tag and one ``summary()``, the only text
made of it. The JSON form is the class's fields plus ``kind``; :func:`from_json` reads it back,
and :func:`from_text` reads the English object of reports written before waits were data
(``fd 3: pipe:[307072]``, ``file lock on /tmp/x``), so old reports stay readable.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar


@dataclass(frozen=True)
class Pipe:
    """An anonymous pipe (``os.pipe()``, a Connection, a Queue, a child's stdout)."""

    kind: ClassVar[str] = "pipe"
    fd: int
    inode: str

    def summary(self) -> str:
        return f"fd {self.fd}: pipe:[{self.inode}]"


@dataclass(frozen=True)
class Fifo:
    """A named pipe: read or written through a descriptor, or being opened (``opening``)."""

    kind: ClassVar[str] = "fifo"
    path: str
    fd: int = -1
    opening: str = ""  # "reading" / "writing" while blocked in open()
    held: str = ""  # who holds it open, in words, while opening

    def summary(self) -> str:
        if self.opening:
            return f"FIFO {self.path}, opening it for {self.opening}; {self.held}"
        return f"fd {self.fd}: {self.path}"


@dataclass(frozen=True)
class Futex:
    """A futex: private to a process (a lock, a condition), or in a shared mapping."""

    kind: ClassVar[str] = "futex"
    addr: int
    private: bool = True
    path: str = ""  # the shared file it lies in
    note: str = ""  # why the mapping is unknown (its maps were not read)

    def summary(self) -> str:
        if self.private:
            return f"futex {self.addr:#x} private to this process (a lock, condition or event)"
        if self.path:
            return f"futex {self.addr:#x} in {self.path}"
        return f"futex {self.addr:#x} (shared{'; ' + self.note if self.note else ''})"


@dataclass(frozen=True)
class Semaphore:
    """A POSIX semaphore in /dev/shm (multiprocessing's SemLock: Lock, Semaphore, Event...),
    with its count when it could be read (None: not read, ``unread`` says why)."""

    kind: ClassVar[str] = "semaphore"
    addr: int
    path: str
    value: int | None = None
    unread: str = ""

    def summary(self) -> str:
        count = f"count {self.value}" if self.value is not None else f"count unread: {self.unread}"
        return f"futex {self.addr:#x} in {self.path} (a semaphore, {count})"


@dataclass(frozen=True)
class FileLock:
    """An flock or fcntl lock on a file."""

    kind: ClassVar[str] = "file_lock"
    path: str

    def summary(self) -> str:
        return f"file lock on {self.path}"


@dataclass(frozen=True)
class Socket:
    """A socket: TCP with its addresses (``host:port``), or unix; ``listening`` for a server's."""

    kind: ClassVar[str] = "socket"
    fd: int
    inode: str
    family: str = ""  # "tcp", "unix", "" unknown
    local: str = ""
    remote: str = ""
    listening: bool = False

    def summary(self) -> str:
        return f"fd {self.fd}: socket:[{self.inode}]"


@dataclass(frozen=True)
class StoreKey:
    """A key of a torch.distributed store that a rank waits for."""

    kind: ClassVar[str] = "store_key"
    key: str

    def summary(self) -> str:
        return f"store key {self.key!r}"


@dataclass(frozen=True)
class Sleep:
    """A sleep: a timed wait or a retry loop."""

    kind: ClassVar[str] = "sleep"

    def summary(self) -> str:
        return "sleeping (a timed wait or a retry loop)"


@dataclass(frozen=True)
class ChildExit:
    """wait4/waitid: the exit of one child (``pid``), or of any (``pid`` -1)."""

    kind: ClassVar[str] = "child_exit"
    pid: int = -1

    def summary(self) -> str:
        return f"waits for child {self.pid} to exit" if self.pid > 0 else "waits for any child"


@dataclass(frozen=True)
class OtherFile:
    """A descriptor on anything else (a regular file, a device, an eventfd)."""

    kind: ClassVar[str] = "file"
    fd: int
    target: str

    def summary(self) -> str:
        return f"fd {self.fd}: {self.target}"


WaitObject = (
    Pipe | Fifo | Futex | Semaphore | FileLock | Socket | StoreKey | Sleep | ChildExit | OtherFile
)
_KINDS: dict[str, type[Any]] = {
    cls.kind: cls
    for cls in (
        Pipe, Fifo, Futex, Semaphore, FileLock, Socket, StoreKey, Sleep, ChildExit, OtherFile
    )
}  # fmt: skip


#: Kinds of :class:`~pytest_torchhang.report.model.WaitEdge`: what the other process is to it.
HOLDS_WRITE_END = "holds_write_end"  # it holds the write end of the pipe this thread reads
HOLDS_READ_END = "holds_read_end"  # it holds the read end of the pipe this thread writes
SOCKET_PEER = "socket_peer"  # it holds the other end of the socket
LISTENING = "listening"  # the socket listens: a client must connect
MAPS = "maps"  # it maps the shared memory the futex lies in
THREAD = "thread"  # another thread of this process may release it
LOCK_HOLDER = "lock_holder"  # it holds the file lock
CHILD = "child"  # the parent waits for this child's exit
NOBODY = "nobody"  # no process of the tree can end the wait (a signal still may)
OUTSIDE = "outside"  # something outside the tree holds the other end
FILE = "file"  # a regular file: no process releases it


_EDGE_WORDS = (
    ("whose write end", HOLDS_WRITE_END),
    ("whose read end", HOLDS_READ_END),
    ("whose peer it holds", SOCKET_PEER),
    ("a client to connect", LISTENING),
    ("which it maps too", MAPS),
    ("other thread", THREAD),
    ("another thread", THREAD),
    ("the lock it holds", LOCK_HOLDER),
    ("its exit", CHILD),
)


def edge_kind_from_text(pid: int, via: str) -> str:
    """The kind of an edge of a report written before edges had kinds, from its words."""
    if pid == 0:
        return NOBODY
    if pid < 0:
        return FILE if via.startswith("file ") else OUTSIDE
    return next((kind for words, kind in _EDGE_WORDS if words in via), "")


def to_json(wait: WaitObject | None) -> dict[str, Any] | None:
    """The JSON form: the fields and ``kind``."""
    return None if wait is None else {"kind": wait.kind, **asdict(wait)}


def from_json(doc: dict[str, Any] | None) -> WaitObject | None:
    """A wait object back from :func:`to_json`'s form; None for an unknown kind (a newer one)."""
    if not doc:
        return None
    cls = _KINDS.get(str(doc.get("kind")))
    if cls is None:
        return None
    names = {f.name for f in fields(cls)}
    wait: WaitObject = cls(**{k: v for k, v in doc.items() if k in names})
    return wait


_FD = re.compile(r"^fd (\d+): (.+)$")
_FUTEX = re.compile(r"^futex (0x[0-9a-f]+)(?: in (.+)| \(shared(?:; (.+))?\)| private.*)$")
_FIFO_OPEN = re.compile(r"^FIFO (.+), opening it for (reading|writing); (.*)$")


_ADDRESSES = re.compile(
    r"^(tcp|unix|listening tcp) socket socket:\[\d+\](?: \((\S+?)(?: -> (\S+?))?\))?"
)


def from_text(call: str, text: str, vias: tuple[str, ...] = ()) -> WaitObject | None:
    """The wait object of a report written before waits were data, from its English ``obj``
    (the words the capture of that time wrote) and its edges' (``vias``: a socket's addresses);
    None where it does not read as one."""
    if not text:
        return None
    first = text.split(", fd ")[0]  # a poll over several descriptors: the first one
    if match := _FD.match(first):
        fd, target = int(match.group(1)), match.group(2)
        if target.startswith("pipe:["):
            return Pipe(fd, target[6:-1])
        if target.startswith("socket:["):
            for via in vias:
                if found := _ADDRESSES.match(via):
                    family, local, remote = found.groups()
                    return Socket(
                        fd,
                        target[8:-1],
                        family="unix" if family == "unix" else "tcp",
                        local=local or "",
                        remote=remote or "",
                        listening=family.startswith("listening"),
                    )
            return Socket(fd, target[8:-1])
        return OtherFile(fd, target)
    if match := _FUTEX.match(text):
        addr = int(match.group(1), 16)
        if match.group(2):
            path = match.group(2)
            if path.startswith("/dev/shm/sem."):
                return Semaphore(addr, path, unread="written before counts were read")
            return Futex(addr, private=False, path=path)
        if text.endswith(")") and "(shared" in text:
            return Futex(addr, private=False, note=match.group(3) or "")
        return Futex(addr)
    if match := _FIFO_OPEN.match(text):
        return Fifo(match.group(1), opening=match.group(2), held=match.group(3))
    if text.startswith("file lock on "):
        return FileLock(text[len("file lock on ") :])
    if text.startswith("waits for child "):
        return ChildExit(int(text.split()[3]))
    if text == "waits for any child":
        return ChildExit()
    if text.startswith("sleeping"):
        return Sleep()
    return None


@dataclass
class WaitEnd:
    """One who could end a wait, and what it is doing now or did last (issue 28, item 2)."""

    pid: int
    thread: str = ""  # a thread's name; "" for the process itself
    who: str = ""  # ``pytest (pid 7)``, ``thread 'loader-a' of pytest (pid 7)``
    state: str = ""  # "waits", "idle", "exited", "running", "sleeps", "stopped", "itself"
    where: str = ""  # ``Barrier.wait() at x.py:18``, ``exited with code 1``
    last_lines: list[str] = field(default_factory=list)  # an exited one's last stderr lines
    #: an exited one's uncaught exception, read from the traceback of its stderr: its line
    #: (``KeyError: 'total'``), the user's frame that raised it (``f at x.py:3``), and the
    #: library frame that called the user's code (``worker at multiprocessing/pool.py:109, as
    #: initializer``); empty where its stderr holds no traceback
    exception: str = ""
    raised_in: str = ""
    called_by: str = ""


@dataclass
class WaitFacts:
    """A blocked thread's wait as data: the object it waits on and both ends of it."""

    pid: int
    thread: str  # the waiting thread's name
    waits_in: str  # ``queue.Queue.put() at x.py:26``, ``recvfrom from 127.0.0.1:80``
    ends: list[WaitEnd] = field(default_factory=list)  # who could end it
    known: list[str] = field(default_factory=list)  # facts about the wait, in words


def facts_from_json(doc: dict[str, Any]) -> WaitFacts:
    """A hint's ``waits`` entry, read back from the JSON report."""
    return WaitFacts(**{**doc, "ends": [WaitEnd(**e) for e in doc.get("ends", [])]})
