"""One capture's reads of the world: the tree, facts before any signal, stacks, waits, stated
roles, stderr tails and the plugin's own notes.

It diagnoses nothing and kills nothing: ``hang/path.py`` runs these steps in order, with the
diagnosis between them, and then the kill (``kill.py``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import psutil

from .. import clock
from ..inject.protocol import (
    NOTES_SUFFIX,
    STDERR_SUFFIX,
    THREAD_PREFIX,
    notes_path,
    pid_of,
    read_stderr_copy,
    role_path,
    signals_path,
    stderr_path,
)
from ..report.model import (
    BUSY_CPU_S,
    CONTEXT_ROLE,
    ProcessReport,
    Role,
    StderrTail,
    ThreadStack,
)
from . import aio, attach, collectives, motion, procfs, signals, waitgraph
from .native import native_stacks, tool_available
from .target import CaptureTarget
from .tree import ProcessId, helper_kind, is_zombie, split_descendants

__all__ = ["CaptureTarget", "Gathered", "gather", "tree"]
from .stacks import (
    Dump,
    in_process_threads,
    request_dumps,
    trim_plugin_frames,
    trim_pytest_frames,
)

#: How processes that the hung test did not start are shown: never signalled, never killed.
CONTEXT_STATUS = (
    "context only: it was running before this test began, so it is neither signalled nor killed"
)
#: Environment variables read from each process (roles of ranks).
_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCH_HANG_BACKEND")


#: How long the CPU of every process is sampled, before any signal is sent: answering the dump
#: signal (and the flight recorder's request) costs a process CPU that is not the test's.
CPU_SAMPLE_S = 0.1


def cpu_s(pid: int, skip_tids: set[int] | None = None) -> float | None:
    """CPU seconds of ``pid``'s threads, the plugin's own (kernel name ``torchhang-*``: the
    watchdog, the launcher, the /proc reader, a flight-recorder listener) and ``skip_tids`` (the
    capture's) left out; None when it is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    ticks = 0
    for name in tids:
        tid = int(name)
        if skip_tids and tid in skip_tids:
            continue
        stat = procfs.stat(pid, tid)
        if stat is not None and not stat.comm.startswith(THREAD_PREFIX):
            ticks += stat.cpu_ticks
    return ticks / procfs.TICKS


def _environ(reader: procfs.ProcReader, pid: int) -> dict[str, str]:
    env = reader.environ(pid) or {}
    return {k: env[k] for k in _ENV_KEYS if k in env}


def _helper(reader: procfs.ProcReader, ppid: int, cmdline: list[str], name: str) -> str | None:
    kind = helper_kind(cmdline, name)
    if kind is None:
        return None
    if ppid and reader.cmdline(ppid) == cmdline:
        return None  # forked by the helper (a forkserver's child), not the helper itself
    return kind


def _name(comm: str, cmdline: list[str]) -> str:
    """The process name; the kernel cuts it at 15 characters, the command line does not."""
    if len(comm) >= 15 and cmdline and os.path.basename(cmdline[0]).startswith(comm):
        return os.path.basename(cmdline[0])
    return comm


def _facts(
    proc: psutil.Process,
    now: float,
    dump: Dump,
    cpu: float,
    reader: procfs.ProcReader,
) -> ProcessReport:
    # No psutil call here reads the process's memory (cmdline, environ, name of a long command):
    # those go through the bounded reader.
    unread = len(reader.unread)
    cmdline = reader.cmdline(proc.pid)
    stat = procfs.stat(proc.pid)
    with proc.oneshot():
        try:
            state: str = proc.status()
            rss = proc.memory_info().rss
            threads = proc.num_threads()
            age = now - proc.create_time()
            ppid = proc.ppid()
        except psutil.Error:
            state, rss, threads, age, ppid = "gone", 0, 0, 0.0, 0
    name = _name(stat.comm, cmdline or []) if stat is not None else "?"
    shown = " ".join(cmdline or []) or name
    if cmdline is None and len(reader.unread) > unread:
        shown = f"{name} (command line {reader.unread[-1].reason})"
    if dump.was_stopped:
        state = "stopped (SIGSTOP)"
    return ProcessReport(
        pid=proc.pid,
        ppid=ppid,
        role=_helper(reader, ppid, cmdline or [], name) or "",
        cmdline=shown.replace("\n", "\\n"),
        state=state,
        cpu_s=cpu,
        cpu_delta_s=0.0,  # the CPU sample fills it in
        rss_bytes=rss,
        num_threads=threads,
        age_s=age,
        dump_status=dump.status,
        threads=dump.threads,
        libcuda=b"libcuda.so" in (reader.file(proc.pid, "maps", 16 << 20) or b""),
    )


def _with_dump(report: ProcessReport, dump: Dump) -> ProcessReport:
    """Facts taken before the dump (the CPU sample too), completed with its stacks."""
    report.dump_status = dump.status
    report.threads = dump.threads
    if dump.was_stopped:
        report.state = "stopped (SIGSTOP)"
    return report


def tree(target: CaptureTarget) -> list[psutil.Process]:
    """The processes a target owns, the root (or the roots) first."""
    return _tree(target)[0]


def _tree(target: CaptureTarget) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """(owned, context): the target's processes, and those that were there before it began."""
    procs: list[psutil.Process] = []
    context: list[psutil.Process] = []
    roots = target.roots if target.roots is not None else [target.root_pid]
    for root in [*roots, *target.extra_roots]:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(root))
            owned, older = split_descendants(root, target.exclude, target.before)
            procs.extend(owned)
            context.extend(older)
    seen: set[int] = set()
    unique = [p for p in procs if not (p.pid in seen or seen.add(p.pid))]  # type: ignore[func-returns-value]
    # zombies wait for nothing: they are a parent's unfinished business, not part of a hang
    live = [p for p in unique if p.pid == target.root_pid or not is_zombie(p)]
    return live, [p for p in context if p.pid not in seen and not is_zombie(p)]


