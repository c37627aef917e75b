"""The HangReport model: the data that flows between rooms, and its versioned JSON document."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import clock
from . import signals, waits
from .signals import SignalFacts
from .waits import WaitFacts, WaitObject

#: Version of the JSON document written per hang; bump on incompatible changes.
SCHEMA_VERSION = 1
#: CPU time used during the capture from which a process counts as computing rather than waiting
#: (the capture's second look and the diagnosis read the same line).
BUSY_CPU_S = 0.02

# The vocabulary of roles that several rooms decide on, in one place (issue 30).
#: Kinds of processes that wait by design (helpers): they name the hang only when nothing else does.
MANAGER_SERVER = "Manager server"
HELPER_KINDS = (MANAGER_SERVER, "resource_tracker", "forkserver", "torch_shm_manager", "zygote")
#: How a process the hung test did not start is shown: never signalled, never killed.
CONTEXT_ROLE = "started before this test"
#: How a worker of a pool that a wider-scoped fixture owns is shown: with its stacks, never killed.
KEPT_ROLE = "fixture-owned worker"
#: Roles of processes shown for context, which are not the test's own (a helper's role follows).
ASIDE_ROLES = (CONTEXT_ROLE, KEPT_ROLE)


@dataclass(frozen=True)
class Frame:
    """One Python frame; ``line`` is the source text when the file can be read."""

    filename: str
    lineno: int
    name: str
    line: str = ""


@dataclass
class ThreadStack:
    """One thread's stack, most recent call first."""

    ident: str
    name: str = ""
    current: bool = False
    frames: list[Frame] = field(default_factory=list)
    truncated: bool = False
    tid: int = 0  # the kernel thread id, when known (this process's own threads)


@dataclass
class WaitEdge:
    """One edge of the wait-for graph: a thread waits for process ``pid`` through ``via``.

    ``pid`` 0: no process can end the wait; -1: something outside the tree (a file, a timer);
    ``tid`` 0: any thread of ``pid``.
    """

    pid: int
    tid: int = 0
    via: str = ""
    #: what ``pid`` is to the wait (``report.waits.HOLDS_WRITE_END``, ``CHILD``, ...); "" in
    #: reports written before edges had kinds
    kind: str = ""


@dataclass
class TaskWait:
    """One kernel thread at the deadline, read from /proc before anything was signalled."""

    tid: int
    name: str = ""  # /proc/PID/task/TID/comm
    state: str = "?"  # the /proc state letter: R, S, D, T (stopped), Z, ...
    call: str = ""  # the blocked system call, "running", or "" when unreadable
    args: list[int] = field(default_factory=list)
    wchan: str = ""
    obj: str = ""  # the object behind the call: "fd 3: pipe:[307072]", "file lock on /tmp/x", ...
    waits_for: list[WaitEdge] = field(default_factory=list)
    sp: int = 0  # stack pointer (matches the thread to its Python stack)
    python_thread: str = ""  # ident of the Python thread this is, when known
    before_test: bool = False  # started before the test began (an earlier test's, a session's)
    timed: bool = False  # the wait has a timeout: the thread wakes up by itself
    #: the object as data (``report.waits``); ``obj`` is its summary, for readers of the text
    wait: WaitObject | None = None

    def summary(self) -> str:
        """``read(fd 3: pipe:[307072]) [anon_pipe_read]``, or ``running``."""
        if self.call in ("", "running"):
            return self.call or "unknown (unreadable)"
        wchan = f" [{self.wchan}]" if self.wchan else ""
        return f"{self.call}({self.obj}){wchan}" if self.obj else f"{self.call}{wchan}"


@dataclass
class Collective:
    """One flight-recorder entry of a rank: a collective it started, finished or not."""

    seq: int  # collective_seq_id within its process group
    name: str  # "all_reduce", "barrier", ...
    group: str = ""
    sizes: list[list[int]] = field(default_factory=list)
    completed: bool = False

    def label(self) -> str:
        """``#12 all_reduce([1024])``."""
        sizes = ", ".join(str(s) if s else "scalar" for s in self.sizes)
        return f"#{self.seq} {self.name}" + (f"({sizes})" if sizes else "")


