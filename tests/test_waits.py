"""The wait-for graph read from /proc: real blocked processes, each edge checked against the truth."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from pytest_torchhang.capture import attach, procfs, waitgraph
from pytest_torchhang.report import waits
from pytest_torchhang.report.model import TaskWait

FORK = mp.get_context("fork")


def _blocked(pid: int, call: str, timeout: float = 10.0) -> None:
    """Wait until ``pid``'s main thread sits in ``call`` (the machine may be loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task = waitgraph.read([pid]).members[pid].tasks
        if task and task[0].call == call:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} never blocked in {call}")


def _main(pid: int, **kw: object) -> TaskWait:
    member = waitgraph.read([pid], **kw).members[pid]  # type: ignore[arg-type]
    return next(t for t in member.tasks if t.tid == pid)


@contextmanager
def _child(target: Callable[[], object]) -> Iterator[int]:
    proc = FORK.Process(target=target, daemon=True)
    proc.start()
    assert proc.pid is not None
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.join(5)


def test_a_reader_waits_for_the_processes_that_hold_the_write_end() -> None:
    r, w = os.pipe()
    writer = subprocess.Popen(["sleep", "30"], pass_fds=(w,))
    os.close(w)
    try:
        with _child(lambda: os.read(r, 1)) as reader:
            _blocked(reader, "read")
            task = _main(reader)
            assert task.wchan == "anon_pipe_read" or not task.wchan
            assert f"fd {r}: pipe:[" in task.obj
            assert [e.pid for e in task.waits_for] == [-1]  # the writer is not in the tree read
            graph = waitgraph.read([reader, writer.pid])
            assert {e.pid for e in graph.members[reader].tasks[0].waits_for} == {writer.pid}
            assert graph.members[writer.pid].tasks[0].call in ("clock_nanosleep", "nanosleep")
    finally:
        writer.kill()
        writer.wait()
        os.close(r)


def test_a_pipe_only_the_reader_itself_can_write_is_named_as_its_own_copy() -> None:
    r, w = os.pipe()
    try:
        with _child(lambda: os.read(r, 1)) as reader:
            _blocked(reader, "read")
            edges = _main(reader).waits_for
            assert [e.pid for e in edges if "own copy" in e.via] == [reader]
    finally:
        os.close(r)
        os.close(w)


def _wait_on_event_after_fork() -> None:
    threading.Event().wait()


def test_a_threading_event_in_a_single_threaded_process_has_nobody_to_set_it() -> None:
    with _child(_wait_on_event_after_fork) as pid:
        _blocked(pid, "futex")
        task = _main(pid)
        assert "private to this process" in task.obj
        assert [(e.pid, e.via) for e in task.waits_for] == [
            (0, "no other thread in this process can release it")
        ]


