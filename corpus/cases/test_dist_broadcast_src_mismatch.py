"""The random seed is shared with dist.broadcast, but every rank names itself as the source
(src=rank instead of src=0), so each rank sends and nobody receives the other's (gloo)."""

import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world_size, port, src_is_self):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=30),
    )
    seed = torch.tensor([1234 + rank], dtype=torch.int64)
    dist.broadcast(seed, src=rank if src_is_self else 0)
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()


def test_share_seed_from_every_rank():
    mp.start_processes(rank_main, args=(2, _free_port(), True), nprocs=2, start_method="fork")


def test_share_seed_from_rank_zero():
    mp.start_processes(rank_main, args=(2, _free_port(), False), nprocs=2, start_method="fork")