@dataclass
class StoreWait:
    """A thread of a rank that waits in a torch.distributed store (``store.get``/``store.wait``)
    for a key, as the process recorded it, with the keys the store held at the capture."""

    thread: str  # ident of the Python thread that waits (as ``ThreadStack.ident``)
    method: str  # "get" or "wait"
    keys: list[str] = field(default_factory=list)  # the key(s) waited for, as the call named them
    store: str = ""  # the store's class: FileStore, TCPStore, PrefixStore, HashStore
    under: str = ""  # the store a PrefixStore wraps (its prefix is not known)
    prefixed: bool = False  # the keys are looked up under a PrefixStore's prefix
    path: str = ""  # a FileStore's file
    address: str = ""  # a TCPStore's host:port
    waited_s: float = 0.0  # how long the call had waited at the capture
    #: the keys the store held at the capture (a FileStore's file, read from outside), in the
    #: order they were first set; None when they could not be read (``keys_note`` says why)
    keys_set: list[str] | None = None
    keys_note: str = ""

    def call(self) -> str:
        """``store.get('ready_2')``, ``store.wait(['a', 'b'])``."""
        keys = repr(self.keys[0]) if self.method == "get" and self.keys else repr(self.keys)
        return f"store.{self.method}({keys})"

    def where(self) -> str:
        """``FileStore /tmp/x``, ``TCPStore 127.0.0.1:29500``, ``PrefixStore over FileStore``."""
        inner = f" over {self.under}" if self.under else ""
        place = self.path or self.address
        return f"{self.store}{inner}" + (f" {place}" if place else "")

    def missing(self) -> list[str]:
        """The keys waited for that the store did not hold (empty when its keys are unknown;
        under a PrefixStore a key counts as held when one ends with ``/key``)."""
        if self.keys_set is None:
            return []
        held = set(self.keys_set)
        out = []
        for key in self.keys:
            if key in held or (self.prefixed and any(k.endswith("/" + key) for k in held)):
                continue
            out.append(key)
        return out


@dataclass
class FrameArgs:
    """A frame of a thread in a ``torch.distributed`` call, read in the process at the capture:
    the call's own frame (``call``: its arguments) or the user's frame that made it (a few
    locals), each value as bounded text written without running the user's code."""

    thread: str  # ident of the Python thread (as ``ThreadStack.ident``)
    function: str
    file: str
    line: int
    args: dict[str, str] = field(default_factory=dict)  # name -> bounded repr, in frame order
    call: bool = False  # the stuck call's frame (else the user's frame that called it)


@dataclass
class AsyncTask:
    """One pending asyncio task of a running loop: where its coroutines are suspended (each
    frame down its ``cr_await`` chain, most recent call first) and what it awaits."""

    name: str  # the task's name: ``Task-2``, or what ``create_task(name=...)`` gave
    coro: str = ""  # its coroutine's qualified name
    state: str = "pending"  # or "running": the loop was running it
    frames: list[Frame] = field(default_factory=list)
    #: Event, Lock, Queue, Condition, Semaphore, Barrier, sleep (asyncio's await points),
    #: task, gather (other tasks), future, or "" (nothing known)
    awaits: str = ""
    call: str = ""  # ``Event.wait()``, ``PriorityQueue.get()``, ``gather()``, ``task 'Task-3'``
    detail: str = ""  # the awaited primitive's state: ``not set``, ``locked``, ``0 item(s) of 4``
    awaits_tasks: list[str] = field(default_factory=list)  # names, for task and gather
    obj: int = 0  # the awaited primitive's identity within one capture (0: none)
    refs: list[int] = field(default_factory=list)  # awaited primitives its frames' locals hold
    timed: bool = False  # a timer of the loop will wake it (sleep, wait_for, asyncio.timeout)

    def awaited(self) -> str:
        """``Event.wait()``, ``a Future``, ``nothing known``: what it awaits, in words."""
        if not self.call:
            return "nothing known"
        return f"a {self.call}" if self.awaits == "future" else self.call

    def label(self) -> str:
        """``task 'Task-2' (test_event)``."""
        coro = self.coro.rpartition(".")[2]
        return f"task {self.name!r}" + (f" ({coro})" if coro else "")


