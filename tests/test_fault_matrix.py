"""The fault matrix: children that crash, hide, multiply, stop or lose their dump file; pid reuse."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from conftest import GuardedRunner, Session, assert_hang
from outcomes import assert_outcomes
from pytest_torchhang.capture import kill, stacks, tree
from pytest_torchhang.capture.tree import ProcessId
from pytest_torchhang.inject import hook
from pytest_torchhang.report import text as report_module
from pytest_torchhang.report.text import MAX_TEXT_CHARS

# Records how long each test's call took, so the outer test can tell a crash that ended at once
# from one that sat until its deadline.
DURATIONS_CONFTEST = """
import json


def pytest_runtest_logreport(report):
    if report.when == "call":
        with open("durations.jsonl", "a") as out:
            out.write(json.dumps([report.nodeid.split("::")[-1], report.duration]) + "\\n")
"""


def _durations(pytester: pytest.Pytester) -> dict[str, float]:
    lines = (pytester.path / "durations.jsonl").read_text().splitlines()
    return dict(json.loads(line) for line in lines)


def _assert_not_a_hang(session: Session, test_name: str, *expected: str) -> str:
    """``test_name`` failed as an ordinary failure, never as a hang, and says ``expected``."""
    report = session.report_of(test_name)
    assert "HANG after" not in report, report[:3000]
    summary = session.result.stdout.str()
    assert re.search(rf"^FAILED \S+::{re.escape(test_name)}( |$)", summary, re.M), summary[-3000:]
    missing = [text for text in expected if text not in report]
    assert not missing, f"missing {missing} in:\n{report[:6000]}"
    return report


CRASHES = """
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch  # imported at collection, so no test pays for it
from torch.utils.data import DataLoader, Dataset

PYTHON = sys.executable


def add(a, b=0):
    return a + b


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def segfault():
    ctypes.string_at(0)


class DyingDataset(Dataset):
    def __init__(self, signum):
        self.signum = signum

    def __len__(self):
        return 4

    def __getitem__(self, index):
        if self.signum == signal.SIGSEGV:
            ctypes.string_at(0)
        os.kill(os.getpid(), self.signum)
        time.sleep(1000)


SETSID_DAEMON = "import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(1000)\\n"
ORPHAN = "import os, time\\nif os.fork() == 0:\\n    time.sleep(1000)\\n"
IGNORES_TERM = "import signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\ntime.sleep(1000)\\n"
STOPS_ITSELF = "import os, signal, time\\nos.kill(os.getpid(), signal.SIGSTOP)\\ntime.sleep(1000)\\n"


def start_every_kind_of_child_then_wait():
    subprocess.run([PYTHON, "-c", SETSID_DAEMON], check=True)
    subprocess.run([PYTHON, "-c", ORPHAN], check=True)
    subprocess.Popen([PYTHON, "-c", IGNORES_TERM])
    subprocess.Popen([PYTHON, "-c", STOPS_ITSELF])
    subprocess.Popen([PYTHON, "-I", "-c", "import time; time.sleep(1000)"])
    subprocess.Popen(["sleep", "1000"])
    threading.Event().wait()


# The zygote imports torch on first use: that start-up is not what the tests below measure.
@pytest.mark.torch_hang(timeout=120)
def test_warm_up(torch_hang):
    assert torch_hang.run(add, 1, b=2) == 3


@pytest.mark.torch_hang(timeout=60)
def test_run_child_killed_by_sigkill(torch_hang):
    torch_hang.run(kill_self)


@pytest.mark.torch_hang(timeout=60)
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV], ids=["sigkill", "sigsegv"])
def test_loader_worker_dies(signum):
    for _ in DataLoader(DyingDataset(signum), num_workers=1, multiprocessing_context="fork"):
        pass


@pytest.mark.torch_hang(timeout=60)
def test_run_child_segfaults(torch_hang):
    torch_hang.run(segfault)


@pytest.mark.torch_hang(timeout=60)
def test_fixture_loader_worker_segfaults(torch_hang):
    torch_hang.dataloader(
        DyingDataset(signal.SIGSEGV), batches=1, num_workers=1, multiprocessing_context="fork"
    )


