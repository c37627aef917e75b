"""A hang's cleanup removes what the killed tree made, and nothing another program made meanwhile."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from conftest import SHM_DIR, TAG_ENV, GuardedRunner, private_shm_supported

HOLDS_A_SEGMENT_AND_A_MANAGER = """
import multiprocessing as mp
import os
import time
from multiprocessing import resource_tracker, shared_memory

import pytest_torchhang

TAG = os.environ["LEFTOVERS_TAG"]


def hold_a_segment(made):
    segment = shared_memory.SharedMemory(name=f"psm_{TAG}_tree", create=True, size=4096)
    resource_tracker.unregister(segment._name, "shared_memory")  # nobody else will unlink it
    made.set()
    time.sleep(1000)


def test_hangs_holding_a_segment_and_a_manager():
    manager = mp.Manager()
    shared = manager.dict(ready=True)
    made = mp.Event()
    child = mp.Process(target=hold_a_segment, args=(made,))
    child.start()
    assert made.wait(60) and shared["ready"]
    with open(os.environ["LEFTOVERS_READY"], "w") as ready:
        ready.write(str(os.getpid()))
    while not os.path.exists(os.environ["LEFTOVERS_DONE"]):  # another program runs meanwhile
        pytest_torchhang.progress()
        time.sleep(0.05)
    child.join()


def test_the_trees_leftovers_are_gone_and_the_other_programs_stay():
    names = os.listdir("/dev/shm")
    assert f"psm_{TAG}_tree" not in names
    assert f"psm_{TAG}_outside" in names
    temp = sorted(n for n in os.listdir(os.environ["TMPDIR"]) if n.startswith("pymp-"))
    assert temp == [f"pymp-{TAG}-outside"], temp
    assert os.listdir(os.path.join(os.environ["TMPDIR"], temp[0])) == ["listener-outside"]
"""

#: Another program: it makes a segment and hands it over by name (closed, not unlinked), and a
#: multiprocessing-like temp dir with a listener socket in it, while the test hangs.
ANOTHER_PROGRAM = """
import os
import socket
import sys
from multiprocessing import resource_tracker, shared_memory

name, directory = sys.argv[1], sys.argv[2]
segment = shared_memory.SharedMemory(name=name, create=True, size=4096)
resource_tracker.unregister(segment._name, "shared_memory")  # its reader will unlink it
segment.close()
os.mkdir(directory)
listener = socket.socket(socket.AF_UNIX)
listener.bind(os.path.join(directory, "listener-outside"))
listener.close()
"""


def _run_another_program(ready: Path, done: Path, name: str, directory: str, out: list[str]) -> None:
    """Once the test hangs, run ANOTHER_PROGRAM outside its tree (in its /dev/shm), then say so."""
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = ready.read_text()
        # the inner session may have a /dev/shm of its own: enter its mount namespace, not its tree
        enter = ["nsenter", f"--target={pid}", "--mount"] if private_shm_supported() else []
        env = {k: v for k, v in os.environ.items() if k != TAG_ENV}
        command = [*enter, sys.executable, "-c", ANOTHER_PROGRAM, name, directory]
        done_run = subprocess.run(command, env=env, capture_output=True, timeout=60)
        out.append(f"rc={done_run.returncode} {done_run.stderr.decode()[-2000:]}")
    except Exception as exc:
        out.append(repr(exc))
    finally:
        done.touch()


@pytest.mark.skipif(
    private_shm_supported() and shutil.which("nsenter") is None,
    reason="another program in the inner session's own /dev/shm needs nsenter",
)
def test_a_hang_removes_its_trees_segments_and_manager_dir_and_not_another_programs(
    guarded: GuardedRunner,
) -> None:
    tag = uuid.uuid4().hex[:10]
    ready, done = guarded.pytester.path / "ready", guarded.pytester.path / "done"
    guarded.monkeypatch.setenv("LEFTOVERS_TAG", tag)
    guarded.monkeypatch.setenv("LEFTOVERS_READY", str(ready))
    guarded.monkeypatch.setenv("LEFTOVERS_DONE", str(done))
    outside_dir = os.path.join(os.environ["TMPDIR"], f"pymp-{tag}-outside")
    guarded.pytester.makepyfile(test_leftovers=HOLDS_A_SEGMENT_AND_A_MANAGER)
    ran: list[str] = []
    other = threading.Thread(
        target=_run_another_program, args=(ready, done, f"psm_{tag}_outside", outside_dir, ran)
    )
    other.start()
    try:
        session = guarded.run("--torch-hang-stall=2", "-p", "no:randomly", timeout=60, grace_s=5)
        other.join()
        assert ran and ran[0].startswith("rc=0"), ran
        session.result.assert_outcomes(failed=1, passed=1)
        report = session.report_of("test_hangs_holding_a_segment_and_a_manager")
        assert report.splitlines()[1].startswith("STALL after "), report[:2000]
        # the child's segment; the Manager's listener socket and its pymp dir
        cleanup = next(line for line in report.splitlines() if line.startswith("cleanup: "))
        assert fnmatch.fnmatch(
            cleanup,
            "cleanup: killed * process(es)*; removed 1 /dev/shm segment(s); "
            "removed 2 multiprocessing listener socket(s) and dir(s) from the temp dir;*",
        ), cleanup
        # only the names this test made are judged: the machine's /dev/shm is shared
        assert f"psm_{tag}_tree" not in session.new_shm
        assert session.new_tmp == [f"pymp-{tag}-outside"]
        assert not session.leftovers
    finally:
        other.join()
        (SHM_DIR / f"psm_{tag}_outside").unlink(missing_ok=True)  # a machine-wide /dev/shm


SHARES_A_TENSOR = """
import multiprocessing as mp
import os
import time

import pytest_torchhang


def share_and_hang(conn):
    import torch
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    tensor = torch.ones(1024).share_memory_()  # a torch_<pid>_* segment, served by a manager
    conn.send([n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{os.getpid()}_")])
    time.sleep(1000)


def test_hangs_with_a_child_holding_a_torch_segment():
    parent, child_end = mp.Pipe()
    child = mp.Process(target=share_and_hang, args=(child_end,))
    child.start()
    while not parent.poll(0.05):  # the child imports torch meanwhile: beats keep the stall off
        pytest_torchhang.progress()
    names = parent.recv()
    assert names, "the child made no torch segment"
    with open("segments", "w") as out:
        out.write("\\n".join(names))
    child.join()


def test_the_torch_segment_is_gone():
    names = open("segments").read().split()
    assert names and not set(names) & set(os.listdir("/dev/shm"))
"""


@pytest.mark.needs_torch
def test_a_hang_removes_the_torch_segments_of_its_tree(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_torch_leftovers=SHARES_A_TENSOR)
    session = guarded.run("--torch-hang-stall=2", "-p", "no:randomly", timeout=120, grace_s=10)
    session.result.assert_outcomes(failed=1, passed=1)
    report = session.report_of("test_hangs_with_a_child_holding_a_torch_segment")
    assert report.splitlines()[1].startswith("STALL after "), report[:2000]
    assert "[torch_shm_manager]" in report  # the segment's manager was in the tree
    names = (guarded.pytester.path / "segments").read_text().split()
    assert not set(names) & set(session.new_shm)
    session.assert_clean()
