"""What the monitor can show about a pytest process that did not act on its deadline.

The monitor ends a session only when pytest cannot end the test itself, and it says why; it says
only what it has shown (issue 29: a main thread waiting in C++ *without* the GIL was reported as
holding it, while pytest's watchdog thread ran the whole time). Its evidence, read from outside:

- pytest's state: stopped by job control (``T``: Ctrl-Z, SIGSTOP) or by a tracer for longer
  than an instant (``t`` at two looks in a row: a debugger at a breakpoint) is a pause, not a
  hang: the monitor holds, and the deadlines move on by the stop;
- the watchdog thread's heartbeat on the deadline page: it ran that recently, so the GIL is not
  held for good; after a fire, a test thread that still did not raise is in a call that no signal
  interrupts;
- the watchdog thread's context switches: a thread waiting for the GIL wakes every switch
  interval (5 ms) to ask for it, a thread in a plain timed wait does not. Only that shows the GIL
  held.

Standard library only, and nothing of the cold path: the monitor starts with ``python -S``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from .. import clock

TYPE_CHECKING = False  # typing is not loaded in the monitor's interpreter (-S): 10 ms of CPU

if TYPE_CHECKING:
    from ..report.model import HangReport

#: /proc state of a process stopped by job control (Ctrl-Z, SIGSTOP): paused, not hung ...
JOB_STOPPED = "T"
#: ... and stopped by a tracer: a debugger at a breakpoint, but also strace at every system call
#: for an instant, so it counts only when two looks in a row see it.
TRACE_STOPPED = "t"
#: A thread waiting for the GIL asks for it every switch interval (5 ms): sampled this long,
#: it switches at least this often; a thread in a timed wait of its own switches at most once.
GIL_SAMPLE_S = 0.3
GIL_WAIT_SWITCHES = 10
#: ... and hardly runs meanwhile (each wake costs microseconds), where a thread at work on the
#: GIL's other side (importing the cold path beside a busy test) switches as often but runs.
GIL_WAIT_CPU_S = 0.015
#: While it interrupts a fired test, the watchdog runs every second: a heartbeat this recent
#: says it runs (the GIL is free).
BEAT_FRESH_S = 3.0


def state_of(pid: int, tid: int | None = None) -> str:
    """The /proc state letter of ``pid`` (or of its thread ``tid``); '' when gone."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except OSError:
        return ""
    fields = raw.rpartition(b")")[2].split()
    return fields[0].decode() if fields else ""


def is_stopped(state: str, before: str) -> bool:
    """Whether a process whose state is ``state`` (and was ``before``, a look earlier) is
    stopped: by job control, or by a tracer for longer than an instant."""
    return state == JOB_STOPPED or state == before == TRACE_STOPPED


def cpu_of(pid: int, tid: int) -> float | None:
    """Seconds thread ``tid`` ran on a CPU so far (``schedstat``, in ns); None when unknown."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            return int(f.read(256).split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def sample_gil(pid: int, tid: int) -> tuple[int | None, float | None]:
    """(context switches, seconds on a CPU) of thread ``tid`` over ``GIL_SAMPLE_S``."""
    first, first_cpu = switches_of(pid, tid), cpu_of(pid, tid)
    clock.sleep(GIL_SAMPLE_S)
    last, last_cpu = switches_of(pid, tid), cpu_of(pid, tid)
    switches = last - first if first is not None and last is not None else None
    cpu = last_cpu - first_cpu if first_cpu is not None and last_cpu is not None else None
    return switches, cpu


def waits_for_gil(switches: int | None, cpu_s: float | None) -> bool:
    """Whether a sample shows a thread asking for the GIL and never getting it."""
    asks = switches is not None and switches >= GIL_WAIT_SWITCHES
    return asks and (cpu_s is None or cpu_s < GIL_WAIT_CPU_S)


def switches_of(pid: int, tid: int) -> int | None:
    """The context switches (voluntary and not) of thread ``tid`` so far; None when gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/status", "rb") as f:
            lines = f.read(8192).splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        if line.startswith((b"voluntary_ctxt_switches:", b"nonvoluntary_ctxt_switches:")):
            total += int(line.split()[1])
    return total


class Why(enum.Enum):
    """Why pytest did not end the test itself, as far as it was shown."""

    UNINTERRUPTIBLE = "a call no signal interrupts"  # the watchdog runs; the test never raised
    GIL_HELD = "the GIL is held"  # the watchdog thread waits for the GIL
    WATCHDOG_RUNS = "the watchdog runs but did not act"
    WATCHDOG_BUSY = "the watchdog began to act and did not finish"
    UNKNOWN = "not shown"


@dataclass(frozen=True)
class Evidence:
    """What the monitor read of the pytest process when it took over."""

    fired: bool  # the watchdog said FIRED for this deadline
    beat_age_s: float | None  # since the watchdog thread last ran (None: it never said)
    ran_since_deadline: bool = False  # it ran after the deadline came
    watchdog_tid: int = 0
    watchdog_state: str = ""  # its /proc state letter ('' gone or unknown)
    watchdog_switches: int | None = None  # in GIL_SAMPLE_S (None: not read)
    watchdog_cpu_s: float | None = None  # its time on a CPU in GIL_SAMPLE_S (None: not read)
    main_state: str = ""
    busy_s: float = 0.0  # how long the watchdog has been acting without beating (0: it is not)

    @property
    def why(self) -> Why:
        if self.fired and self.beat_age_s is not None and self.beat_age_s <= BEAT_FRESH_S:
            return Why.UNINTERRUPTIBLE
        if waits_for_gil(self.watchdog_switches, self.watchdog_cpu_s):
            return Why.GIL_HELD  # sampled only where the other evidence left it open
        if not self.fired and self.busy_s > 0:
            return Why.WATCHDOG_BUSY
        if not self.fired and self.ran_since_deadline:
            return Why.WATCHDOG_RUNS
        return Why.UNKNOWN


