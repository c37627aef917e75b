"""A Pool callback that waits for another task of the same pool: callbacks run in the one thread that
delivers every result, so the awaited result can never be delivered."""

import multiprocessing

CTX = multiprocessing.get_context("fork")


def tokenize(text):
    return text.split()


def count(tokens):
    return len(tokens)


def test_chained_stages_wait_inside_the_callback():
    counts = []
    with CTX.Pool(2) as pool:

        def on_tokens(tokens):
            # second stage started from the first stage's callback, and waited for right there
            counts.append(pool.apply_async(count, (tokens,)).get())

        first = pool.apply_async(tokenize, ("a quick brown fox",), callback=on_tokens)
        first.wait()
        pool.close()
        pool.join()
    assert counts == [4]


def test_chained_stages_in_the_caller():
    with CTX.Pool(2) as pool:
        tokens = pool.apply_async(tokenize, ("a quick brown fox",)).get()
        assert pool.apply_async(count, (tokens,)).get() == 4