def _roles(dump_dir: str | None, pids: list[int]) -> dict[int, str]:
    roles: dict[int, str] = {}
    if dump_dir is None:
        return roles
    for pid in pids:
        with contextlib.suppress(OSError), open(role_path(dump_dir, pid)) as role:
            roles[pid] = role.read().strip()
    return roles


@dataclass
class Gathered:
    """What one capture read of a tree before any diagnosis: the hang's path reads on from here."""

    t0: float  # clock time the capture began
    elapsed: float  # since the target began, when the hang was declared
    reports: list[ProcessReport]  # the tree's processes, roles as they stated them
    context: list[psutil.Process]  # processes that were there before the target began
    env: dict[int, dict[str, str]]  # environment variables that name ranks, by pid
    notes: list[str]
    reader: procfs.ProcReader  # the capture's bounded reader, and its notes
    now: float  # wall time the facts were read


def gather(target: CaptureTarget, skip_threads: set[int] | None = None) -> Gathered:
    """Snapshot the tree and take every process's facts, stacks and waits; kills nothing."""
    t0 = clock.monotonic()
    elapsed = t0 - target.started  # when the hang was declared, whatever the capture costs
    # Every read of /proc that can block (a process in state D) is bounded, and all of them by
    # the capture's budget: what is not read in time becomes a note.
    reader = procfs.ProcReader(deadline=t0 + target.capture_budget_s)
    skip_threads = (skip_threads or set()) | procfs.reader_idents()
    procs, context = _tree(target)
    # The kernel's evidence and every process's facts first: asking for stacks signals and
    # continues stopped processes, which may then move on, or exit.
    seen = _before_signals(target, procs, skip_threads, reader, t0)
    _sample_cpu(seen, t0)
    dumps = _take_stacks(target, procs, seen.own_stacks)
    reports = [
        _with_dump(
            seen.facts[p.pid], dumps.get(p.pid, Dump("gone before its stack could be taken"))
        )
        for p in procs
    ]
    _second_look(reports)
    left = target.capture_budget_s - (clock.monotonic() - t0)
    aio_notes = aio.add_tasks(reports, target.dump_dir, seen.now, min(aio.TASKS_WAIT_S, left))
    signals.add_signals(
        reports, reader, target.dump_dir, seen.now, min(signals.SIGNALS_WAIT_S, left)
    )
    env = {p.pid: _environ(reader, p.pid) for p in procs if p.pid != target.root_pid}
    notes = _add_waits(target, reports, seen.evidence, t0)
    _stated_roles(target, reports)
    notes += _dump_notes(dumps) + aio_notes
    _look_twice(target, procs, reports, skip_threads, t0)
    return Gathered(t0, elapsed, reports, context, env, notes, reader, seen.now)


