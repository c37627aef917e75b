"""Worker threads meet at a threading.Barrier after loading their part; one fails to load and its thread
ends with an exception without aborting the barrier, so the others wait for it forever."""

import threading


def load_parts(parts, abort_on_error):
    barrier = threading.Barrier(len(parts))
    loaded = {}

    def work(name, text):
        try:
            loaded[name] = float(text)
        except ValueError:
            if abort_on_error:
                barrier.abort()
            raise
        barrier.wait()

    threads = [
        threading.Thread(target=work, args=item, name=f"loader-{item[0]}") for item in parts.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return loaded


def test_loaders_meet_after_a_failed_part():
    assert load_parts({"a": "1.0", "b": "oops", "c": "3.0"}, abort_on_error=False) == {
        "a": 1.0,
        "c": 3.0,
    }


def test_loaders_abort_on_a_failed_part():
    assert load_parts({"a": "1.0", "b": "oops", "c": "3.0"}, abort_on_error=True) == {
        "a": 1.0,
        "c": 3.0,
    }
