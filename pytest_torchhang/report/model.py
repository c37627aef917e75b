"""The HangReport model and its renderings: terminal text and a versioned JSON document."""

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
#: Upper bound on the text of one report; the JSON keeps everything that was captured.
MAX_TEXT_CHARS = 200_000
#: Upper bound on one process's block in the text, and on the threads shown per process.
MAX_BLOCK_CHARS = 40_000
MAX_THREADS = 40
#: Lines of the table of process groups at the top of the text.
MAX_GROUP_LINES = 12


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

    def to_text(self) -> str:
        """The report as a user reads it in the terminal, a failure message or a log."""
        out = [self.headline]
        for hint in self.hints:
            out.append(f"hint: {hint.text}")
            out.extend(f"      based on: {b}" for b in hint.based_on)
        for note in self.notes:
            out.append(f"note: {note}")
        out.append("")
        from . import groups  # groups reads this module's types

        found = groups.group_processes(self.processes, self.culprits)
        if len(found) > 1 or any(len(g.processes) > 1 for g in found):
            out.append("processes, the odd one out first:")
            for group in found[:MAX_GROUP_LINES]:
                peers = next((g for g in found if g.crowd and g.role == group.role), None)
                odd = ""
                if group.outlier and peers is not None:
                    odd = f"  <- differs from {len(peers.processes)} identical"
                out.append(f"  {group.line()}{odd}")
            if len(found) > MAX_GROUP_LINES:
                out.append(f"  ... and {len(found) - MAX_GROUP_LINES} more (below)")
            out.append("")
        head = "\n".join(out)
        tail = self._kill_summary()
        # Bounded, but the headline, the hints and the cleanup line always stay: each process
        # block is capped, and blocks that no longer fit are counted instead of shown.
        budget = MAX_TEXT_CHARS - len(head) - len(tail) - 300
        blocks, left_out = [], 0
        roles = {p.pid: p.role for p in self.processes}
        gone = [
            [f"--- process {t.pid}, gone before the capture", *_stderr_lines(t.lines), ""]
            for t in self.gone_stderr
        ]
        shown = [_process_text(g.processes[0], roles, g.processes[1:]) for g in found]
        for lines in [*shown, *gone]:
            block = _cap("\n".join(lines), MAX_BLOCK_CHARS)
            if len(block) + 1 <= budget:
                blocks.append(block)
                budget -= len(block) + 1
            else:
                left_out += 1
        if left_out:
            blocks.append(
                f"... {left_out} process block(s) left out to keep the report under "
                f"{MAX_TEXT_CHARS} characters (the JSON report has every one)\n"
            )
        return "\n".join([head, *blocks, tail])

    def _kill_summary(self) -> str:
        parts = [f"killed {len(self.killed)} process(es)"]
        if self.killed:
            parts[0] += " (" + ", ".join(map(str, self.killed)) + ")"
        if self.spared:
            parts.append(
                f"left helpers {self.spared} running (the session's multiprocessing helpers, or a "
                "torch_shm_manager serving tensors the test still holds; they exit on their own)"
            )
        if self.survivors:
            parts.append(f"COULD NOT KILL {self.survivors}")
        # /dev/shm names are bare; what went from $TMPDIR (a Manager's listener) is a path
        segments = [name for name in self.shm_removed if "/" not in name]
        if segments:
            parts.append(f"removed {len(segments)} /dev/shm segment(s)")
        if len(segments) < len(self.shm_removed):
            parts.append(
                f"removed {len(self.shm_removed) - len(segments)} multiprocessing listener "
                "socket(s) and dir(s) from the temp dir"
            )
        return (
            "cleanup: "
            + "; ".join(parts)
            + f"; capture took {self.capture_s:.2f}s, kill {self.kill_s:.2f}s"
        )

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
            if proc["group_role"] is None:
                del proc["group_role"]
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
    if doc.get("group_role"):
        fields["group_role"] = Role(**doc["group_role"])
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


def _cap(block: str, limit: int) -> str:
    if len(block) <= limit:
        return block
    cut = block.rfind("\n", 0, limit)
    hidden = block.count("\n", cut)
    return block[:cut] + f"\n        ... {hidden} more line(s) of this process left out\n"