#: A process that used less CPU than this during the capture, and sleeps at its end, is sampled
#: once more, for this long, before it is called busy.
SECOND_LOOK_BELOW_S = 0.2
SECOND_LOOK_S = 0.1
_ASLEEP = ("S", "D")  # /proc states of a process that waits


def _sample_cpu(seen: _Observed, t0: float) -> None:
    """The CPU each process uses over ``CPU_SAMPLE_S`` from ``t0``, before any signal is sent."""
    clock.sleep(max(0.0, CPU_SAMPLE_S - (clock.monotonic() - t0)))
    for pid, report in seen.facts.items():
        cpu = cpu_s(pid, seen.own if pid == os.getpid() else None)
        if cpu is not None:  # None: gone since the facts were read; keep what was read then
            report.cpu_s = cpu
            report.cpu_delta_s = max(cpu - seen.cpu_before.get(pid, cpu), 0.0)


def _second_look(reports: list[ProcessReport]) -> None:
    """A second, short CPU sample of the processes that used a little CPU and then went to sleep.

    A process that had just reached its wait when the deadline fell (a DataLoader worker still
    starting on a loaded machine) used CPU during the capture, yet waits: it is busy only if it
    still uses CPU. A spinning process, or a retry loop, does; one that blocks for good does not.
    """
    first = {
        r.pid: (stat, cpu)
        for r in reports
        if r.pid != os.getpid()
        and BUSY_CPU_S <= r.cpu_delta_s < SECOND_LOOK_BELOW_S
        and (stat := procfs.stat(r.pid)) is not None
        and stat.state in _ASLEEP
        and (cpu := cpu_s(r.pid)) is not None
    }
    if not first:
        return
    clock.sleep(SECOND_LOOK_S)
    for report in reports:
        if report.pid not in first:
            continue
        before, cpu_before = first[report.pid]
        now, cpu = procfs.stat(report.pid), cpu_s(report.pid)
        if (
            now
            and cpu is not None
            and now.start_ticks == before.start_ticks
            and now.state in _ASLEEP
        ):
            report.cpu_s = cpu
            report.cpu_delta_s = max(cpu - cpu_before, 0.0)


@dataclass
class _Observed:
    """What a capture reads before it signals anything."""

    own: set[int]  # kernel ids of the capture's own threads
    cpu_before: dict[int, float]
    evidence: waitgraph.Evidence
    own_stacks: list[ThreadStack] | None  # this process's, when the root is this process
    now: float  # wall time the facts were read
    facts: dict[int, ProcessReport]


def _reads_itself(target: CaptureTarget) -> bool:
    """Whether the root is this very process, whose stacks are read directly."""
    return target.root_in_process and target.roots is None