@dataclass
class EventLoop:
    """A running asyncio event loop of a process and its pending tasks; the counts say what
    could still wake it (-1: unknown, a loop of another kind than asyncio's own)."""

    thread: str  # ident of the thread running it (as ``ThreadStack.ident``)
    thread_name: str = ""
    loop: str = ""  # its class
    ready: int = 0  # callbacks ready to run
    timers: int = 0  # timers not cancelled
    fds: int = 0  # file descriptors it watches, its own self-pipe left out
    #: loop.add_signal_handler's, and the process's own Python handlers (Ctrl-C's aside)
    signal_handlers: int = 0
    tasks: list[AsyncTask] = field(default_factory=list)
    tasks_left_out: int = 0

    def idle(self) -> bool:
        """Nothing of the loop's own can wake it: no ready callback, timer, file, signal."""
        return (self.ready, self.timers, self.fds, self.signal_handlers) == (0, 0, 0, 0)

    def wakers(self) -> str:
        """``2 timer(s), 1 file descriptor(s)``: what could still wake it, or ``nothing``."""
        counts = [
            (self.ready, "ready callback(s)"),
            (self.timers, "timer(s)"),
            (self.fds, "file descriptor(s)"),
            (self.signal_handlers, "signal handler(s)"),
        ]
        said = [f"{n} {what}" if n >= 0 else f"unknown {what}" for n, what in counts if n]
        return ", ".join(said) or "nothing"


#: The parenthesis of a rank started by ``torch.multiprocessing.spawn`` (not a backend).
SPAWNED = "torch.multiprocessing.spawn"
TORCHRUN = "torchrun"
_WORKER, _RANK, _PROCESS = "DataLoader worker", "rank", "multiprocessing.Process"
#: Forms of a role's text, as :meth:`Role.text` writes them (read back by :meth:`Role.parse`).
_WORKER_TEXT = re.compile(
    r"^(?:(rank \d+(?:/\d+)?)'s )?DataLoader worker (\d+)/(\d+)(?: \(dataset (.+)\))?$"
)
_RANK_TEXT = re.compile(r"^rank (\d+)/(\d+|\?)(?: \(([^()]+)\))?(?: \(([^()]+)\))?$")
_PROCESS_TEXT = re.compile(r"^multiprocessing\.Process\(target=(.+)\)$")
_DETAIL_TEXT = re.compile(r"^([^()]+?) \(([^()]+)\)$")


@dataclass(frozen=True)
class Role:
    """What a process is in the test's tree, as data; :meth:`text` renders it, once.

    ``Role("DataLoader worker", index=1, count=4, dataset="Stuck")`` reads
    ``DataLoader worker 1/4 (dataset Stuck)`` (``rank 1's DataLoader worker 1/4`` with its
    ``owner``); ``Role("rank", rank=1, world=2, backend="gloo")`` reads ``rank 1/2 (gloo)``; any
    other kind reads as itself, with its detail in parentheses.
    """

    kind: str
    index: int | None = None  # a DataLoader worker's number among its loader's workers
    count: int | None = None  # how many workers its loader has
    dataset: str | None = None  # the Dataset class a worker is in
    target: str | None = None  # a multiprocessing.Process's target function
    rank: int | None = None
    world: int | None = None  # None: the world size is not known
    backend: str | None = None  # gloo, nccl
    detail: str | None = None  # anything else worth saying: "xdist worker gw3", how ranks started
    owner: str | None = None  # whose a DataLoader worker is, when its parent is a rank: "rank 1"

    def __str__(self) -> str:
        return self.text()

    def text(self) -> str:
        """``DataLoader worker 1/4 (dataset Stuck)``, ``rank 0/2 (gloo)``, ``Pool worker``."""
        return self._render(None)

    def _render(self, number: str | None) -> str:
        """The text, with ``number`` in place of the worker's or rank's number when given."""
        if self.kind == _WORKER:
            head = f"{_WORKER} {_or_unknown(self.index, number)}/{_or_unknown(self.count)}"
            head = f"{self.owner}'s {head}" if self.owner else head
        elif self.kind == _RANK:
            head = f"rank {_or_unknown(self.rank, number)}/{_or_unknown(self.world)}"
        elif self.kind == _PROCESS and self.target:
            head = f"{_PROCESS}(target={self.target})"
        else:
            head = self.kind
        parts = [f"dataset {self.dataset}" if self.dataset else "", self.backend, self.detail]
        return head + "".join(f" ({part})" for part in parts if part)

    def general(self) -> str:
        """The role without its numbers and details (``DataLoader worker``, ``rank``,
        ``pytest``): what a headline counts and a hunt signature names."""
        if self.kind in (_WORKER, _RANK):
            return self.kind
        # A role given as text (a child's stated role, a helper's name) is cut at its first
        # number or parenthesis, as hunt signatures have always cut it.
        words = []
        for word in self.text().split():
            if word.startswith("(") or any(c.isdigit() for c in word):
                break
            words.append(word)
        return " ".join(words) or self.text()

    def numbered(self) -> tuple[str, int | None]:
        """The text with ``{}`` for its number, and the number: (``DataLoader worker {}/8``, 3);
        (the text, None) for a role without one (ranks of an unknown world included)."""
        if self.kind == _WORKER and self.index is not None and self.count is not None:
            return self._render("{}"), self.index
        if self.kind == _RANK and self.rank is not None and self.world is not None:
            return self._render("{}"), self.rank
        return self.text(), None

    @classmethod
    def parse(cls, text: str) -> Role:
        """The role of a text that arrived as text: stated by a child of the runner, a helper's
        name, the root's, or a document written before roles were data. Text this module did
        not write stays whole, as the kind: ``parse(t).text() == t`` always."""
        role = cls._parsed(text)
        return role if role.text() == text else cls(text)

    @classmethod
    def _parsed(cls, text: str) -> Role:
        if match := _WORKER_TEXT.match(text):
            owner, index, count, dataset = match.groups()
            return cls(_WORKER, index=int(index), count=int(count), dataset=dataset, owner=owner)
        if match := _RANK_TEXT.match(text):
            rank, world, said, launcher = match.groups()
            number = None if world == "?" else int(world)
            if said in (SPAWNED, TORCHRUN) and launcher is None:  # a launcher, not a backend
                return cls(_RANK, rank=int(rank), world=number, detail=said)
            return cls(_RANK, rank=int(rank), world=number, backend=said, detail=launcher)
        if match := _PROCESS_TEXT.match(text):
            return cls(_PROCESS, target=match.group(1))
        if match := _DETAIL_TEXT.match(text):
            return cls(match.group(1), detail=match.group(2))
        return cls(text)