def edge_text(edge: WaitEdge, roles: dict[int, str]) -> str:
    """``pid 123 [DataLoader worker 0/2] (pipe:[5]: holds its write end)``."""
    if edge.pid == 0:
        return f"nobody ({edge.via})"
    if edge.pid < 0:
        return f"outside the tree ({edge.via})"
    role = roles.get(edge.pid)
    who = f"pid {edge.pid}" + (f" [{role}]" if role else "")
    if edge.tid and edge.tid != edge.pid:
        who += f" thread {edge.tid}"
    return f"{who} ({edge.via})"


#: Edges shown per thread in the text (the JSON keeps all).
MAX_EDGES = 6


def _task_lines(task: TaskWait, roles: dict[int, str], indent: str, own_pid: int) -> list[str]:
    out = [f"{indent}blocked in {task.summary()}" if task.call != "running" else f"{indent}running"]
    edges = task.waits_for
    for edge in edges[:MAX_EDGES]:
        if edge.pid == own_pid and not edge.tid and not edge.via.startswith(("pipe:", "/")):
            out.append(f"{indent}  waits for {edge.via}")
        else:
            out.append(f"{indent}  waits for {edge_text(edge, roles)}")
    if len(edges) > MAX_EDGES:
        out.append(f"{indent}  ... and {len(edges) - MAX_EDGES} more")
    return out


#: Processes named, with their roles, on the line of a folded group; the rest by pid only.
MAX_NAMED = 8


def _same_as(others: list[ProcessReport]) -> list[str]:
    """The line under a group's one block: which other processes have the same stacks."""
    if not others:
        return []
    named = ", ".join(f"pid {p.pid} [{p.role}]" for p in others[:MAX_NAMED])
    rest = others[MAX_NAMED:]
    if rest:
        from .groups import MAX_BLOCK_PIDS, pid_list

        pids = pid_list([p.pid for p in rest], MAX_BLOCK_PIDS)
        named += f", and {len(rest)} more (pids {pids})"
    return [f"    the same stacks, shown once: {named}"]


def _frame_lines(frames: list[Frame]) -> list[str]:
    from .groups import STARTUP_CUT, cut_startup, cut_stress

    out = []
    for frame in cut_startup(cut_stress(frames)):
        if frame.filename in ("<pytest>", "<pytest-torchhang>", STARTUP_CUT):
            out.append(f"        {frame.name}")
            continue
        out.append(f'        File "{frame.filename}", line {frame.lineno}, in {frame.name}')
        if frame.line:
            out.append(f"            {frame.line}")
    return out