def _before_signals(
    target: CaptureTarget,
    procs: list[psutil.Process],
    skip_threads: set[int],
    reader: procfs.ProcReader,
    t0: float,
) -> _Observed:
    """CPU times, the wait-for evidence, this process's stacks and every process's facts."""
    own = _capture_tids(skip_threads)
    cpu_before: dict[int, float] = {}
    for proc in procs:
        cpu = cpu_s(proc.pid, own if proc.pid == os.getpid() else None)
        if cpu is not None:
            cpu_before[proc.pid] = cpu
    evidence = waitgraph.read([p.pid for p in procs], own, began=target.started, proc=reader)
    own_stacks = None
    if _reads_itself(target):
        own_stacks = in_process_threads(skip_threads)  # as the kernel saw them, before any signal
    now = clock.wall()
    facts = {p.pid: _facts(p, now, Dump(""), cpu_before.get(p.pid, 0.0), reader) for p in procs}
    return _Observed(own, cpu_before, evidence, own_stacks, now, facts)


#: What the second look's stack dump may take (a small tree answers in milliseconds).
SECOND_DUMP_S = 0.3


def _look_twice(
    target: CaptureTarget,
    procs: list[psutil.Process],
    reports: list[ProcessReport],
    skip_threads: set[int],
    t0: float,
) -> None:
    """Each process's ``motion``: its counters now and ``motion.INTERVAL_S`` later, then its
    stacks once more. After every other signal of the capture has been answered, so that what
    moved between the looks is the process's own doing; skipped (``motion`` stays None) when
    the capture's budget has no room left for it."""
    left = target.capture_budget_s - (clock.monotonic() - t0)
    if left < motion.INTERVAL_S + SECOND_DUMP_S:
        return
    own = _capture_tids(skip_threads)
    me = os.getpid()
    first = {
        r.pid: motion.look(r.pid, clock.monotonic(), own if r.pid == me else None) for r in reports
    }
    since = clock.wall()
    clock.sleep(motion.INTERVAL_S)
    second = {pid: motion.look(pid, clock.monotonic(), own if pid == me else None) for pid in first}
    # read before the second dump, whose signal makes each process write its answer again
    late = {pid: _late_answer(target.dump_dir, pid, since) for pid in second}
    own_stacks = in_process_threads(skip_threads) if _reads_itself(target) else None
    live = [p for p in procs if second.get(p.pid) is not None]
    dumps = _take_stacks(target, live, own_stacks, SECOND_DUMP_S)
    for report in reports:
        before, after = first.get(report.pid), second.get(report.pid)
        if before is not None and after is not None:
            dump = dumps.get(report.pid)
            after = motion.with_stacks(after, dump.threads if dump is not None else [])
            after = motion.less_written(after, late[report.pid])
        report.motion = motion.classify(
            None if before is None else motion.with_stacks(before, report.threads),
            after,
            {t.tid for t in report.tasks if t.python_thread},
        )


def _late_answer(dump_dir: str | None, pid: int, since: float) -> int:
    """Bytes of the first dump's signal answer that ``pid`` wrote after ``since`` (wall time):
    its main thread writes it when it next runs Python code, which for a busy process may fall
    between the two looks. That write is the plugin's doing, not the process's."""
    if dump_dir is None:
        return 0
    try:
        answer = os.stat(signals_path(dump_dir, pid))
    except OSError:
        return 0
    return answer.st_size if answer.st_mtime >= since - 0.01 else 0


def _take_stacks(
    target: CaptureTarget,
    procs: list[psutil.Process],
    own_stacks: list[ThreadStack] | None,
    budget_s: float | None = None,
) -> dict[int, Dump]:
    """Every process's stacks by its dump handler (this process's as read before), trimmed."""
    idents: list[ProcessId] = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.pid != target.root_pid or not _reads_itself(target):
                idents.append(ProcessId(proc.pid, proc.create_time()))
    dumps = request_dumps(idents, target.dump_dir, budget_s or target.capture_budget_s)
    if own_stacks is not None:
        dumps[target.root_pid] = Dump("ok", own_stacks)
    for dump in dumps.values():
        for thread in dump.threads:
            trim_pytest_frames(thread)
            trim_plugin_frames(thread)
    return dumps


