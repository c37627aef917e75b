"""Two process groups over the same two ranks (one for gradients, one for metrics); the ranks walk a
dict of pending reductions in different orders, so rank 0 enters the all_reduce on the gradient group
while rank 1 enters the one on the metrics group, and each waits for the other (gloo)."""

import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world_size, port, same_order):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=30),
    )
    groups = {"grads": dist.new_group([0, 1]), "metrics": dist.new_group([0, 1])}
    names = ["grads", "metrics"]
    if not same_order and rank == 1:
        names.reverse()  # e.g. a set or a dict filled in a rank-dependent order
    for name in names:
        dist.all_reduce(torch.ones(4), group=groups[name])
    dist.destroy_process_group()


def test_reductions_in_rank_dependent_order():
    mp.start_processes(rank_main, args=(2, _free_port(), False), nprocs=2, start_method="fork")


def test_reductions_in_a_fixed_order():
    mp.start_processes(rank_main, args=(2, _free_port(), True), nprocs=2, start_method="fork")
