"""Corpus: waits a signal or an alarm would still end, an idle server beside the hang, and a
child without a stack (no torch in the children)."""

import concurrent.futures as cf
import http.server
import multiprocessing as mp
import os
import signal
import sys
import threading

FORK = mp.get_context("fork")


def _serve_until_terminated():
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # stopped by terminate()
    threading.Event().wait()


def test_signals_worker_ended_by_sigterm_joined_without_terminate():
    worker = FORK.Process(target=_serve_until_terminated)
    worker.start()
    worker.join()  # worker.terminate() was forgotten


class _GuardExpired(Exception):
    pass


def _expire(signum, frame):
    raise _GuardExpired("the test's own 30 s guard")


def test_signals_test_under_its_own_alarm_hangs_on_a_lock():
    previous = signal.signal(signal.SIGALRM, _expire)
    signal.alarm(30)
    try:
        lock = threading.Lock()
        with lock:
            lock.acquire()  # taken twice: its own guard would end it, in 30 s
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _serve_http():
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    server.serve_forever()


def test_signals_idle_http_server_beside_a_test_deadlocked_on_its_lock():
    server = FORK.Process(target=_serve_http, daemon=True)
    server.start()
    lock = threading.Lock()
    with lock:
        lock.acquire()  # the test's own deadlock; the server is idle and healthy


def test_signals_idle_http_server_thread_beside_a_test_deadlocked_on_its_lock():
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, name="http-server", daemon=True).start()
    try:
        lock = threading.Lock()
        with lock:
            lock.acquire()  # the same deadlock, the server a thread of the test's own process
    finally:
        server.shutdown()
        server.server_close()


def _square(x):
    return x * x


def test_signals_idle_process_pool_beside_a_test_deadlocked_on_its_lock():
    with cf.ProcessPoolExecutor(2, mp_context=FORK) as pool:
        assert list(pool.map(_square, [1, 2, 3])) == [1, 4, 9]  # its workers now wait for work
        lock = threading.Lock()
        with lock:
            lock.acquire()


def test_signals_idle_thread_pool_beside_a_test_deadlocked_on_its_lock():
    with cf.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(_square, [1, 2, 3])) == [1, 4, 9]
        lock = threading.Lock()
        with lock:
            lock.acquire()


def _daemonise_and_read():
    os.setsid()
    read_end, write_end = os.pipe()
    low, high = sorted((read_end, write_end))
    # a daemon closes what it inherited (the dump handler's file too)
    os.closerange(0, low)
    os.closerange(low + 1, high)
    os.closerange(high + 1, 256)
    os.read(read_end, 1)


def test_signals_setsid_daemon_child_with_closed_descriptors_reads_forever():
    child = FORK.Process(target=_daemonise_and_read)
    child.start()
    child.join()