def _or_unknown(value: int | None, instead: str | None = None) -> str:
    return instead if instead is not None else ("?" if value is None else str(value))


#: What two looks at a process about half a second apart saw it do (``ProcessReport.motion``).
MOTIONS = ("blocked", "spinning", "polling", "moving", "gone")


@dataclass
class Motion:
    """What moved in a process between two looks (counters and stacks) taken ``interval_s``
    apart, after the first capture's signals were answered and before the kill.

    ``kind``: "blocked" (nothing moved: no CPU, no wake-up, the same frames), "spinning" (CPU
    used without sleeping, in the same frames or a loop of the same few frames), "polling"
    (it slept and woke again and again: a sleep or a wait with a short timeout in a loop, little
    CPU, the same frames), "moving" (its frames changed, or it wrote), "gone" (it exited).
    """

    kind: str
    interval_s: float
    cpu_delta_s: float  # CPU of its own threads between the looks (the plugin's left out)
    voluntary_switches: int  # times its threads went to sleep and woke (the kernel's count)
    involuntary_switches: int  # times they were preempted while running
    frames_moved: bool  # a thread's Python stack changed beyond a loop in the same function
    written_bytes: int  # bytes it wrote between the looks (/proc/PID/io wchar; -1: unread)
    where: str = ""  # what moved, or the thread that spins or polls, in words
    tids: list[int] = field(default_factory=list)  # the threads that spin or poll

    def summary(self) -> str:
        """``polling: woke 48 times in 0.50 s, +0.00s CPU, the same frames``."""
        if self.kind == "gone":
            return f"gone: it exited in the {self.interval_s:.2f} s between two looks"
        moved = "its frames changed" if self.frames_moved else "the same frames"
        wrote = f", wrote {self.written_bytes} bytes" if self.written_bytes > 0 else ""
        where = f" ({self.where})" if self.where else ""
        return (
            f"{self.kind}: woke {self.voluntary_switches} times in {self.interval_s:.2f} s, "
            f"+{self.cpu_delta_s:.2f}s CPU, {moved}{wrote}{where}"
        )


