"""Corpus: hangs in sharing data and resources between processes (no torch op in the children)."""

import atexit
import fcntl
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

FORK = mp.get_context("fork")


def test_sharing_thread_join_while_holding_its_lock():
    lock = threading.Lock()
    with lock:
        worker = threading.Thread(target=lambda: lock.acquire(), daemon=True)
        worker.start()
        worker.join()


def _put_a_lot(queue):
    queue.put(b"x" * (1 << 20))  # more than a pipe holds: the feeder flushes it at exit


def test_sharing_join_before_draining_a_queue():
    queue = FORK.Queue()
    child = FORK.Process(target=_put_a_lot, args=(queue,))
    child.start()
    child.join()  # before queue.get()
    queue.get()


def _census(lock, counts, index):
    lock.acquire()
    if index == 0:
        return  # an early return: the Manager's lock is never released
    counts[index] = 1
    lock.release()


def test_sharing_manager_lock_leaked():
    with FORK.Manager() as manager:
        lock, counts = manager.Lock(), manager.dict()
        for batch in ([0], [1, 2]):
            workers = [FORK.Process(target=_census, args=(lock, counts, i)) for i in batch]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()


def _square(x):
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, in real life
    return x * x


def _map_in_a_pool():
    pool = FORK.Pool(2)
    pool.map(_square, range(8))


def test_sharing_pool_map_worker_killed():
    # the Pool lives in a child: a Pool whose worker died holding the task queue's lock cannot
    # be terminated, not even at interpreter exit, so it must not live in the pytest process
    child = FORK.Process(target=_map_in_a_pool)
    child.start()
    child.join()


def _wait_for(event):
    event.wait()


def test_sharing_child_waits_for_an_event_the_parent_sets_after_join():
    event = FORK.Event()
    child = FORK.Process(target=_wait_for, args=(event,))
    child.start()
    child.join()
    event.set()


READY = threading.Event()


def test_sharing_threading_event_in_a_forked_child():
    threading.Thread(target=lambda: (time.sleep(60), READY.set()), daemon=True).start()
    child = FORK.Process(target=READY.wait)  # the thread that sets it is not copied by fork
    child.start()
    child.join()


def _read_all(read_fd):
    while os.read(read_fd, 4096):
        pass


def test_sharing_child_reads_a_pipe_it_never_closed():
    read_fd, write_fd = os.pipe()
    child = FORK.Process(target=_read_all, args=(read_fd,))  # inherits write_fd too
    child.start()
    os.write(write_fd, b"data")
    os.close(write_fd)  # the parent is done writing; the child's copy keeps the pipe open
    child.join()


def test_sharing_popen_wait_while_the_child_reads_stdin():
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    child.wait()  # stdin is never closed


def test_sharing_popen_child_stopped():
    code = "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"
    subprocess.Popen([sys.executable, "-c", code]).wait()


def _die(conn):
    os._exit(3)  # crashes before sending its result


def test_sharing_child_died_before_sending():
    parent_end, child_end = FORK.Pipe(duplex=False)
    child = FORK.Process(target=_die, args=(child_end,))
    child.start()
    parent_end.recv()  # the parent's own child_end keeps the pipe open


def _lock_both(first, second, ready, go):
    with open(first) as a:
        fcntl.flock(a, fcntl.LOCK_EX)
        ready.release()
        go.acquire()
        with open(second) as b:
            fcntl.flock(b, fcntl.LOCK_EX)


def test_sharing_two_children_take_two_file_locks_in_opposite_order(tmp_path):
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for path in paths:
        open(path, "w").close()
    ready, go = FORK.Semaphore(0), FORK.Semaphore(0)
    children = [
        FORK.Process(target=_lock_both, args=(paths[i], paths[1 - i], ready, go)) for i in range(2)
    ]
    for child in children:
        child.start()
    ready.acquire()
    ready.acquire()
    go.release()
    go.release()
    for child in children:
        child.join()