@pytest.mark.torch_hang(timeout=60)
def test_run_child_with_every_kind_of_grandchild(torch_hang):
    torch_hang.run(start_every_kind_of_child_then_wait, timeout=5)  # all six started by then


def test_next_test_runs(torch_hang):
    assert torch_hang.run(add, 2) == 2
"""


def test_crashes_are_reported_as_crashes_at_once_and_a_runner_tree_dies_whole(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makeconftest(DURATIONS_CONFTEST)
    guarded.pytester.makepyfile(test_crashes=CRASHES)
    session = guarded.run(timeout=2, wait_s=300)
    assert_outcomes(session.result, passed=2, failed=5, hang=1)
    durations = _durations(guarded.pytester)

    # A child killed by SIGKILL is a crash that names the signal, and it is told at once.
    _assert_not_a_hang(
        session,
        "test_run_child_killed_by_sigkill",
        "ChildCrashed",
        "was killed by SIGKILL (possibly the OOM killer)",
    )
    # torch's own DataLoader notices a dead worker and raises in the test: not a hang either.
    _assert_not_a_hang(
        session, "test_loader_worker_dies[sigkill]", "RuntimeError: DataLoader worker (pid"
    )
    sigsegv = _assert_not_a_hang(
        session, "test_loader_worker_dies[sigsegv]", "RuntimeError: DataLoader worker (pid"
    )
    assert "Segmentation fault" in sigsegv
    # A segfaulting runner child: a crash with its faulthandler trace, down to the function.
    segfault = _assert_not_a_hang(
        session,
        "test_run_child_segfaults",
        "was killed by SIGSEGV",
        "the child's crash trace (faulthandler):",
        "Segmentation fault",
    )
    assert re.search(r'File ".*test_crashes\.py", line \d+ in segfault', segfault), segfault
    # A DataLoader worker segfaulting inside torch_hang.dataloader: the child's RuntimeError.
    _assert_not_a_hang(
        session,
        "test_fixture_loader_worker_segfaults",
        "killed by signal: Segmentation fault",
        "raised in torch_hang.dataloader(DyingDataset) child (pid",
    )
    for name in (
        "test_run_child_killed_by_sigkill",
        "test_loader_worker_dies[sigkill]",
        "test_loader_worker_dies[sigsegv]",
        "test_run_child_segfaults",
        "test_fixture_loader_worker_segfaults",
    ):
        # told at once, not at the deadline (60s); torch's DataLoader looks at its workers every
        # 5s, and a busy machine slows everything down: the bound is wide
        assert durations[name] < 30, (name, durations[name])

    # Everything a runner child can leave behind is listed, then killed: a setsid() daemon, a
    # double-forked orphan (both adopted by the child as subreaper), a SIGTERM-ignoring child,
    # a stopped child, an isolated interpreter and a non-Python child.
    report = assert_hang(
        session,
        "test_run_child_with_every_kind_of_grandchild",
        "HANG after *s in torch_hang.run(start_every_kind_of_child_then_wait) in *: 7 processes*",
        "*[[]torch_hang.run(start_every_kind_of_child_then_wait) child[]]*",
        "*threading.Event().wait()",
        "*cmdline: *os.setsid()*",
        "*cmdline: *signal.SIG_IGN*",
        "*[[]Python child[]] parent *, stopped (SIGSTOP)*",
        "*cmdline: *python* -I -c import time; time.sleep(1000)",
        "*cmdline: sleep 1000",
        "*(no stack: no dump handler (not a Python process, or started with python -I*",
        "cleanup: killed 7 process(es)*",
    )
    child_pid = re.search(r"--- process (\d+) \[torch_hang\.run", report)
    assert child_pid is not None
    # the daemon and the orphan were re-parented to the runner child, not to init
    assert len(re.findall(rf"\[Python child\] parent {child_pid.group(1)},", report)) == 4
    assert "COULD NOT KILL" not in report
    assert durations["test_run_child_with_every_kind_of_grandchild"] < 40  # the deadline is 60s
    session.assert_clean()


TREE = """
import os
import subprocess
import sys
import time