def _add_waits(
    target: CaptureTarget,
    reports: list[ProcessReport],
    evidence: waitgraph.Evidence,
    t0: float,
) -> list[str]:
    """The wait-for evidence, the ranks' collectives, roles and store waits into the reports;
    returns notes."""
    # Ranks' flight recorders after the CPU sample: answering costs them a little CPU.
    asked = collectives.request_collectives([r.pid for r in reports], target.dump_dir)
    fr_wait = max(0.3, target.capture_budget_s - (clock.monotonic() - t0))
    answers = collectives.collect_answers(asked, target.dump_dir, fr_wait)
    notes = attach.attach(reports, evidence, collectives.flight_records(answers))
    return notes + collectives.add_rank_facts(reports, answers)


def _stated_roles(target: CaptureTarget, reports: list[ProcessReport]) -> None:
    """Roles as processes stated them (``PID.role``); the diagnosis labels the rest."""
    stated = _roles(target.dump_dir, [r.pid for r in reports])
    for report in reports:
        report.role = stated.get(report.pid, report.role)


def _dump_notes(dumps: dict[int, Dump]) -> list[str]:
    return [
        f"pid {pid}: its stack dump may be truncated (its text never reached the outermost "
        "frame of its last thread within the capture's budget)"
        for pid, dump in dumps.items()
        if not dump.complete
    ]


def _pids_with(dump_dir: str, suffix: str) -> list[int]:
    """Pids with a ``PID<suffix>`` file in ``dump_dir`` (processes gone since included), sorted."""
    try:
        names = os.listdir(dump_dir)
    except OSError:
        return []
    return sorted(pid for name in names if (pid := pid_of(name, suffix)) is not None)


def child_notes(dump_dir: str | None, processes: list[ProcessReport], since: float) -> list[str]:
    """What the plugin's own code failed to do in any process of the tree (``_hook.child_note``),
    since ``since`` (wall time), each line prefixed with its process; processes already gone
    are found by their files in ``dump_dir``."""
    if dump_dir is None:
        return []
    roles = {p.pid: p.role for p in processes}
    out: list[str] = []
    for pid in _pids_with(dump_dir, NOTES_SUFFIX):
        try:
            with open(notes_path(dump_dir, pid), "rb") as notes:
                raw = notes.read(1 << 16).decode(errors="replace")
        except OSError:
            continue
        who = f"pid {pid} ({roles[pid]})" if roles.get(pid) else f"pid {pid}"
        for line in raw.splitlines():
            stamp, _, text = line.partition(" ")
            try:
                # stamps are rounded to the millisecond: one written as the test began may
                # read a little earlier than ``since``
                if float(stamp) < since - 0.001:
                    continue  # an earlier test's, or an earlier process with this pid
            except ValueError:
                text = line
            if text.strip():
                out.append(f"{who}: {text.strip()}")
    return list(dict.fromkeys(out))


#: What a report shows of one process's stderr: its last lines, within a size (issue 18).
STDERR_TAIL_LINES = 20
STDERR_TAIL_CHARS = 4096
#: Processes gone before the capture whose stderr is shown, the latest writers first.
MAX_GONE_STDERR = 8


def stderr_tail(text: str, partial_first: bool = False) -> list[str]:
    """The last lines of ``text`` (blank lines left out), at most ``STDERR_TAIL_LINES`` of them
    and ``STDERR_TAIL_CHARS`` in all; a longer last line keeps its end. A line rewritten after
    a carriage return (a progress bar) reads as a terminal shows it, its last state; other
    control characters (a colour code) are shown escaped."""
    lines = text.split("\n")
    if partial_first and lines:
        lines = lines[1:]  # read from the middle of the file: its first line is cut
    out: list[str] = []
    left = STDERR_TAIL_CHARS
    for raw in reversed(lines):
        shown = raw.rstrip("\r").rpartition("\r")[2]
        line = "".join(c if c.isprintable() or c == "\t" else repr(c)[1:-1] for c in shown)
        if not line.strip():
            continue
        if len(line) > left:
            if not out:
                out.append("..." + line[len(line) - left + 3 :])
            break
        out.append(line.rstrip())
        left -= len(line)
        if len(out) == STDERR_TAIL_LINES:
            break
    return out[::-1]