def _hold(path):
    with open(path) as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        time.sleep(1000)


def _take(path):
    time.sleep(0.3)
    with open(path) as f:
        fcntl.flock(f, fcntl.LOCK_EX)


def test_sharing_file_lock_held_by_a_sleeping_child(tmp_path):
    path = str(tmp_path / "lock")
    open(path, "w").close()
    holder = FORK.Process(target=_hold, args=(path,))
    holder.start()
    waiter = FORK.Process(target=_take, args=(path,))
    waiter.start()
    waiter.join()


def test_sharing_popen_communicate_with_a_sleeping_child():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"]).communicate()


def test_sharing_the_test_itself_sleeps():
    time.sleep(1000)


def test_sharing_popen_wait_with_a_full_stdout_pipe():
    code = "import sys; sys.stdout.write('x' * (1 << 20)); sys.stdout.flush()"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    child.wait()  # before reading stdout: the child blocks writing into a full pipe


def _put_two(queue):
    queue.put(1)
    queue.put(2)  # the queue holds one item: waits for a get() that never comes
    queue.close()


def test_sharing_join_a_child_blocked_on_a_full_bounded_queue():
    queue = FORK.Queue(maxsize=1)
    child = FORK.Process(target=_put_two, args=(queue,))
    child.start()
    child.join()


def _meet(barrier):
    barrier.wait()


def test_sharing_barrier_for_more_parties_than_processes():
    barrier = FORK.Barrier(3)
    children = [FORK.Process(target=_meet, args=(barrier,)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join()


# A service that accepts connections and never answers, started before any test (at import):
# it is context, not part of the test's tree.
SERVER = subprocess.Popen(
    [
        sys.executable,
        "-c",
        "import socket, sys, time; s = socket.create_server(('127.0.0.1', 0)); "
        "print(s.getsockname()[1], flush=True); conns = []\n"
        "while True: conns.append(s.accept())",
    ],
    stdout=subprocess.PIPE,
)
PORT = int(SERVER.stdout.readline())
atexit.register(SERVER.kill)


def test_sharing_a_service_that_never_answers():
    import socket

    with socket.create_connection(("127.0.0.1", PORT)) as conn:
        conn.recv(1)  # no timeout


def _read_from_the_test(read_fd):  # B
    os.read(read_fd, 1)  # only the test holds the write end: it writes after its join


def _join_a_reader(read_fd, write_fd):  # A
    os.close(write_fd)  # neither A nor B can write: B's only writer is the test
    reader = FORK.Process(target=_read_from_the_test, args=(read_fd,))
    reader.start()
    reader.join()


def test_sharing_join_chain_back_to_the_test():
    read_fd, write_fd = os.pipe()
    middle = FORK.Process(target=_join_a_reader, args=(read_fd, write_fd))
    middle.start()
    middle.join()  # the test joins A, A joins B, B waits for the write below
    os.write(write_fd, b"x")


SUPERVISOR = """
import subprocess, sys, time
work = "import time; end = time.monotonic() + 30\\nwhile time.monotonic() < end: pass"
children = [subprocess.Popen([sys.executable, "-c", work]) for _ in range(2)]
while any(child.poll() is None for child in children):  # healthy: they compute
    time.sleep(0.2)
"""


def test_sharing_slow_supervisor_polling_healthy_children():
    subprocess.run([sys.executable, "-c", SUPERVISOR], check=True)  # passes, after 30 s


#: A launcher that starts a worker in the background and exits at once: the worker inherits
#: the launcher's stdout, the pipe the test reads to its end.
LAUNCHER = (
    "import subprocess, sys\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print('launched')\n"
)


def test_sharing_output_read_to_its_end_while_a_background_grandchild_holds_it():
    done = subprocess.run([sys.executable, "-c", LAUNCHER], capture_output=True, text=True)
    assert done.stdout.strip() == "launched"
