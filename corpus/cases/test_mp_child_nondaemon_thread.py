"""An evaluation process starts a heartbeat thread (not a daemon) and returns from its target; since
Python 3.7 a multiprocessing child joins its non-daemon threads before it exits, and the heartbeat
loops forever, so the child never exits and the parent's join() waits for it."""

import multiprocessing
import threading
import time

CTX = multiprocessing.get_context("fork")


def heartbeat(stop):
    while not stop.is_set():
        time.sleep(0.05)


def evaluate(results, daemon):
    stop = threading.Event()
    threading.Thread(target=heartbeat, args=(stop,), name="heartbeat", daemon=daemon).start()
    results.put(0.93)  # the evaluation itself is done


def run_eval(daemon):
    results = CTX.Queue()
    child = CTX.Process(target=evaluate, args=(results, daemon), name="evaluator")
    child.start()
    score = results.get()
    child.join()
    return score


def test_evaluate_with_a_heartbeat_thread():
    assert run_eval(daemon=False) == 0.93


def test_evaluate_with_a_daemon_heartbeat_thread():
    assert run_eval(daemon=True) == 0.93