PYTHON = sys.executable

DOUBLE_FORK = "import os, time\\nif os.fork() == 0:\\n    time.sleep(1000)\\n"

# Every process of this tree keeps forking, rate-limited so that it still forks when the deadline
# comes, and capped at CAP processes in all (a counter in shared memory, under a lock). Each
# process leaves a file named after its pid in BIRTHS.
FORK_STORM = '''
import fcntl, mmap, os, random, struct, sys, time
CAP, RATE, BIRTHS = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
counter = mmap.mmap(-1, 8)
counter[:8] = struct.pack("d", 1.0)
lock = open(BIRTHS + ".lock", "w")
start = time.monotonic()
def born():
    with open(os.path.join(BIRTHS, str(os.getpid())), "w"):
        pass
born()
while True:
    time.sleep(0.02 + random.random() * 0.03)
    fcntl.lockf(lock, fcntl.LOCK_EX)
    count = struct.unpack("d", counter[:8])[0]
    fork = count < min(CAP, 1 + RATE * (time.monotonic() - start))
    if fork:
        counter[:8] = struct.pack("d", count + 1)
    fcntl.lockf(lock, fcntl.LOCK_UN)
    if fork and os.fork() == 0:
        random.seed()
        born()
'''

# Closes every inherited descriptor (the dump file's too), then opens a file of its own that
# gets the very number the dump file had: a dump signal now would write into the user's file.
REPLACES_DUMP_FD = '''
import os, sys, time
dump_fds = []
for fd in os.listdir("/proc/self/fd"):
    try:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".stack"):
            dump_fds.append(int(fd))
    except OSError:
        pass
assert len(dump_fds) == 1, dump_fds
os.closerange(3, 1024)
user = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT)
if user != dump_fds[0]:
    os.dup2(user, dump_fds[0])
print("REPLACED", dump_fds[0], flush=True)
time.sleep(1000)
'''


def test_double_forked_orphan():
    subprocess.run([PYTHON, "-c", DOUBLE_FORK], check=True)
    time.sleep(1000)


def test_tree_keeps_forking_during_the_kill():
    os.mkdir("births")
    # about 65 new processes a second: some 130 at the 2s deadline, still forking, 200 at most
    subprocess.Popen([PYTHON, "-c", FORK_STORM, "200", "65", os.path.abspath("births")]).wait()


