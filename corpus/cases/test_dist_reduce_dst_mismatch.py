"""Each rank reduces its loss to "the logging rank", but the logging rank is read from a per-process
setting that differs (rank 0 passes dst=0, rank 1 passes dst=1): a rooted collective with two roots
(gloo)."""

import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world_size, port, logger_per_process):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=30),
    )
    loss = torch.tensor([0.5 + rank])
    log_rank = rank if logger_per_process else 0  # "I log my own metrics"
    dist.reduce(loss, dst=log_rank)
    dist.barrier()
    dist.destroy_process_group()


def test_reduce_loss_to_each_ranks_own_logger():
    mp.start_processes(rank_main, args=(2, _free_port(), True), nprocs=2, start_method="fork")


def test_reduce_loss_to_rank_zero():
    mp.start_processes(rank_main, args=(2, _free_port(), False), nprocs=2, start_method="fork")
