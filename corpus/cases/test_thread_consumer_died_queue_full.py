"""The consumer thread of a bounded queue dies of an exception on a bad record; the producer keeps
putting and blocks forever once the queue is full."""

import queue
import threading


def pipeline(records, tolerate_bad):
    q = queue.Queue(maxsize=4)
    out = []

    def consume():
        while True:
            rec = q.get()
            if rec is None:
                return
            try:
                out.append(int(rec))
            except ValueError:
                if not tolerate_bad:
                    raise

    consumer = threading.Thread(target=consume, name="writer")
    consumer.start()
    for rec in records:
        q.put(rec)
    q.put(None)
    consumer.join()
    return out


RECORDS = ["1", "bad"] + [str(i) for i in range(20)]


def test_pipeline_with_a_bad_record():
    assert len(pipeline(RECORDS, tolerate_bad=False)) == 21


def test_pipeline_skipping_a_bad_record():
    assert len(pipeline(RECORDS, tolerate_bad=True)) == 21