def read_stderr_tail(path: str, since: float) -> tuple[list[str], float]:
    """The tail of one process's stderr copy and when it was last written (wall time);
    nothing when it was last written before ``since`` (an earlier process with this pid, or
    an earlier test's lines). Reads at most ``protocol.STDERR_MAP_BYTES``."""
    raw, written, cut = read_stderr_copy(path)
    if written < since - 0.01:  # the stamp and ``since`` come from two clocks' readings
        return [], written
    return stderr_tail(raw.decode("utf-8", "replace"), partial_first=cut), written


def fill_stderr_tails(dump_dir: str | None, processes: list[ProcessReport], since: float) -> None:
    """Each process's last stderr lines (``hook.StderrTail`` keeps them in ``PID.stderr``)."""
    if dump_dir is None:
        return
    for proc in processes:
        proc.stderr_tail = read_stderr_tail(stderr_path(dump_dir, proc.pid), since)[0]


def gone_stderr_tails(dump_dir: str | None, known: set[int], since: float) -> list[StderrTail]:
    """The last stderr lines of processes that wrote some since ``since`` and are gone (not in
    ``known``, no longer in /proc): a child that printed its traceback and exited."""
    if dump_dir is None:
        return []
    found: list[tuple[float, StderrTail]] = []
    for pid in _pids_with(dump_dir, STDERR_SUFFIX):
        if pid in known or pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue  # alive, so not of this tree (a session's helper), or a reused pid
        lines, written = read_stderr_tail(stderr_path(dump_dir, pid), since)
        if lines:
            found.append((written, StderrTail(pid, lines)))
    found.sort(key=lambda item: -item[0])
    return sorted((tail for _, tail in found[:MAX_GONE_STDERR]), key=lambda t: t.pid)


def context_facts(
    context: list[psutil.Process], now: float, reader: procfs.ProcReader
) -> list[ProcessReport]:
    """Facts (never stacks: no signal is sent) of processes that were there before the test."""
    out = []
    for proc in context:
        fact = _facts(proc, now, Dump(CONTEXT_STATUS), cpu_s(proc.pid) or 0.0, reader)
        fact.role = f"{CONTEXT_ROLE}{f' ({fact.role})' if fact.role else ''}"
        fact.role_facts = Role.parse(fact.role)  # data too, like every role
        out.append(fact)
    return out


def _capture_tids(skip_threads: set[int] | None) -> set[int]:
    """Kernel ids of this process's threads that take part in the capture (left out of the graph)."""
    skip = {threading.get_native_id()} | procfs.reader_native_ids()
    for thread in threading.enumerate():
        if skip_threads and thread.ident in skip_threads and thread.native_id:
            skip.add(thread.native_id)
    return skip


def read_from_outside(reports: list[ProcessReport]) -> None:
    """Python processes without the dump handler: read their stacks with pystack or py-spy,
    when one is installed (silently skipped otherwise: nobody asked for it)."""
    silent = [
        r
        for r in reports
        if r.dump_status.startswith("no stack: no dump handler")
        and os.path.basename(r.cmdline.split(" ", 1)[0]).startswith("python")
    ]
    if not silent or not tool_available():
        return
    result = native_stacks([r.pid for r in silent], set(), native=False)
    for report in silent:
        if report.pid in result.stacks:
            report.native = result.stacks[report.pid]
            report.dump_status += "; its Python stack below was read from outside (pystack/py-spy)"