def test_child_replaces_its_dump_descriptor():
    child = subprocess.Popen(
        [PYTHON, "-c", REPLACES_DUMP_FD, os.path.abspath("user.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().startswith("REPLACED")
    child.wait()


def test_next_test_runs():
    pass
"""


def test_orphans_a_forking_tree_and_a_replaced_dump_file_are_reported_and_killed(
    guarded: GuardedRunner,
) -> None:
    guarded.pytester.makepyfile(test_tree=TREE)
    session = guarded.run(timeout=2)
    assert_outcomes(session.result, passed=1, hang=3)

    # a double-forked orphan (no setsid) is adopted by pytest as child subreaper, and killed
    assert_hang(
        session,
        "test_double_forked_orphan",
        "HANG after *s in *: 2 processes*",
        "*[[]Python child[]] parent *",
        "cleanup: killed 1 process(es)*",
    )

    # A tree that forks during the kill: frozen and listed again until it stops growing, so
    # every process born (each left a file) is killed, those born after the snapshot included.
    storm = assert_hang(session, "test_tree_keeps_forking_during_the_kill", "cleanup: killed *")
    births = len(os.listdir(guarded.pytester.path / "births"))
    killed = re.search(r"^cleanup: killed (\d+) process", storm, re.M)
    assert killed is not None
    assert 20 <= births <= 200, births
    assert int(killed.group(1)) >= births, (killed.group(1), births)
    assert "COULD NOT KILL" not in storm

    # The child that closed its dump file and reused the descriptor is listed, never signalled
    # (nothing was written into the user's file), and killed.
    replaced = assert_hang(
        session,
        "test_child_replaces_its_dump_descriptor",
        "*cmdline: *-c *import os, sys, time*dump_fds*",
        "*(no stack: the process closed or replaced its dump file)",
        "cleanup: killed 1 process(es)*",
    )
    assert "COULD NOT KILL" not in replaced
    assert (guarded.pytester.path / "user.log").read_text() == ""
    session.assert_clean()


CROWD = """
import subprocess
import sys
import threading

PYTHON = sys.executable

# A child with 100 threads 300 calls deep and a main thread 5,000 calls deep, all waiting.
CROWD = '''
import sys, threading
sys.setrecursionlimit(10_000)
def innermost_wait(event):
    event.wait()
def dive(depth, event):
    if depth == 0:
        innermost_wait(event)
    else:
        dive(depth - 1, event)
event = threading.Event()
for n in range(100):
    threading.Thread(target=dive, args=(300, event), name=f"diver-{n}").start()
dive(5000, event)
'''


def _deep(depth, lock):
    if depth == 0:
        lock.acquire()  # the innermost frame of the test
    else:
        _deep(depth - 1, lock)


def test_huge_stacks_and_a_hundred_threads():
    subprocess.Popen([PYTHON, "-c", CROWD])
    subprocess.Popen(["sleep", "1000"])  # listed after the crowd
    lock = threading.Lock()
    lock.acquire()
    _deep(500, lock)


def test_next_test_runs():
    pass
"""


def _huge_report(guarded: GuardedRunner) -> tuple[Session, str]:
    guarded.pytester.makepyfile(test_crowd=CROWD)
    session = guarded.run(timeout=4)  # all 100 threads have started, on a busy machine too
    assert_outcomes(session.result, passed=1, hang=1)
    report = assert_hang(session, "test_huge_stacks_and_a_hundred_threads", "HANG after *")
    return session, report


def test_a_report_of_huge_stacks_and_a_hundred_threads_is_bounded_and_keeps_every_process(
    guarded: GuardedRunner,
) -> None:
    session, report = _huge_report(guarded)
    # the report is cut (it is the failure text, plus pytest's section header)
    assert len(report) < MAX_TEXT_CHARS + 2_000, len(report)
    # the innermost frames are kept, the outer ones cut (at most 60 frames a thread)
    assert "            lock.acquire()  # the innermost frame of the test" in report
    assert re.search(r'File "<string>", line \d+, in innermost_wait', report)
    # the pytest process (the odd one out comes first, so find it): its main thread is 500 deep
    blocks = report.split("--- process")[1:]
    deep = next(b for b in blocks if "[pytest]" in b.split("\n", 1)[0])
    assert 55 <= deep.count(", in _deep") <= 60, deep.count(", in _deep")
    assert "\n        ...\n" in deep
    assert re.search(r"\[Python child\] parent \d+, \w+, .*, 101 threads", report)
    # a hundred threads do not push the other processes and the cleanup line out of the report
    crowd = report.split("[Python child]", 1)[1].split("\n--- process", 1)[0]
    assert crowd.count(" (most recent call first):") <= report_module.MAX_THREADS + 1
    assert "cmdline: sleep 1000" in report
    assert re.search(r"^cleanup: killed 2 process\(es\)", report, re.M)
    session.assert_clean()


ZOMBIE = """
import subprocess
import threading
import time

KEEP = []


def test_leaves_a_zombie():
    KEEP.append(subprocess.Popen(["true"]))  # exits at once, never waited for
    time.sleep(0.5)


def test_hangs_later():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()
"""


def test_a_zombie_child_is_left_out_of_the_report(guarded: GuardedRunner) -> None:
    # a zombie waits for nothing: it is its parent's unfinished business, not part of the hang
    guarded.pytester.makepyfile(test_zombie=ZOMBIE)
    session = guarded.run(timeout=1.5)
    assert_outcomes(session.result, passed=1, hang=1)
    report = assert_hang(
        session, "test_hangs_later", "HANG after * 1 process, stuck in test_hangs_later"
    )
    assert len(re.findall(r"^--- process .*$", report, re.M)) == 1
    assert "gone" not in report and "parent 0," not in report


FIRST_FIXTURE_USE = """
def add(a):
    return a


def test_first_use_of_the_fixture(torch_hang):
    assert torch_hang.run(add, 1) == 1


def test_second_use_of_the_fixture(torch_hang):
    assert torch_hang.run(add, 2) == 2
"""

# A slow machine, or a torch with CUDA and torchvision (6s here): the zygote takes 3s more.
SLOW_ZYGOTE = """
import time

with open("/proc/self/cmdline", "rb") as cmdline:
    if b"pytest_torchhang.runner.zygote" in cmdline.read():
        time.sleep(3)
"""


def test_the_zygote_start_up_neither_fails_the_first_fixture_test_nor_dies_with_it(
    guarded: GuardedRunner,
) -> None:
    slow = guarded.pytester.mkdir("slow_start")
    (slow / "sitecustomize.py").write_text(SLOW_ZYGOTE)
    guarded.monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(slow), os.environ.get("PYTHONPATH")]))
    )
    guarded.pytester.makepyfile(test_first_use=FIRST_FIXTURE_USE)
    session = guarded.run(timeout=2)
    out = session.result.stdout.str()
    assert not re.search(r"cmdline: \S+ -m pytest_torchhang\.zygote", out), out[-3000:]
    assert_outcomes(session.result, passed=2)
    session.assert_clean()


# --- identity safety: a pid that was recycled between the snapshot and the signal -----------


#: The highest signal number. A process runs the handlers of the signals pending together in
#: ascending order (the kernel delivers every pending signal before the process resumes, and
#: Python calls its handlers by number), so once the marker's handler has run, any signal sent
#: before the marker has been acted on: a handled one printed first, SIGSTOP or SIGKILL stopped
#: the process before it could answer.
MARKER = signal.SIGRTMAX

#: Prints the number of every signal it handles (argv), after "ready".
WITNESS = (
    "import signal, sys\n"
    "def note(signum, frame):\n"
    "    print(signum, flush=True)\n"
    "for number in sys.argv[1:]:\n"
    "    signal.signal(int(number), note)\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    signal.pause()\n"
)


@pytest.fixture
def witness() -> Iterator[subprocess.Popen[bytes]]:
    """A process that must survive and notes the dump signal and the marker it receives."""
    args = [str(int(hook.DUMP_SIGNAL)), str(int(MARKER))]
    proc = subprocess.Popen(
        [sys.executable, "-c", WITNESS, *args], stdout=subprocess.PIPE, bufsize=0
    )
    try:
        assert _read_line(proc) == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _read_line(proc: subprocess.Popen[bytes], bound_s: float = 60.0) -> str:
    """The next line ``proc`` prints; fails when none comes within ``bound_s`` (or at its end)."""
    assert proc.stdout is not None
    line = b""
    deadline = time.monotonic() + bound_s
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
        state = _state(proc.pid) if psutil.pid_exists(proc.pid) else "gone"
        assert ready, f"no line from pid {proc.pid} ({state}) within {bound_s}s, got {line!r}"
        byte = os.read(proc.stdout.fileno(), 1)
        assert byte, f"pid {proc.pid} ended ({proc.wait()}) before its line, got {line!r}"
        line += byte
    return line.decode().rstrip("\n")


def _answers_the_marker(proc: subprocess.Popen[bytes]) -> list[str]:
    """Every signal ``proc`` handled since its last line, up to the marker (bounded)."""
    os.kill(proc.pid, MARKER)
    seen = [_read_line(proc)]
    while seen[-1] != str(int(MARKER)):
        seen.append(_read_line(proc))
    return seen[:-1]


def _recycled(pid: int) -> ProcessId:
    """``pid`` as a snapshot would have named an earlier process: same pid, other start time."""
    return ProcessId(pid, psutil.Process(pid).create_time() + 1.0)


def _state(pid: int) -> str:
    return psutil.Process(pid).status()


def _wait_until_stopped(pid: int) -> None:
    """SIGSTOP takes effect asynchronously: wait (bounded) until the process shows it."""
    deadline = time.monotonic() + 5
    while _state(pid) != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, _state(pid)
        time.sleep(0.01)


def test_a_recycled_pid_is_never_signalled(witness: subprocess.Popen[bytes]) -> None:
    ident = _recycled(witness.pid)
    for sig in (signal.SIGSTOP, signal.SIGKILL, hook.DUMP_SIGNAL):
        assert not tree.signal_process(ident, sig)
    assert _answers_the_marker(witness) == []  # neither stopped, killed nor asked for a dump
    real = ProcessId(witness.pid, psutil.Process(witness.pid).create_time())
    assert tree.signal_process(real, hook.DUMP_SIGNAL)  # the check is on identity, not pid
    assert _answers_the_marker(witness) == [str(int(hook.DUMP_SIGNAL))]


def test_kill_tree_spares_a_process_whose_pid_was_recycled_after_its_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # root -> [recycled victim, real child]: the first listing names the victim with another
    # process's start time, as if its pid had been reused since.
    code = (
        "import subprocess, sys, time\n"
        "a = subprocess.Popen(['sleep', '1000']); b = subprocess.Popen(['sleep', '1001'])\n"
        "print(a.pid, b.pid, flush=True); time.sleep(1000)\n"
    )
    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout is not None
        victim, doomed = (int(word) for word in root.stdout.readline().split())
        real_identify = tree.identify

        def identify(procs: list[psutil.Process]) -> dict[int, ProcessId]:
            found = real_identify(procs)
            if victim in found:
                found[victim] = _recycled(victim)
            return found

        monkeypatch.setattr(kill, "identify", identify)
        result = kill.kill_tree(root.pid, budget_s=2.0)
        assert [ident.pid for ident in result.killed] == [doomed]
        assert victim not in {ident.pid for ident in result.survivors}
        # neither stopped nor killed
        assert _state(victim) in (psutil.STATUS_SLEEPING, psutil.STATUS_RUNNING)
        deadline = time.monotonic() + 5
        while psutil.pid_exists(doomed) and _state(doomed) != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, _state(doomed)
            time.sleep(0.01)
    finally:
        for child in psutil.Process(root.pid).children(recursive=True):
            child.kill()
        root.kill()
        root.communicate()


def test_a_dump_request_never_signals_a_recycled_pid(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dump_dir = os.fspath(tmp_path)
    # the dump handler (faulthandler's, in C) writes before the marker's Python handler runs
    code = (
        "import signal, sys\n"
        "from pytest_torchhang.inject import hook\n"
        "assert hook.install(sys.argv[1])\n"
        "signal.signal(int(sys.argv[2]), lambda signum, frame: print(signum, flush=True))\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    signal.pause()\n"
    )
    monkeypatch.delenv(hook.DUMP_DIR_ENV, raising=False)
    child = subprocess.Popen(
        [sys.executable, "-c", code, dump_dir, str(int(MARKER))], stdout=subprocess.PIPE, bufsize=0
    )
    try:
        assert _read_line(child) == "ready"
        dump_file = hook.dump_path(dump_dir, child.pid)
        assert stacks.handles_signal(child.pid, hook.DUMP_SIGNAL)

        # running, then stopped (a stopped process would also be sent SIGCONT)
        for stopped in (False, True):
            if stopped:
                os.kill(child.pid, signal.SIGSTOP)
                _wait_until_stopped(child.pid)
            dumps = stacks.request_dumps([_recycled(child.pid)], dump_dir, budget_s=0.3)
            assert dumps[child.pid].status == "gone before its stack could be taken"
            if stopped:  # a SIGCONT wakes a stopped process as it is sent
                assert _state(child.pid) == psutil.STATUS_STOPPED
                os.kill(child.pid, signal.SIGCONT)
            assert _answers_the_marker(child) == []
            assert os.path.getsize(dump_file) == 0  # no dump signal was pending at the marker

        # the same request with the true identity is answered: the setup above could tell
        real = ProcessId(child.pid, psutil.Process(child.pid).create_time())
        dumps = stacks.request_dumps([real], dump_dir, budget_s=5.0)
        assert dumps[child.pid].status == "ok", dumps[child.pid]
        assert any(f.name == "<module>" for t in dumps[child.pid].threads for f in t.frames)
    finally:
        child.kill()
        child.communicate()
