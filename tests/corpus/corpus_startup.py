"""Corpus: hangs inside multiprocessing's start-up (spawned children that import this module
again, a Pool that replaces its workers), where the start-up frames are the evidence."""

import fcntl
import multiprocessing as mp
import os
import subprocess
import sys
import threading

import pytest

SPAWN = mp.get_context("spawn")
FORK = mp.get_context("fork")

#: At import, this module waits until nobody writes the shared cache (as a module that reads a
#: cache directory when it is imported). Every spawned child imports it again, before it runs
#: anything: the lock it waits for there is the one its parent holds while it writes.
CACHE_LOCK = os.environ.get("TORCHHANG_CORPUS_CACHE_LOCK")
if CACHE_LOCK:
    with open(CACHE_LOCK, "a") as _cache:
        fcntl.flock(_cache, fcntl.LOCK_SH)  # readers wait for the writer
        fcntl.flock(_cache, fcntl.LOCK_UN)


class Squares:
    """A map-style dataset (the DataLoader asks for no more than __len__ and __getitem__)."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return index * index


# A spawned worker imports torch before this module (3 s idle, 2-3x that on a busy machine).
@pytest.mark.torch_hang(timeout=25)
def test_startup_spawned_loader_worker_imports_a_module_that_waits_for_the_tests_lock(
    tmp_path, monkeypatch
):
    from torch.utils.data import DataLoader

    lock = tmp_path / "cache.lock"
    monkeypatch.setenv("TORCHHANG_CORPUS_CACHE_LOCK", str(lock))
    with open(lock, "w") as cache:
        fcntl.flock(cache, fcntl.LOCK_EX)  # writing the cache while the batches are read
        loader = DataLoader(Squares(), num_workers=1, multiprocessing_context="spawn")
        assert list(loader)


def _lookup(key):
    return key


#: Guards a cache of this process that the workers read when they start.
CACHE = threading.Lock()


def _read_the_cache():
    with CACHE:
        pass


def test_startup_pool_forks_a_replacement_while_the_test_holds_a_lock():
    # the pool starts its first worker, then the test refreshes the cache while the pool works
    with FORK.Pool(1, initializer=_read_the_cache, maxtasksperchild=1) as pool, CACHE:
        assert pool.apply(_lookup, (1,)) == 1  # the first worker's one task: it exits after it
        # its replacement is forked by the pool's maintenance thread with the lock held, and its
        # copy of the lock stays held for ever
        assert pool.apply(_lookup, (2,)) == 2


#: A training script run by the test: its spawned children run its top level again, as
#: ``__mp_main__``, and the top level waits for the cache that the script's main block writes.
SCRIPT = """
import fcntl
import multiprocessing as mp
import os
import subprocess
import sys

with open(os.environ["CACHE_LOCK"], "a") as cache:  # wait for the cache writer
    fcntl.flock(cache, fcntl.LOCK_SH)
    fcntl.flock(cache, fcntl.LOCK_UN)


def train():
    pass


if __name__ == "__main__":
    with open(os.environ["CACHE_LOCK"], "w") as cache:
        fcntl.flock(cache, fcntl.LOCK_EX)  # writing the cache while the trainer runs
        trainer = mp.get_context("spawn").Process(target=train)
        trainer.start()
        trainer.join()
"""


@pytest.mark.torch_hang(timeout=6)
def test_startup_spawned_child_of_a_script_runs_its_top_level_that_waits_for_its_lock(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "CACHE_LOCK": str(tmp_path / "cache.lock")}
    subprocess.run([sys.executable, str(script)], env=env, check=True)


def _wait_for_the_cache(path):
    with open(path, "a") as cache:  # a worker's initializer reads the cache before any task
        fcntl.flock(cache, fcntl.LOCK_SH)
        fcntl.flock(cache, fcntl.LOCK_UN)


@pytest.mark.torch_hang(timeout=6)
def test_startup_executor_worker_initializer_waits_for_the_tests_lock(tmp_path):
    # the executor's manager thread waits for the worker's result: it is no idle service while
    # that worker is blocked, and the test's Future.result() waits on the worker, not "nobody"
    import concurrent.futures as cf

    lock = str(tmp_path / "cache.lock")
    with open(lock, "w") as cache:
        fcntl.flock(cache, fcntl.LOCK_EX)  # writing the cache while the executor starts
        with cf.ProcessPoolExecutor(
            1, mp_context=SPAWN, initializer=_wait_for_the_cache, initargs=(lock,)
        ) as executor:
            assert executor.submit(_lookup, 1).result() == 1


# Last: its maintenance thread stays blocked in the pytest process after the kill (the
# pipe it writes to has its read end open in that process too).
def _init(table):
    assert len(table) > 0


@pytest.mark.torch_hang(timeout=6)
def test_startup_pool_replaces_a_worker_that_waits_for_the_tests_lock(tmp_path, monkeypatch):
    lock = tmp_path / "cache.lock"
    monkeypatch.setenv("TORCHHANG_CORPUS_CACHE_LOCK", str(lock))
    table = os.urandom(256 << 10)  # each worker's copy: larger than a pipe buffer
    with SPAWN.Pool(1, initializer=_init, initargs=(table,), maxtasksperchild=2) as pool:
        assert pool.apply(_lookup, (1,)) == 1  # the first worker is up
        with open(lock, "w") as cache:
            fcntl.flock(cache, fcntl.LOCK_EX)  # writing the cache
            assert pool.apply(_lookup, (2,)) == 2  # the worker's second task: it exits after it
            # its replacement is started by the pool's maintenance thread, and imports this
            # module again: it waits for the lock, the maintenance thread for it to read its
            # initargs, and this call for a worker
            assert pool.apply(_lookup, (3,)) == 3
