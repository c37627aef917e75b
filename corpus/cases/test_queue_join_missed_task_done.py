"""Worker threads skip task_done() on the path that handles a bad item, so Queue.join() never returns."""

import queue
import threading


def convert_all(items, skip_bad_items_without_task_done):
    jobs = queue.Queue()
    results = []

    def worker():
        while True:
            item = jobs.get()
            try:
                value = int(item)
            except ValueError:
                if skip_bad_items_without_task_done:
                    continue  # the bad item is never marked done
                jobs.task_done()
                continue
            results.append(value)
            jobs.task_done()

    for _ in range(2):
        threading.Thread(target=worker, daemon=True).start()
    for item in items:
        jobs.put(item)
    jobs.join()
    return sorted(results)


def test_convert_skips_a_bad_row():
    assert convert_all(["1", "2", "x", "3"], skip_bad_items_without_task_done=True) == [1, 2, 3]


def test_convert_marks_a_bad_row_done():
    assert convert_all(["1", "2", "x", "3"], skip_bad_items_without_task_done=False) == [1, 2, 3]