def _process_text(
    proc: ProcessReport,
    roles: dict[int, str] | None = None,
    same: list[ProcessReport] | None = None,
) -> list[str]:
    """One process's block; ``same``: the processes with identical stacks it stands for."""
    from .groups import is_plugin_thread, thread_key

    roles = roles or {}
    if proc.exit_status:
        return [
            f"--- process {proc.pid} [{proc.role}] parent {proc.ppid}, {proc.state}: "
            f"{proc.exit_status}, not reaped yet",
            *_same_as(same or []),
            *_stderr_lines(proc.stderr_tail),
            "",
        ]
    tasks = {t.python_thread: t for t in proc.tasks if t.python_thread}
    mib = proc.rss_bytes / (1 << 20)
    busy = f", +{proc.cpu_delta_s:.2f}s CPU during capture (busy)" if proc.busy else ""
    out = [
        f"--- process {proc.pid} [{proc.role}] parent {proc.ppid}, {proc.state}, "
        f"cpu {proc.cpu_s:.2f}s{busy}, rss {mib:.0f} MiB, {proc.num_threads} threads, "
        f"age {proc.age_s:.1f}s",
        *_same_as(same or []),
        f"    cmdline: {proc.cmdline[:300]}",
    ]
    if proc.dump_status != "ok":
        out.append(f"    ({proc.dump_status})")
    ours = [t for t in proc.threads if is_plugin_thread(t)]
    # Threads with the same stack (a queue feeder per DataLoader worker) are shown once.
    alike: dict[object, list[ThreadStack]] = {}
    for thread in proc.threads:
        if thread not in ours:
            alike.setdefault(thread_key(thread), []).append(thread)
    for twins in list(alike.values())[:MAX_THREADS]:
        thread = twins[0]
        role = proc.thread_roles.get(thread.ident, "")
        words = ["main thread" if thread.current else "thread", thread.ident]
        words += [f'"{thread.name}"'] if thread.name else []
        words += [f"[{role}]"] if role else []
        more = f", and {len(twins) - 1} more with the same stack" if len(twins) > 1 else ""
        out.append(f"    {' '.join(words)} (most recent call first{more}):")
        if thread.ident in tasks:
            out.extend(_task_lines(tasks[thread.ident], roles, "      ", proc.pid))
        if not thread.frames:
            out.append("        <no Python frame>")
        out.extend(_frame_lines(thread.frames))
        if thread.truncated:
            out.append("        ...")
        for loop in proc.event_loops:  # the tasks it runs, below the loop's select
            if same_thread(loop.thread, thread.ident):
                out.extend(_loop_lines(loop, proc))
    if len(alike) > MAX_THREADS:
        out.append(f"    ... {len(alike) - MAX_THREADS} more thread(s) not shown")
    shown = [twins[0] for twins in list(alike.values())[:MAX_THREADS]]
    for loop in proc.event_loops:
        if not any(same_thread(loop.thread, t.ident) for t in shown):
            out.extend(_loop_lines(loop, proc))
    if ours:
        names = ", ".join(proc.thread_roles.get(t.ident) or t.name or t.ident for t in ours)
        out.append(f"    {len(ours)} thread(s) of pytest-torchhang itself, not shown: {names}")
    native = [
        t for t in proc.tasks if not t.python_thread and any(e.pid != proc.pid for e in t.waits_for)
    ]
    if native and proc.threads:
        out.append(
            f"    threads without a Python stack that wait on other processes ({len(native)}):"
        )
        for task in native[:MAX_THREADS]:
            out.append(f'      thread {task.tid} "{task.name}":')
            out.extend(_task_lines(task, roles, "        ", proc.pid))
    elif not proc.threads and proc.tasks:
        for task in proc.tasks[:MAX_THREADS]:
            out.append(f'    thread {task.tid} "{task.name}" ({task.state}):')
            out.extend(_task_lines(task, roles, "      ", proc.pid))
    if proc.collectives:
        out.append("    collectives (flight recorder, oldest first):")
        out.extend(
            f"        {c.label()}"
            + (f" on process group {c.group!r}" if c.group else "")
            + (" completed" if c.completed else " NOT COMPLETED")
            for c in proc.collectives
        )
    if proc.native:
        out.append("    stacks read with pystack/py-spy (most recent call last):")
        out.extend(f"        {line}" for line in proc.native.splitlines())
    out.extend(_stderr_lines(proc.stderr_tail))
    out.append("")
    return out


def same_thread(a: str, b: str) -> bool:
    """Thread idents compare as numbers (faulthandler pads them with zeros)."""
    try:
        return int(a, 16) == int(b, 16)
    except ValueError:
        return a == b


#: Tasks shown per loop in the text (the JSON keeps all that were read).
MAX_TASKS_SHOWN = 20


def _loop_lines(loop: EventLoop, proc: ProcessReport) -> list[str]:
    """A loop's pending tasks, each with its coroutine stack, as ``python -m asyncio pstree``."""
    main = next((t.ident for t in proc.threads if t.current), "")
    in_main = same_thread(loop.thread, main)
    where = "main thread" if in_main else "thread"
    where += f" {loop.thread}" if loop.thread else ""
    where += f' "{loop.thread_name}"' if loop.thread_name and not in_main else ""
    left = max(len(loop.tasks) - MAX_TASKS_SHOWN, 0) + loop.tasks_left_out
    out = [
        f"    asyncio loop in {where} ({loop.loop}), {len(loop.tasks) + loop.tasks_left_out} "
        f"pending task(s); what could still wake it: {loop.wakers()}"
    ]
    for task in loop.tasks[:MAX_TASKS_SHOWN]:
        awaits = f"awaits {task.awaited()}" if task.state != "running" else "is running"
        if task.awaits == "gather" and task.awaits_tasks:
            awaits += " of " + ", ".join(repr(name) for name in task.awaits_tasks)
        awaits += f" [{task.detail}]" if task.detail else ""
        awaits += ", with a timeout" if task.timed else ""
        if task.state == "running":
            awaits += " (the stack of its loop's thread shows where)"
        out.append(f"      {task.label()} {awaits} (most recent call first):")
        for frame in task.frames:
            out.append(f'        File "{frame.filename}", line {frame.lineno}, in {frame.name}')
            if frame.line:
                out.append(f"            {frame.line}")
    if left > 0:
        out.append(f"      ... {left} more task(s) not shown")
    return out


def _stderr_lines(tail: list[str]) -> list[str]:
    if not tail:
        return []
    return ["    last stderr lines:", *(f"        {line}" for line in tail)]
