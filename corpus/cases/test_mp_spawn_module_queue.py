"""Workers report through a module-level multiprocessing Queue; with the spawn start method each child
imports the module again and gets a queue of its own, so the parent waits on a queue nobody writes to."""

import multiprocessing

CTX = multiprocessing.get_context("spawn")
RESULTS = CTX.Queue()  # created at import: once in the parent, once again in every spawned child


def square_to_module_queue(x):
    RESULTS.put(x * x)


def square_to(queue, x):
    queue.put(x * x)


def test_collect_from_workers_through_the_module_queue():
    workers = [CTX.Process(target=square_to_module_queue, args=(x,)) for x in (2, 3)]
    for w in workers:
        w.start()
    assert sorted(RESULTS.get() for _ in workers) == [4, 9]
    for w in workers:
        w.join()


def test_collect_from_workers_through_a_passed_queue():
    results = CTX.Queue()
    workers = [CTX.Process(target=square_to, args=(results, x)) for x in (2, 3)]
    for w in workers:
        w.start()
    assert sorted(results.get() for _ in workers) == [4, 9]
    for w in workers:
        w.join()
