"""Corpus: hangs in data loading (DataLoader workers forked from the pytest process)."""

import concurrent.futures
import fcntl
import multiprocessing as mp
import os
import signal
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

FORK = mp.get_context("fork")


def _loader(dataset, **kw):
    kw.setdefault("num_workers", 2)
    return DataLoader(dataset, multiprocessing_context="fork", **kw)


class StopsItself(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index == 0:
            os.kill(os.getpid(), signal.SIGSTOP)  # a debugger, a job-control signal, a kill -STOP
        return torch.ones(1)


def test_loading_worker_stopped():
    for _ in _loader(StopsItself(), num_workers=2, batch_size=2):
        pass


class WaitsForParent(Dataset):
    def __init__(self):
        self.started = FORK.Event()

    def __len__(self):
        return 8

    def __getitem__(self, index):
        self.started.wait()  # the parent sets it once it has its first batch
        return torch.ones(1)


def test_loading_workers_wait_for_an_event_set_after_the_first_batch():
    dataset = WaitsForParent()
    for _ in _loader(dataset):
        dataset.started.set()


class Endless(IterableDataset):
    def __iter__(self):
        while True:  # filters everything out: never yields
            pass


def test_loading_iterable_worker_spins():
    for _ in _loader(Endless(), num_workers=1):
        pass


LOCK = threading.Lock()


class LockedAtFork(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        with LOCK:
            return torch.ones(1)


def test_loading_lock_held_at_fork():
    LOCK.acquire()
    try:
        for _ in _loader(LockedAtFork()):
            pass
    finally:
        LOCK.release()


class TakesItsLockTwice(Dataset):
    def __init__(self):
        self.lock = threading.Lock()

    def __len__(self):
        return 8

    def __getitem__(self, index):
        with self.lock:  # noqa: SIM117 - taken twice on purpose
            with self.lock:
                return torch.ones(1)


def test_loading_lock_taken_twice():
    for _ in _loader(TakesItsLockTwice(), num_workers=1):
        pass


POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1)


class ThreadPoolDecoder(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return POOL.submit(torch.ones, 1).result()  # the pool's thread lives in the parent only


def test_loading_future_result_after_fork():
    POOL.submit(int).result()  # the pool's thread now exists, in this process
    for _ in _loader(ThreadPoolDecoder(), num_workers=1):
        pass


READ_FD, WRITE_FD = os.pipe()


class ReadsAPipe(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return os.read(READ_FD, 1)  # nobody ever writes


def test_loading_worker_reads_a_silent_pipe():
    for _ in _loader(ReadsAPipe(), num_workers=1):
        pass


class SlowItem(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        time.sleep(1000)  # a remote fetch without a timeout, say
        return torch.ones(1)


def test_loading_worker_sleeps():
    for _ in _loader(SlowItem(), num_workers=1):
        pass


MP_LOCK = FORK.Lock()


class SharedLock(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        with MP_LOCK:
            return torch.ones(1)


def test_loading_workers_wait_for_a_multiprocessing_lock_the_parent_holds():
    with MP_LOCK:  # held across the whole loop
        for _ in _loader(SharedLock()):
            pass


class FileLocked(Dataset):
    def __init__(self, path):
        self.path = path

    def __len__(self):
        return 8

    def __getitem__(self, index):
        with open(self.path) as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # a cache directory's lock
            return torch.ones(1)


def test_loading_workers_wait_for_a_file_lock_the_parent_holds(tmp_path):
    path = tmp_path / "cache.lock"
    path.write_text("")
    with open(path) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        for _ in _loader(FileLocked(str(path))):
            pass


class ManyThreads(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        x = torch.randn(512, 512)
        return (x @ x).sum()


def _more_threads(worker_id):
    torch.set_num_threads(4)  # "faster workers": undoes the DataLoader's set_num_threads(1)


def test_loading_openmp_after_the_parent_ran_ops():
    a = torch.randn(1024, 1024)
    (a @ a).sum()  # starts this process's OpenMP pool
    for _ in _loader(ManyThreads(), num_workers=1, worker_init_fn=_more_threads):
        pass


class Resized(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        image = torch.randn(1, 3, 256, 256)
        return torch.nn.functional.interpolate(image, size=(512, 512))  # a library's parallel op


def _two_threads(worker_id):
    torch.set_num_threads(2)  # "a bit faster": undoes the DataLoader's set_num_threads(1)


def test_loading_openmp_in_a_library_op_after_worker_init_raises_threads():
    a = torch.randn(1024, 1024)
    (a @ a).sum()  # starts this process's OpenMP pool
    for _ in _loader(Resized(), num_workers=1, worker_init_fn=_two_threads):
        pass


class RateLimited(Dataset):
    def __len__(self):
        return 100

    def __getitem__(self, index):
        time.sleep(0.25)  # a service's rate limit: four requests a second
        return torch.ones(1)


def test_loading_slow_rate_limited_worker():
    for _ in _loader(RateLimited(), num_workers=1):  # passes, after 25 s
        pass


class ReadsAFifo(Dataset):
    def __init__(self, path):
        self.path = path

    def __len__(self):
        return 4

    def __getitem__(self, index):
        with open(self.path) as fifo:  # opening a FIFO for reading waits for a writer
            return torch.tensor([len(fifo.read())])


def test_loading_worker_opens_a_fifo_nobody_writes(tmp_path):
    path = tmp_path / "samples.fifo"
    os.mkfifo(path)  # meant for a producer process that was never started
    for _ in _loader(ReadsAFifo(str(path)), num_workers=1):
        pass


class LockedSamples(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return {"index": index, "lock": threading.Lock()}  # a lock cannot be pickled


def test_loading_batch_that_cannot_be_pickled():
    # batch_size=None: no collation, the sample goes to the queue as it is
    for _ in _loader(LockedSamples(), batch_size=None, num_workers=1):
        pass


class CappedReads(Dataset):
    """Reads capped by a semaphore shared by the workers; a missing file leaks its slot."""

    def __init__(self, slots):
        self.slots = slots

    def __len__(self):
        return 64

    def __getitem__(self, index):
        self.slots.acquire()
        if index % 16 == 9:
            return torch.zeros(2)  # a placeholder for a missing file: the slot is not released
        self.slots.release()
        return torch.ones(2)


def test_loading_workers_leak_the_slots_of_a_shared_semaphore():
    slots = FORK.BoundedSemaphore(2)
    for _ in _loader(CappedReads(slots), batch_size=4):
        pass


class Spectra(Dataset):
    def __init__(self):
        self.wave = torch.randn(400_000, dtype=torch.float64)

    def __len__(self):
        return 8

    def __getitem__(self, index):
        wave = self.wave
        return wave.float().reshape(400, 1000).abs().mean(dim=1)  # methods of a tensor variable


def test_loading_openmp_in_tensor_methods_after_worker_init_raises_threads():
    torch.set_num_threads(2)
    torch.randn(400_000, dtype=torch.float64).float()  # starts this process's OpenMP pool
    for _ in _loader(Spectra(), num_workers=1, worker_init_fn=_two_threads):
        pass