@dataclass
class ProcessReport:
    """One process of the tree as it was at the deadline."""

    pid: int
    ppid: int
    role: str
    cmdline: str
    state: str
    cpu_s: float
    #: CPU time spent during the capture (> 0 means busy, not blocked); for a process asleep at
    #: its end, during a second short look (it may have just reached its wait)
    cpu_delta_s: float
    rss_bytes: int
    num_threads: int
    age_s: float
    dump_status: str
    threads: list[ThreadStack] = field(default_factory=list)
    thread_roles: dict[str, str] = field(default_factory=dict)  # thread ident -> role
    stuck_at: str = ""
    native: str = ""  # native stacks (--torch-hang-native), as the tool printed them
    busy: bool = False  # computing or spinning rather than waiting (set by diagnosis)
    tasks: list[TaskWait] = field(default_factory=list)  # every kernel thread, from /proc
    collectives: list[Collective] = field(default_factory=list)  # ranks: the flight recorder
    exit_status: str = ""  # members already gone (zombies): "exited with code 1", ...
    role_facts: Role | None = None  # the role as data; ``role`` is its text (set by diagnosis)
    libcuda: bool = False  # libcuda is mapped: the process has initialised CUDA
    stderr_tail: list[str] = field(default_factory=list)  # its last lines on sys.stderr, bounded
    event_loops: list[EventLoop] = field(default_factory=list)  # running asyncio loops, tasks
    signals: SignalFacts | None = None  # what a signal would do to it (None: not read)
    #: the role its own default process group states (rank, world size, backend), read in the
    #: process at the capture: a rank whoever started it; None for a process without one
    group_role: Role | None = None
    store_waits: list[StoreWait] = field(default_factory=list)  # its threads in store.get/wait
    #: ranks: the frames of its threads' torch.distributed calls, with their arguments' values
    frame_args: list[FrameArgs] = field(default_factory=list)
    #: what moved between two looks about half a second apart (None: not looked twice)
    motion: Motion | None = None

    def role_data(self) -> Role:
        """The role as data: ``role_facts``, or, in a report built without them, ``role`` read."""
        return self.role_facts if self.role_facts is not None else Role.parse(self.role)


@dataclass
class Hint:
    """A plain-language guess at the cause, with what it is based on."""

    text: str
    based_on: list[str] = field(default_factory=list)
    rule: str = ""  # the rule that found it (the corpus test counts right / wrong per rule)
    pids: list[int] = field(default_factory=list)  # the processes it explains
    waits: list[WaitFacts] = field(default_factory=list)  # the waits it states, as data


@dataclass
class StderrTail:
    """The last lines a process of the tree that is gone by the capture wrote to its stderr."""

    pid: int
    lines: list[str] = field(default_factory=list)


