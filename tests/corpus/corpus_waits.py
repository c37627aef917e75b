"""Corpus: classes of wait whose cause has a name in the user's words (no torch in the children)."""

import importlib
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
import time

FORK = mp.get_context("fork")


def _handle(slots, item):
    slots.acquire()
    if item < 0:
        return  # an early return: the slot is never released
    slots.release()


def _work(slots, items):
    for item in items:
        _handle(slots, item)


def test_waits_semaphore_slots_leak_on_an_early_return():
    slots = FORK.BoundedSemaphore(2)
    workers = [FORK.Process(target=_work, args=(slots, [1, -1, 2])) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def _thread_work(slots, items):
    for item in items:
        _handle(slots, item)


def test_waits_threading_semaphore_slots_leak_on_an_early_return():
    slots = threading.BoundedSemaphore(2)
    threads = [
        threading.Thread(target=_thread_work, args=(slots, [1, -1, 2]), daemon=True)
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _produce(queue):
    for item in range(4):
        queue.put(item)
    queue.put(None)  # one end-of-stream marker, for two consumers


def _consume(queue):
    while True:
        item = queue.get()
        if item is None:
            return


def test_waits_one_end_marker_for_two_consumers():
    queue = FORK.Queue()
    producer = FORK.Process(target=_produce, args=(queue,))
    consumers = [FORK.Process(target=_consume, args=(queue,)) for _ in range(2)]
    for process in [producer, *consumers]:
        process.start()
    producer.join()
    for consumer in consumers:
        consumer.join()


def test_waits_popen_wait_with_a_full_stderr_pipe():
    code = "import sys; sys.stderr.write('x' * (1 << 20)); sys.stderr.flush()"
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    child.wait()  # before reading stderr: the child blocks writing into a full pipe


def _fail_before_the_flag(path):
    raise ValueError(f"no data to write {path} from")  # exits with code 1


def test_waits_spins_for_a_file_a_failed_producer_never_writes(tmp_path):
    flag = str(tmp_path / "ready")
    producer = FORK.Process(target=_fail_before_the_flag, args=(flag,))
    producer.start()
    while not os.path.exists(flag):  # spins: no sleep, no deadline
        pass


def _count_to(counter):
    counter.value += 1
    sys.exit(1)  # fails before its second step


def test_waits_spins_on_a_shared_value_a_failed_producer_never_sets():
    counter = FORK.Value("i", 0)
    producer = FORK.Process(target=_count_to, args=(counter,))
    producer.start()
    while counter.value < 2:  # spins: no sleep, no deadline
        pass


def _serve(server):
    conns = []
    while True:
        conn, _ = server.accept()  # accepts every request, and never answers
        conns.append(conn)


def _service(server):
    thread = threading.Thread(target=_serve, args=(server,), name="http-server")
    thread.start()
    thread.join()


def test_waits_recv_from_a_server_that_accepted_and_never_answers():
    server = socket.create_server(("127.0.0.1", 0))
    address = server.getsockname()
    child = FORK.Process(target=_service, args=(server,))
    child.start()
    server.close()  # the child serves it
    with socket.create_connection(address) as conn:
        conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
        conn.recv(1)  # no timeout


def _import_the_slow_module():
    import torchhang_corpus_slow_module  # noqa: F401


def test_waits_fork_child_imports_a_module_a_parent_thread_was_importing(tmp_path):
    (tmp_path / "torchhang_corpus_slow_module.py").write_text("import time\ntime.sleep(20)\n")
    sys.path.insert(0, str(tmp_path))
    importer = threading.Thread(target=_import_the_slow_module, daemon=True)
    importer.start()
    time.sleep(0.3)  # the thread now holds the module's import lock
    child = FORK.Process(target=_import_the_slow_module)
    child.start()
    child.join()


def _wait_for_the_stop(queue):  # B
    queue.get()  # the stop sentinel: the test puts it after its join


def _start_and_join(queue):  # A
    stopper = FORK.Process(target=_wait_for_the_stop, args=(queue,))
    stopper.start()
    stopper.join()


def test_waits_join_chain_to_a_sentinel_sent_after_the_join():
    queue = FORK.Queue()
    middle = FORK.Process(target=_start_and_join, args=(queue,))
    middle.start()
    middle.join()  # the test joins A, A joins B, B waits for the sentinel below
    queue.put(None)


def _consume_until_the_sentinel(queue):
    for _item in iter(queue.get, None):
        pass


def test_waits_two_consumers_iterate_to_a_sentinel_put_once():
    queue = FORK.Queue()
    consumers = [FORK.Process(target=_consume_until_the_sentinel, args=(queue,)) for _ in range(2)]
    for consumer in consumers:
        consumer.start()
    for item in [*range(3), None]:  # one sentinel for two consumers
        queue.put(item)
    for consumer in consumers:
        consumer.join()


def _serve_in_this_process(server):
    conns = []
    while True:
        conn, _ = server.accept()  # accepts, and never answers
        conns.append(conn)


def test_waits_recv_from_a_server_thread_of_the_test_that_never_answers():
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(
        target=_serve_in_this_process, args=(server,), name="stub-server", daemon=True
    ).start()
    conn = socket.create_connection(server.getsockname())
    conn.sendall(b"PING\n")
    conn.recv(1)  # no timeout


def test_waits_polls_with_a_sleep_for_a_file_a_failed_producer_never_writes(tmp_path):
    flag = str(tmp_path / "ready")
    producer = FORK.Process(target=_fail_before_the_flag, args=(flag,))
    producer.start()
    while not os.path.exists(flag):
        time.sleep(0.05)


def _import_by_name():
    importlib.import_module("torchhang_corpus_slow_module_by_name")


def test_waits_fork_child_imports_by_name_a_module_a_parent_thread_was_importing(tmp_path):
    (tmp_path / "torchhang_corpus_slow_module_by_name.py").write_text(
        "import time\ntime.sleep(20)\n"
    )
    sys.path.insert(0, str(tmp_path))
    threading.Thread(target=_import_by_name, name="late-importer", daemon=True).start()
    time.sleep(0.3)  # the thread now holds the module's import lock
    child = FORK.Process(target=_import_by_name)
    child.start()
    child.join()


def test_waits_semaphore_held_by_the_test_while_it_joins():
    slots = FORK.BoundedSemaphore(1)
    with slots:  # the test holds the only slot: not a leak, a deadlock
        worker = FORK.Process(target=_handle, args=(slots, 1))
        worker.start()
        worker.join()


# --- the same classes, where what could end the wait waits for the waiter (issue 28) ---


def _import_named(name):
    importlib.import_module(name)


def test_waits_fork_child_imports_a_module_named_by_a_variable_a_parent_thread_imported(tmp_path):
    name = "torchhang_corpus_gated_module"
    (tmp_path / "torchhang_corpus_gate.py").write_text(
        "import threading\nmay_finish = threading.Event()\n"
    )
    (tmp_path / f"{name}.py").write_text(
        "import torchhang_corpus_gate\ntorchhang_corpus_gate.may_finish.wait()\n"
    )
    sys.path.insert(0, str(tmp_path))
    gate = importlib.import_module("torchhang_corpus_gate")
    warmup = threading.Thread(target=_import_named, args=(name,), name="warm-up", daemon=True)
    warmup.start()
    time.sleep(0.3)  # the thread now holds the module's import lock
    child = FORK.Process(target=_import_named, args=(name,))
    child.start()
    gate.may_finish.set()  # the parent's import ends; the child's copy of the lock stays held
    warmup.join()
    child.join()


def _read_shard(slots, shard, results):
    slots.acquire()
    try:
        if shard < 0:
            raise OSError(f"shard {shard} is unreadable")
        value = shard * 10
    except OSError:
        return _read_shard(slots, -shard, results)  # retried while this frame holds its slot
    slots.release()
    results.put(value)
    return value


def _read_shards(slots, shards, results):
    for shard in shards:
        _read_shard(slots, shard, results)


def test_waits_semaphore_slot_held_by_a_retry_while_the_test_reads_results():
    slots = FORK.BoundedSemaphore(2)
    results = FORK.Queue()
    readers = [
        FORK.Process(target=_read_shards, args=(slots, [1, -2, 3], results)) for _ in range(2)
    ]
    for reader in readers:
        reader.start()
    got = [results.get() for _ in range(6)]
    assert len(got) == 6


def _count_until_the_marker(queue, conn):
    count = 0
    while True:
        item = queue.get()
        if item is None:
            break
        count += 1
    conn.send(count)


def test_waits_one_end_marker_for_two_consumers_whose_counts_the_test_reads():
    queue = FORK.Queue()
    producer = FORK.Process(target=_produce, args=(queue,))
    pipes = [FORK.Pipe(duplex=False) for _ in range(2)]
    consumers = [FORK.Process(target=_count_until_the_marker, args=(queue, w)) for _, w in pipes]
    for process in [producer, *consumers]:
        process.start()
    counts = [r.recv() for r, _ in pipes]
    assert sum(counts) == 4
