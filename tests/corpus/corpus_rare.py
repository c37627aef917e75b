"""Corpus: rare hangs (races), for hunting with and without ``--torch-hang-hunt-stress``.

Each function hangs only when a race goes one way; plain runs seldom lose it. They are written
after races the Python and PyTorch documentation warn about, and that users keep reporting:

- between processes: ``counter.value += 1`` is a read and a write, two holds of the Value's
  lock (the multiprocessing docs: "operations like += which involve a read and write are not
  atomic");
- between threads: ``Condition.wait()`` without a predicate misses a ``notify()`` that came
  first (the threading docs' reason for ``wait_for``);
- at start-up: a child says it is ready before it is (it clears its stop flag after saying so);
- at shutdown: a child leaves with ``os._exit`` before its queue's feeder thread flushed (the
  multiprocessing docs: buffered items are flushed at exit, which ``os._exit`` skips);
- check-then-act: ``if not queue.empty(): queue.get()`` by two consumers (the docs: ``empty()``
  is not reliable);
- a lost wake-up between threads: a flag read outside the lock that guards it, then a wait
  for the notify that sets it (the other thread set it and notified in between).

Their names start with ``rare_``, not ``test_``: the diagnosis corpus (which expects each of its
scenarios to hang every time) leaves them out; a hunt collects them with
``-o python_functions=rare_*``.
"""

import multiprocessing as mp
import os
import threading
import time

FORK = mp.get_context("fork")


def _count_in(counter):
    counter.value += 1  # get, then set: another process's increment between them is lost


def rare_lost_update_on_a_shared_value():
    counter = FORK.Value("i", 0)
    children = [FORK.Process(target=_count_in, args=(counter,)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join()
    while counter.value < 2:  # an increment was lost: waits for it forever
        time.sleep(0.01)


def rare_lost_notify_between_threads():
    ready = threading.Condition()

    def say_ready():
        time.sleep(0.002)  # gets ready
        with ready:
            ready.notify()

    threading.Thread(target=say_ready, daemon=True).start()
    with ready:
        ready.wait()  # no predicate: a notify that came before this wait is lost


def rare_lost_wakeup_of_a_flag_checked_outside_its_lock():
    finished = threading.Condition()
    state = {"done": False}

    def wait_until_done():
        if not state["done"]:  # read outside the lock that guards it ...
            with finished:
                finished.wait()  # ... so the notify may have come between the read and here

    waiter = threading.Thread(target=wait_until_done, daemon=True)
    waiter.start()
    time.sleep(0.001)  # its work
    with finished:
        state["done"] = True
        finished.notify_all()
    waiter.join()


def _serve(ready, stop):
    ready.set()  # says it is ready ...
    stop.clear()  # ... then resets its state: a stop that came in between is lost
    stop.wait()


def rare_child_says_ready_before_it_is():
    ready, stop = FORK.Event(), FORK.Event()
    child = FORK.Process(target=_serve, args=(ready, stop))
    child.start()
    ready.wait()
    time.sleep(0.002)  # its other work, before it tells the child to stop
    stop.set()
    child.join()


def _answer_and_leave(queue):
    queue.put("done")  # handed to the queue's feeder thread, which writes it to the pipe
    time.sleep(0.005)
    os._exit(0)  # skips the flush at exit: an answer still in the buffer is lost


def rare_child_exits_before_its_queue_is_flushed():
    queue = FORK.Queue()
    child = FORK.Process(target=_answer_and_leave, args=(queue,))
    child.start()
    queue.get()  # waits forever for a lost answer
    child.join()


def _drain(queue):
    while not queue.empty():
        queue.get()  # another consumer may have taken the last item since empty() said no


def rare_check_then_act_on_a_shared_queue():
    queue = FORK.SimpleQueue()
    for item in range(4):
        queue.put(item)
    consumers = [FORK.Process(target=_drain, args=(queue,)) for _ in range(2)]
    for consumer in consumers:
        consumer.start()
    for consumer in consumers:
        consumer.join()  # one consumer may wait in get() forever
