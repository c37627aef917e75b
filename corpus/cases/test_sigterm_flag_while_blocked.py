"""A worker's SIGTERM handler only sets a "stop" flag that its loop checks between jobs; the worker is
blocked waiting for the next job, the interrupted get() is retried, and it never looks at the flag."""

import multiprocessing
import signal
import time

CTX = multiprocessing.get_context("fork")


def consume(jobs, ready, poll):
    state = {"stop": False}

    def on_term(signum, frame):
        state["stop"] = True

    signal.signal(signal.SIGTERM, on_term)
    ready.set()
    while not state["stop"]:
        if poll:
            try:
                job = jobs.get(timeout=0.1)
            except Exception:
                continue
        else:
            job = jobs.get()
        print("job", job)


def shut_down(poll):
    jobs, ready = CTX.Queue(), CTX.Event()
    worker = CTX.Process(target=consume, args=(jobs, ready, poll), name="job-consumer")
    worker.start()
    ready.wait()
    jobs.put("warmup")
    time.sleep(0.2)
    worker.terminate()  # "graceful": the worker should finish its loop and exit
    worker.join()
    return worker.exitcode


def test_graceful_stop_of_an_idle_consumer():
    assert shut_down(poll=False) == 0


def test_graceful_stop_of_a_polling_consumer():
    assert shut_down(poll=True) == 0