def gather(
    pytest_pid: int,
    fired: bool,
    deadline: float,
    beat: tuple[int, float] | None,
    busy_since: float = 0.0,
) -> Evidence:
    """Read the evidence (bounded: ``GIL_SAMPLE_S`` and a few /proc reads); ``deadline``: when
    the watchdog was due to act, ``beat``: the watchdog's last heartbeat (tid, when),
    ``busy_since``: since when it has been acting on it (0: it is not)."""
    now = clock.monotonic()
    main_state = state_of(pytest_pid)
    if beat is None:
        return Evidence(fired, None, main_state=main_state)
    tid, at = beat
    busy = max(now - busy_since, 0.0) if busy_since and not fired else 0.0
    seen = Evidence(
        fired, max(0.0, now - at), at >= deadline, tid, main_state=main_state, busy_s=busy
    )
    if seen.why in (Why.UNKNOWN, Why.WATCHDOG_BUSY):  # is the GIL in question: sample switches
        switches, cpu = sample_gil(pytest_pid, tid)
        seen = replace(seen, watchdog_switches=switches, watchdog_cpu_s=cpu)
    return replace(seen, watchdog_state=state_of(pytest_pid, tid))


def the_call(report: HangReport, pid: int, tid: int) -> str:
    """Where thread ``tid`` of ``pid`` is, from the capture: its innermost Python frame and its
    system call (``test_x.py:12 in test_x, in futex [futex_wait_queue]``), or ''."""
    parts = []
    for proc in report.processes:
        if proc.pid != pid:
            continue
        for thread in proc.threads:
            is_it = thread.tid == tid if thread.tid else thread.name == "MainThread"
            if is_it and thread.frames:
                frame = thread.frames[0]
                name = frame.filename.rsplit("/", 1)[-1]
                parts.append(f"{name}:{frame.lineno} in {frame.name}")
                break
        for task in proc.tasks:
            if task.tid == tid and task.call:
                parts.append(f"in the system call {task.summary()}")
    return ", ".join(parts)


def own_thread_note(report: HangReport, pid: int, tid: int) -> str | None:
    """The stack of pytest-torchhang's own watchdog thread (``tid`` of ``pid``), which reports
    leave out, as a note: when the watchdog did not act, where it is is the evidence."""
    for proc in report.processes:
        if proc.pid != pid:
            continue
        for thread in proc.threads:
            named = "watchdog" in (proc.thread_roles.get(thread.ident) or thread.name)
            if (thread.tid == tid) if (thread.tid and tid) else named:
                lines = [
                    f"  {f.name}"
                    if f.filename.startswith("<") and f.lineno == 0  # a cut's marker
                    else f'  File "{f.filename}", line {f.lineno}, in {f.name}'
                    for f in thread.frames
                ]
                where = "\n".join(lines) or "  <no Python frame>"
                return f"pytest-torchhang's watchdog thread (most recent call first):\n{where}"
    return None


def sentence(evidence: Evidence, thread: str, call: str, ending: str) -> str:
    """The monitor's first hint: why the session ends, saying only what ``evidence`` shows."""
    where = f" ({call})" if call else ""
    why = evidence.why
    if why is Why.UNINTERRUPTIBLE:
        return (
            f"the test did not finish after the watchdog had fired and killed its children: its "
            f"{thread} is blocked in a call that no signal interrupts{where}. The GIL is free "
            f"(pytest's watchdog thread ran {evidence.beat_age_s:.1f}s ago and interrupted the "
            "test every second), but the call never returned to Python, where the interrupt "
            f"would raise its HangError. {ending}. What you can do: give that call a timeout of "
            "its own (a process group's timeout=, a socket's, a queue's), or mark the test "
            "@pytest.mark.torch_hang(isolate=True) to run it in a subprocess that "
            "pytest-torchhang can kill; the stack of the pytest process below shows the call."
        )
    opening = (
        "the test did not finish after the watchdog had fired and killed its children"
        if evidence.fired
        else "the pytest process's own watchdog did not act on the deadline"
    )
    if why is Why.GIL_HELD:
        return (
            f"{opening}: a thread of pytest holds the GIL in C code, so nothing inside pytest "
            f"can move: its watchdog thread, which last ran {evidence.beat_age_s:.1f}s ago, waits "
            f"for the GIL (it woke {evidence.watchdog_switches} times in {GIL_SAMPLE_S:g}s to ask "
            f"for it, and never ran). {ending}; the stack of the pytest process below shows "
            f"where its {thread} is{where}."
        )
    if why is Why.WATCHDOG_BUSY:
        return (
            f"{opening}: pytest's watchdog thread began to act on it {evidence.busy_s:.1f}s ago "
            "(it loads its capture, checks for a debugger, then fires) and did not finish (its "
            "stack is in the notes below); the GIL is not known to be held. "
            f"{ending}; the stack of the pytest process below shows where its {thread} is{where}."
        )
    if why is Why.WATCHDOG_RUNS:
        seen = f"{evidence.beat_age_s:.1f}s ago"
    elif evidence.beat_age_s is None:
        seen = "never"
    else:
        seen = f"{evidence.beat_age_s:.1f}s ago, not since"
    states = f"its {thread}: state {evidence.main_state or '?'}"
    if evidence.watchdog_tid:
        states += f"; its watchdog thread: state {evidence.watchdog_state or 'gone'}"
    return (
        f"{opening}: pytest's watchdog thread last ran {seen}, and why it did not end the test "
        f"could not be shown ({states}); the GIL is not known to be held. {ending}; the stack "
        f"of the pytest process below shows where its {thread} is{where}."
    )
