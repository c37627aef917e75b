"""Rank 0 publishes the tokenizer vocabulary size through a PrefixStore (its own "data/" namespace over
the rendezvous TCPStore); rank 1 waits for the bare key on the underlying store, so it waits for a key
that is never written under that name."""

import datetime
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world_size, port, reader_uses_prefix):
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, rank == 0, timeout=datetime.timedelta(minutes=30)
    )
    data_store = dist.PrefixStore("data", store)
    if rank == 0:
        data_store.set("vocab_size", "32000")
    reader = data_store if reader_uses_prefix else store
    assert int(reader.get("vocab_size")) == 32000
    store.add("done", 1)
    if rank == 0:
        store.wait(["done"])
        while int(store.add("done", 0)) < world_size:
            pass


def test_vocab_size_read_from_the_root_store():
    mp.start_processes(rank_main, args=(2, _free_port(), False), nprocs=2, start_method="fork")


def test_vocab_size_read_through_the_same_prefix():
    mp.start_processes(rank_main, args=(2, _free_port(), True), nprocs=2, start_method="fork")
