"""DataLoader workers log every sample through a queue handler onto a bounded multiprocessing queue that
a QueueListener in the training process should drain; the listener is created but never started, so
once the queue is full every worker blocks in put() inside __getitem__ and no batch arrives."""

import logging
import logging.handlers
import multiprocessing

import torch
from torch.utils.data import DataLoader, Dataset


class BlockingQueueHandler(logging.handlers.QueueHandler):
    """Never drop a record: wait for room in the queue (what enqueue=True loggers do)."""

    def enqueue(self, record):
        self.queue.put(record)


class LoggedSamples(Dataset):
    def __init__(self, log_queue):
        self.log_queue = log_queue

    def __len__(self):
        return 64

    def __getitem__(self, i):
        log = logging.getLogger("samples")
        if not log.handlers:
            log.addHandler(BlockingQueueHandler(self.log_queue))
            log.setLevel(logging.INFO)
            log.propagate = False
        log.info("loaded sample %d", i)
        return torch.tensor([float(i)])


def epoch(start_listener):
    log_queue = multiprocessing.get_context("fork").Queue(maxsize=8)
    listener = logging.handlers.QueueListener(log_queue, logging.NullHandler())
    if start_listener:
        listener.start()
    try:
        loader = DataLoader(LoggedSamples(log_queue), batch_size=8, num_workers=2)
        return sum(float(b.sum()) for b in loader)
    finally:
        if start_listener:
            listener.stop()


def test_epoch_with_sample_logging():
    assert epoch(start_listener=False) == sum(range(64))


def test_epoch_with_sample_logging_and_a_running_listener():
    assert epoch(start_listener=True) == sum(range(64))
