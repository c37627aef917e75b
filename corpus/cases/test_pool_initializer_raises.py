"""A process pool whose worker initializer fails: every worker dies at start and is replaced."""

import multiprocessing
import time

CTX = multiprocessing.get_context("fork")
SETTINGS = {}


def open_feature_store(path):
    # the store path is wrong on this machine: the initializer raises in every new worker
    time.sleep(0.2)  # connecting to the store takes a moment
    with open(path) as fh:
        SETTINGS["store"] = fh.read()


def score(x):
    return x * 2


def test_scores_with_a_feature_store_that_cannot_open(tmp_path):
    with CTX.Pool(
        2, initializer=open_feature_store, initargs=(str(tmp_path / "missing.db"),)
    ) as pool:
        assert pool.map(score, range(8)) == [x * 2 for x in range(8)]


def test_scores_with_a_feature_store(tmp_path):
    store = tmp_path / "features.db"
    store.write_text("ok")
    with CTX.Pool(2, initializer=open_feature_store, initargs=(str(store),)) as pool:
        assert pool.map(score, range(8)) == [x * 2 for x in range(8)]
