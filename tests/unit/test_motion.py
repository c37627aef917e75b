"""Two looks at a process, half a second apart: blocked, spinning, polling or moving, as a pure
function of the two snapshots (``capture.motion.classify``), driven by tables."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from pytest_torchhang.capture import motion
from pytest_torchhang.capture.motion import Look, ThreadLook
from pytest_torchhang.capture.procfs import TICKS
from pytest_torchhang.report.model import Frame, HangReport, Motion, ProcessReport, ThreadStack
from pytest_torchhang.report.text import to_text

from .conftest import RECORDED, Replay

USER = "/home/me/project/test_x.py"
LIB = sysconfig.get_path("stdlib") + "/threading.py"


def frames(*spec: tuple[str, str, int]) -> tuple[Frame, ...]:
    """Most recent call first, as a dump lists them: (file, function, line)."""
    return tuple(Frame(f, line, name) for f, name, line in spec)


LOOP = frames((USER, "test_x", 12))  # ``while counter.value < 2: time.sleep(0.01)``
LOOP_BODY = frames((USER, "test_x", 13))
IN_A = frames((USER, "phase_a", 3), (USER, "test_x", 20))
IN_B = frames((USER, "phase_b", 7), (USER, "test_x", 21))
IN_B_SAME_CALLER = frames((USER, "phase_b", 7), (USER, "test_x", 20))
LIB_1 = frames((LIB, "wait", 320), (USER, "test_x", 20))
LIB_2 = frames((LIB, "_acquire", 90), (USER, "test_x", 20))
CALLS_F = frames((USER, "f", 2), (USER, "test_x", 30))  # ``while True: f()``


def one(
    cpu: int = 0, vol: int = 0, invol: int = 0, state: str = "S", tid: int = 10
) -> dict[int, ThreadLook]:
    return {tid: ThreadLook(tid, cpu, vol, invol, state)}


def look(
    at: float,
    threads: dict[int, ThreadLook],
    stack: tuple[Frame, ...] = LOOP,
    written: int = 0,
    start: int = 1,
) -> Look:
    return Look(at, start, threads, written, {"0x1": stack})


T = TICKS  # one second of CPU, in clock ticks

#: (first look, second look, the motion's kind): every row 0.5 s apart
CASES = {
    "nothing moved": (look(0, one()), look(0.5, one()), "blocked"),
    "one stray wake-up is not a loop": (look(0, one(vol=3)), look(0.5, one(vol=4)), "blocked"),
    "a spinner: CPU, no sleep": (
        look(0, one(cpu=0, state="R")),
        look(0.5, one(cpu=T // 4, invol=30, state="R")),
        "spinning",
    ),
    "a spinner starved on a loaded machine: running at both looks": (
        look(0, one(state="R")),
        look(0.5, one(invol=2, state="R")),
        "spinning",
    ),
    "a spinner sharing the GIL sleeps every switch interval, and runs most of the time": (
        look(0, one()),
        look(0.5, one(cpu=T // 2, vol=90, state="R")),
        "spinning",
    ),
    "a poller: sleep(0.01) in a loop": (
        look(0, one(vol=100)),
        look(0.5, one(vol=148)),
        "polling",
    ),
    "a poller with a 0.2 s timeout": (
        look(0, one(vol=5)),
        look(0.5, one(vol=7)),
        "polling",
    ),
    "a poller caught at the sleep, then at the while line": (
        look(0, one(vol=1), LOOP_BODY),
        look(0.5, one(vol=40), LOOP),
        "polling",
    ),
    "a fast poller uses a little CPU": (
        look(0, one()),
        look(0.5, one(cpu=T // 50, vol=450)),
        "polling",
    ),
    "two calls from two lines of one function: read as one loop (two looks cannot tell)": (
        look(0, one(cpu=0), IN_A),
        look(0.5, one(cpu=T // 4), IN_B),
        "spinning",
    ),
    "another function from the same caller's line: moving": (
        look(0, one(vol=5), IN_A),
        look(0.5, one(vol=9), IN_B_SAME_CALLER),
        "moving",
    ),
    "a loop that calls f: in f, then at the loop's line: the same loop": (
        look(0, one(state="R"), CALLS_F),
        look(0.5, one(cpu=T // 4, state="R"), LOOP),
        "spinning",
    ),
    "two places in a library under one line of the user's: the same place": (
        look(0, one(state="R"), LIB_1),
        look(0.5, one(cpu=T // 4, state="R"), LIB_2),
        "spinning",
    ),
    "it wrote: moving, however it slept": (
        look(0, one(vol=0), written=1000),
        look(0.5, one(vol=25), written=1400),
        "moving",
    ),
    "another process with the same pid": (
        look(0, one()),
        look(0.5, one(), start=2),
        "gone",
    ),
}


@pytest.mark.parametrize(("first", "second", "kind"), CASES.values(), ids=list(CASES))
def test_two_looks_tell_what_moved(first: Look, second: Look, kind: str) -> None:
    seen = motion.classify(first, second)
    assert seen is not None
    assert seen.kind == kind, seen


def test_a_process_gone_by_the_second_look_is_gone_and_one_never_seen_is_unknown() -> None:
    gone = motion.classify(look(0, one()), None)
    assert gone is not None and gone.kind == "gone"
    assert motion.classify(None, look(0.5, one())) is None


def test_the_evidence_is_the_deltas_of_the_process_threads() -> None:
    first = look(0, {**one(vol=10, invol=1), **one(cpu=5, vol=3, tid=11)})
    second = look(0.5, {**one(vol=60, invol=2), **one(cpu=5, vol=3, tid=11)})
    seen = motion.classify(first, second)
    assert seen == Motion(
        "polling", 0.5, 0.0, 50, 1, False, 0, "thread 10 slept and woke 50 times", [10]
    )


def test_a_library_timer_thread_does_not_make_a_blocked_main_thread_poll() -> None:
    # thread 11 (a library's timer, no Python frames) wakes; the main thread (10) never does
    first = look(0, {**one(tid=10), **one(vol=0, tid=11)})
    second = look(0.5, {**one(tid=10), **one(vol=30, tid=11)})
    seen = motion.classify(first, second, python_tids={10})
    assert seen is not None and seen.kind == "blocked"
    # without knowing which threads run Python, every thread's wake-ups count
    seen = motion.classify(first, second)
    assert seen is not None and seen.kind == "polling"


def test_a_thread_that_started_between_the_looks_is_not_compared() -> None:
    first = look(0, one(tid=10))
    second = look(0.5, {**one(tid=10), **one(cpu=T, vol=50, tid=12)})
    seen = motion.classify(first, second)
    assert seen is not None and seen.kind == "blocked"


def test_the_plugin_s_own_late_answer_is_not_a_write_of_the_process() -> None:
    first = look(0, one(), written=100)
    second = motion.less_written(look(0.5, one(), written=157), 57)
    seen = motion.classify(first, second)
    assert seen is not None and (seen.kind, seen.written_bytes) == ("blocked", 0)


def test_a_look_at_this_very_process_reads_its_threads() -> None:
    import os

    seen = motion.look(os.getpid(), 0.0)
    assert seen is not None and os.getpid() in seen.threads
    assert motion.look(2**22 + 12345, 0.0) is None  # no such process


def _proc(kind: str) -> ProcessReport:
    return ProcessReport(
        pid=7,
        ppid=1,
        role="Python child",
        cmdline="python x.py",
        state="sleeping",
        cpu_s=0.1,
        cpu_delta_s=0.0,
        rss_bytes=0,
        num_threads=1,
        age_s=3.0,
        dump_status="ok",
        motion=Motion(kind, 0.5, 0.0, 48, 0, False, 0, "thread 7 slept and woke 48 times"),
    )


def test_the_motion_is_in_the_json_report_and_reads_back() -> None:
    report = HangReport("t::x", 1.0, 1.2, "call", processes=[_proc("polling")])
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["processes"][0]["motion"]["kind"] == "polling"
    assert doc["processes"][0]["motion"]["voluntary_switches"] == 48
    assert HangReport.from_json(doc).processes[0].motion == report.processes[0].motion
    report.processes[0].motion = None
    assert "motion" not in report.to_json()["processes"][0]  # not looked twice: no key


def test_the_text_report_has_a_motion_line_per_process() -> None:
    report = HangReport("t::x", 1.0, 1.2, "call", processes=[_proc("polling")])
    text = to_text(report)
    assert (
        "    motion: polling: woke 48 times in 0.50 s, +0.00s CPU, the same frames "
        "(thread 7 slept and woke 48 times)"
    ) in text.splitlines()


def test_a_polling_thread_s_timed_wait_is_a_sleep_not_a_block_in_the_graph() -> None:
    from pytest_torchhang.diagnosis.graph import wait_kind
    from pytest_torchhang.report.model import TaskWait, WaitEdge

    proc = _proc("polling")
    assert proc.motion is not None
    proc.motion.tids = [7]
    # a futex wait with a timeout the rules do not read as the user's, on a lock another
    # process holds: blocked, by the kernel's evidence alone
    task = TaskWait(7, state="S", call="futex", timed=True, waits_for=[WaitEdge(8, via="lock")])
    assert wait_kind(proc, task) == "sleeping"
    proc.motion = None
    assert wait_kind(proc, task) == "blocked"


@pytest.mark.parametrize(
    ("kind", "busy"),
    [("spinning", True), ("polling", False), ("blocked", False), ("moving", True)],
)
def test_two_looks_overrule_the_first_cpu_sample(kind: str, busy: bool) -> None:
    from pytest_torchhang.diagnosis.roles import is_busy

    proc = _proc(kind)
    proc.cpu_delta_s = 0.05  # answering the first capture's signals cost it some CPU
    assert is_busy(proc) is busy  # moving: the CPU sample decides, as before


def _as_polling(report: HangReport, pid: int) -> None:
    """The motion the second look gives a ``while ...: time.sleep(0.05)`` loop (the recordings
    predate it; ``tests/test_motion.py`` shows it on a real loop)."""
    (proc,) = [p for p in report.processes if p.pid == pid]
    proc.motion = Motion("polling", 0.5, 0.0, 10, 0, False, 0, f"thread {pid}", [pid])


def test_a_loop_polling_for_a_failed_producer_s_file_is_told_so_even_caught_running(
    replay: Replay,
) -> None:
    (path,) = [
        p
        for p in RECORDED
        if p.stem == "test_waits_polls_with_a_sleep_for_a_file_a_failed_producer_never_writes"
    ]
    report = replay.load(path)
    (parent,) = [p for p in report.processes if p.role == "pytest"]
    _as_polling(report, parent.pid)
    task = next(t for t in parent.tasks if t.tid == parent.pid)
    task.call, task.state = "running", "R"  # the first read caught it between two sleeps
    hints = replay.hints(report)
    assert [h.rule for h in hints if parent.pid in h.pids] == ["poll_dead"], hints
    (told,) = [h for h in hints if h.rule == "poll_dead"]
    assert "sleeps between looks" in told.text and "spins" not in told.text


def test_the_polling_rule_is_silent_about_a_loop_without_motion(replay: Replay) -> None:
    (path,) = [
        p
        for p in RECORDED
        if p.stem == "test_waits_polls_with_a_sleep_for_a_file_a_failed_producer_never_writes"
    ]
    report = replay.load(path)
    for proc in report.processes:  # a report from a capture without its second look
        proc.motion = None
    assert "polling" not in [h.rule for h in replay.hints(report)]


@pytest.mark.parametrize(
    ("head", "told"),
    [
        ("while not os.path.exists(flag):", True),  # a condition it looks at between sleeps
        ("while True:", False),  # a service's idle loop: no condition to say it polls
        ("while 1:", False),
        ("while (True):", False),
    ],
)
def test_a_loop_with_no_condition_is_not_said_to_poll_for_one(
    head: str, told: bool, tmp_path: Path
) -> None:
    from pytest_torchhang.diagnosis.rules.polling import hint_polling

    source = tmp_path / "test_loop.py"
    source.write_text(f"def serve(flag):\n    {head}\n        time.sleep(1)\n")
    proc = ProcessReport(7, 1, "child process", "python", "S", 0, 0, 0, 1, 0, "ok")
    frame = Frame(str(source), 3, "serve", "time.sleep(1)")
    proc.threads = [ThreadStack("0x1", current=True, frames=[frame])]
    proc.motion = Motion("polling", 0.5, 0.0, 10, 0, False, 0, "thread 7", [7])
    assert bool(hint_polling([proc])) is told