@dataclass
class HangReport:
    """Everything captured about one hang."""

    test_id: str
    timeout_s: float
    elapsed_s: float
    phase: str
    headline: str = ""
    hints: list[Hint] = field(default_factory=list)
    processes: list[ProcessReport] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    spared: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    shm_removed: list[str] = field(default_factory=list)  # /dev/shm names; temp-dir paths
    capture_s: float = 0.0
    kill_s: float = 0.0  # from the start of the kill to a dead, reaped tree
    created: float = field(default_factory=clock.wall)
    notes: list[str] = field(default_factory=list)
    kind: str = "hang"  # "hang": past its deadline; "stall": no progress for the stall time
    progress: dict[str, Any] = field(default_factory=dict)  # a stall's progress, bounded
    #: Processes of the tree gone (and reaped) before the capture that wrote to their stderr.
    gone_stderr: list[StderrTail] = field(default_factory=list)
    #: The headline's hint: the text of the first hint about the process the headline names;
    #: empty when no known pattern matched.
    cause: str = ""
    #: The processes the headline names (the odd one out, else the largest stuck group): their
    #: blocks come first in the text.
    culprits: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The report as the versioned JSON document (see README, "JSON report")."""
        doc = asdict(self)
        # A process's stderr lines are there only for processes that wrote some (and the gone
        # ones' only when there are any): a reader takes a missing key as none, as in a
        # document written before they were kept.
        if not doc["gone_stderr"]:
            del doc["gone_stderr"]
        if not doc["cause"]:  # no hint matched (or written before the cause was kept)
            del doc["cause"]
        if not doc["culprits"]:
            del doc["culprits"]
        for hint in doc["hints"]:
            if not hint["waits"]:  # a hint that states no wait as data (most rules, today)
                del hint["waits"]
        for proc, report in zip(doc["processes"], self.processes, strict=True):
            if not proc["stderr_tail"]:
                del proc["stderr_tail"]
            if not proc["event_loops"]:
                del proc["event_loops"]
            if proc["signals"] is None:
                del proc["signals"]
            if not proc["store_waits"]:
                del proc["store_waits"]
            if not proc["frame_args"]:
                del proc["frame_args"]
            if proc["group_role"] is None:
                del proc["group_role"]
            if proc["motion"] is None:
                del proc["motion"]
            for role in (proc["role_facts"], proc.get("group_role")):
                if role is not None and role["owner"] is None:
                    del role["owner"]  # a worker's only: other roles read as before it was kept
            for task, kept in zip(proc["tasks"], report.tasks, strict=True):
                task["wait"] = waits.to_json(kept.wait)  # with its tag, which asdict drops
        doc["schema"] = "pytest-torchhang/hang-report"
        doc["schema_version"] = SCHEMA_VERSION
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> HangReport:
        """Rebuild a report from the document :meth:`to_json` wrote (a saved ``REPORT.json``).

        Raises ``ValueError`` for a document of another schema or a newer version.
        """
        schema = doc.get("schema")
        if schema != "pytest-torchhang/hang-report":
            raise ValueError(f"not a pytest-torchhang hang report: schema is {schema!r}")
        version = doc.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"hang report schema_version must be a whole number, got {version!r}")
        if version > SCHEMA_VERSION:
            raise ValueError(
                f"hang report schema_version {version!r} is newer than this pytest-torchhang "
                f"reads ({SCHEMA_VERSION}): upgrade pytest-torchhang to read it"
            )
        fields = {k: v for k, v in doc.items() if k not in ("schema", "schema_version")}
        fields["hints"] = [_hint_from_json(h) for h in doc.get("hints", [])]
        fields["processes"] = [_process_from_json(p) for p in doc.get("processes", [])]
        fields["gone_stderr"] = [StderrTail(**t) for t in doc.get("gone_stderr", [])]
        return cls(**fields)


def _hint_from_json(doc: dict[str, Any]) -> Hint:
    return Hint(**{**doc, "waits": [waits.facts_from_json(w) for w in doc.get("waits", [])]})


def _process_from_json(doc: dict[str, Any]) -> ProcessReport:
    fields = dict(doc)
    fields["threads"] = [
        ThreadStack(**{**t, "frames": [Frame(**f) for f in t.get("frames", [])]})
        for t in doc.get("threads", [])
    ]
    fields["tasks"] = [_task_from_json(t) for t in doc.get("tasks", [])]
    fields["collectives"] = [Collective(**c) for c in doc.get("collectives", [])]
    fields["event_loops"] = [_loop_from_json(loop) for loop in doc.get("event_loops", [])]
    fields["signals"] = signals.from_json(doc.get("signals"))
    fields["store_waits"] = [StoreWait(**w) for w in doc.get("store_waits", [])]
    fields["frame_args"] = [FrameArgs(**a) for a in doc.get("frame_args", [])]
    if doc.get("group_role"):
        fields["group_role"] = Role(**doc["group_role"])
    if doc.get("motion"):
        fields["motion"] = Motion(**doc["motion"])
    facts = doc.get("role_facts")
    if facts:
        fields["role_facts"] = Role(**facts)
    elif "role_facts" not in doc:  # written before roles were data: read from its text
        fields["role_facts"] = Role.parse(doc.get("role", ""))
    return ProcessReport(**fields)


def _loop_from_json(doc: dict[str, Any]) -> EventLoop:
    tasks = [
        AsyncTask(**{**t, "frames": [Frame(**f) for f in t.get("frames", [])]})
        for t in doc.get("tasks", [])
    ]
    return EventLoop(**{**doc, "tasks": tasks})


def _task_from_json(doc: dict[str, Any]) -> TaskWait:
    fields = dict(doc)
    fields["waits_for"] = [
        WaitEdge(**e)
        if "kind" in e  # else written before edges had kinds: read from its words
        else WaitEdge(**e, kind=waits.edge_kind_from_text(e.get("pid", 0), e.get("via", "")))
        for e in doc.get("waits_for", [])
    ]
    if "wait" in doc:
        fields["wait"] = waits.from_json(doc["wait"])
    else:  # written before waits were data: read from its text
        vias = tuple(e.via for e in fields["waits_for"])
        fields["wait"] = waits.from_text(doc.get("call", ""), doc.get("obj", ""), vias)
    return TaskWait(**fields)


def same_thread(a: str, b: str) -> bool:
    """Thread idents compare as numbers (faulthandler pads them with zeros)."""
    try:
        return int(a, 16) == int(b, 16)
    except ValueError:
        return a == b