def test_a_stopped_process_and_a_zombie_child_keep_their_facts() -> None:
    stopped = subprocess.Popen(["sleep", "30"])
    dead = subprocess.Popen([sys.executable, "-c", "import os; os._exit(3)"])
    killed = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        os.kill(killed.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            graph = waitgraph.read([os.getpid(), stopped.pid])
            if {dead.pid, killed.pid} <= set(graph.members) and graph.members[stopped.pid].stopped:
                break
            time.sleep(0.05)
        assert graph.members[stopped.pid].stopped
        assert waitgraph.describe_exit(graph.members[dead.pid].wait_status) == "exited with code 3"
        assert waitgraph.describe_exit(graph.members[killed.pid].wait_status) == "killed by SIGKILL"
    finally:
        for proc in (stopped, dead, killed):
            proc.kill()
            proc.wait()


def test_flock_waiters_point_at_the_holder() -> None:
    with tempfile.NamedTemporaryFile() as lockfile:

        def take() -> None:
            with open(lockfile.name) as f:
                fcntl.flock(f, fcntl.LOCK_EX)

        holder = subprocess.Popen(
            [sys.executable, "-c", "import fcntl,sys,time; f=open(sys.argv[1]); "
             "fcntl.flock(f, fcntl.LOCK_EX); print(flush=True); time.sleep(30)", lockfile.name],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        try:
            assert holder.stdout is not None and holder.stdout.readline()
            with _child(take) as waiter:
                _blocked(waiter, "flock")
                task = _main(waiter)
                assert task.obj == f"file lock on {lockfile.name}"
                assert [e.pid for e in task.waits_for] in ([holder.pid], [-1])
                graph = waitgraph.read([waiter, holder.pid])
                assert [e.pid for e in graph.members[waiter].tasks[0].waits_for] == [holder.pid]
        finally:
            holder.kill()
            holder.wait()


def _sem_wait(sem: object) -> None:
    sem.acquire()  # type: ignore[attr-defined]


def test_a_multiprocessing_semaphore_wait_points_at_every_process_that_maps_it() -> None:
    sem = FORK.Semaphore(0)
    procs = [FORK.Process(target=_sem_wait, args=(sem,), daemon=True) for _ in range(2)]
    for proc in procs:
        proc.start()
    try:
        pids = [p.pid for p in procs if p.pid]
        for pid in pids:
            _blocked(pid, "futex")
        graph = waitgraph.read([os.getpid(), *pids], skip_tids={threading.get_native_id()})
        task = graph.members[pids[0]].tasks[0]
        assert "/dev/shm/sem." in task.obj
        assert {os.getpid(), pids[1]} <= {e.pid for e in task.waits_for}
        assert {e.kind for e in task.waits_for if e.pid == os.getpid()} == {waits.MAPS}
    finally:
        for proc in procs:
            proc.kill()
            proc.join(5)


def test_a_semaphore_wait_carries_the_count_read_from_the_semaphore() -> None:
    sem = FORK.BoundedSemaphore(2)
    sem.acquire()
    sem.acquire()  # both slots taken: the children wait on a count of 0
    procs = [FORK.Process(target=_sem_wait, args=(sem,), daemon=True) for _ in range(2)]
    for proc in procs:
        proc.start()
    try:
        pids = [p.pid for p in procs if p.pid]
        for pid in pids:
            _blocked(pid, "futex")
        graph = waitgraph.read([os.getpid(), *pids], skip_tids={threading.get_native_id()})
        counts = [graph.members[pid].tasks[0].wait for pid in pids]
        assert all(isinstance(c, waits.Semaphore) and c.value == 0 for c in counts), counts
        assert "(a semaphore, count 0)" in graph.members[pids[0]].tasks[0].obj
    finally:
        for proc in procs:
            proc.kill()
            proc.join(5)


def test_a_parent_in_wait4_waits_for_its_child() -> None:
    code = "import subprocess; subprocess.Popen(['sleep', '30']).wait()"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        _blocked(parent.pid, "wait4")
        task = _main(parent.pid)
        (edge,) = task.waits_for
        assert edge.via.startswith("its exit") and edge.pid in procfs.children(parent.pid)
    finally:
        for child in procfs.children(parent.pid):
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_python_threads_are_matched_to_their_kernel_threads() -> None:
    from pytest_torchhang.capture.stacks import in_process_threads

    event = threading.Event()
    thread = threading.Thread(target=event.wait, name="waiter")
    thread.start()
    try:
        stacks = in_process_threads()
        for stack in stacks:
            stack.tid = 0  # as a faulthandler dump has them: idents only
        member = waitgraph.read([os.getpid()]).members[os.getpid()]
        attach.match_threads(os.getpid(), stacks, member.tasks)
        task = next(t for t in member.tasks if t.tid == thread.native_id)
        assert task.python_thread == hex(thread.ident or 0)
    finally:
        event.set()
        thread.join()


@pytest.mark.parametrize("processes", [4, 64])
def test_the_read_is_fast_and_bounded(processes: int) -> None:
    children = [subprocess.Popen(["sleep", "30"]) for _ in range(processes)]
    try:
        start = time.monotonic()
        graph = waitgraph.read([c.pid for c in children])
        took = time.monotonic() - start
        assert len(graph.members) == processes
        assert took < 5.0  # a loaded 2-core machine; bench/bench_capture.py has the real figures
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_a_fifo_reader_waits_for_the_processes_that_opened_it_for_writing(tmp_path: object) -> None:
    fifo = os.path.join(str(tmp_path), "fifo")
    os.mkfifo(fifo)
    reader = subprocess.Popen([sys.executable, "-c", f"open({fifo!r}).read()"])
    writer = subprocess.Popen(["sh", "-c", f"exec 3>{fifo}; sleep 30"])
    try:
        _blocked(reader.pid, "read")
        task = waitgraph.read([reader.pid, writer.pid]).members[reader.pid].tasks[0]
        assert task.obj.endswith(f": {fifo}")
        assert [e.pid for e in task.waits_for] == [writer.pid]
    finally:
        for proc in (reader, writer):
            proc.kill()
            proc.wait()


def _wait_with_a_timeout() -> None:
    event = threading.Event()
    while not event.wait(5):
        pass


def test_timed_waits_are_told_from_waits_without_a_timeout() -> None:
    with _child(_wait_with_a_timeout) as timed, _child(_wait_on_event_after_fork) as untimed:
        _blocked(timed, "futex")
        _blocked(untimed, "futex")
        assert _main(timed).timed
        assert not _main(untimed).timed


def test_unix_socket_and_tcp_peers_are_found() -> None:
    import socket

    left, right = socket.socketpair()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    holder = subprocess.Popen(["sleep", "30"], pass_fds=(right.fileno(), accepted.fileno()))
    right.close()
    accepted.close()
    try:
        with _child(lambda: left.recv(1)) as unix_reader, _child(lambda: client.recv(1)) as tcp:
            _blocked(unix_reader, "recvfrom")
            _blocked(tcp, "recvfrom")
            graph = waitgraph.read([unix_reader, tcp, holder.pid])
            unix_edges = graph.members[unix_reader].tasks[0].waits_for
            tcp_edges = graph.members[tcp].tasks[0].waits_for
            assert [(e.pid, e.via.split(" ")[0]) for e in unix_edges] == [(holder.pid, "unix")]
            assert [(e.pid, e.via.split(" ")[0]) for e in tcp_edges] == [(holder.pid, "tcp")]
            assert "127.0.0.1:" in tcp_edges[0].via
            assert [e.kind for e in tcp_edges] == [waits.SOCKET_PEER]
            sock = graph.members[tcp].tasks[0].wait
            assert isinstance(sock, waits.Socket) and sock.family == "tcp"
            local, remote = client.getsockname(), client.getpeername()
            assert sock.local == f"{local[0]}:{local[1]}"
            assert sock.remote == f"{remote[0]}:{remote[1]}"
            assert isinstance(graph.members[unix_reader].tasks[0].wait, waits.Socket)
    finally:
        holder.kill()
        holder.wait()
        for sock in (left, server, client):
            sock.close()
