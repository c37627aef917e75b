"""Corpus: gloo ranks forked from the pytest process (which has not run a torch op)."""

import fcntl
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "100")  # the plugin sets it in guarded trees too


def _warm_up(store):
    """Import what DDP imports lazily, here, once: forked ranks then start in milliseconds."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    dist.destroy_process_group()


_warm_up(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"torchhang-corpus-warm-{os.getpid()}"))


def _join(rank, store):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)


def _ddp_uneven(rank, store):
    _join(rank, store)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    for _ in range(2 if rank == 0 else 1):  # uneven inputs: rank 0 has one more batch
        model(torch.ones(4, 8)).sum().backward()
    dist.barrier()  # rank 1 is done and waits for the others


def test_distributed_ddp_uneven_inputs(tmp_path):
    tmp.start_processes(_ddp_uneven, args=(str(tmp_path / "s"),), nprocs=2, start_method="fork")


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, use_head):
        x = self.body(x)
        return self.head(x) if use_head else x


def _ddp_skipped_head(rank, store):
    _join(rank, store)
    model = torch.nn.parallel.DistributedDataParallel(TwoHeads())  # find_unused_parameters=False
    model(torch.ones(4, 8), use_head=rank == 0).sum().backward()
    dist.barrier()


def test_distributed_ddp_head_skipped_on_one_rank(tmp_path):
    tmp.start_processes(
        _ddp_skipped_head, args=(str(tmp_path / "s"),), nprocs=2, start_method="fork"
    )


def _mismatch(rank, store):
    _join(rank, store)
    dist.all_reduce(torch.ones(16))
    if rank == 0:
        dist.all_reduce(torch.ones(1024))
    else:
        dist.barrier()


def test_distributed_different_collectives(tmp_path):
    tmp.start_processes(_mismatch, args=(str(tmp_path / "s"),), nprocs=2, start_method="fork")


def _late(rank, store):
    _join(rank, store)
    if rank == 1:
        time.sleep(1000)  # stuck before the collective its peer already waits in
    dist.barrier()


def test_distributed_rank_never_reaches_the_collective(tmp_path):
    tmp.start_processes(_late, args=(str(tmp_path / "s"),), nprocs=2, start_method="fork")


def _flock_then_barrier(rank, store, lock_path):
    _join(rank, store)
    with open(lock_path) as f:
        if rank == 1:
            fcntl.flock(f, fcntl.LOCK_EX)
            dist.barrier()
        else:
            time.sleep(0.5)
            fcntl.flock(f, fcntl.LOCK_EX)  # held by rank 1, which waits for us in barrier
            dist.barrier()


def test_distributed_file_lock_cycle(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    tmp.start_processes(
        _flock_then_barrier, args=(str(tmp_path / "s"), str(lock)), nprocs=2, start_method="fork"
    )


def _rank_main(rank, store):
    if rank == 1:
        os._exit(1)  # a bad argument, a missing file: it dies before init_process_group
    _join(rank, store)


def test_distributed_rank_died_before_init(tmp_path):
    ctx = tmp.get_context("fork")
    ranks = [ctx.Process(target=_rank_main, args=(r, str(tmp_path / "s"))) for r in range(2)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()  # rank 0 first: rank 1 stays a zombie meanwhile


def _p2p(rank, store):
    _join(rank, store)
    tensor = torch.zeros(4)
    if rank == 0:
        dist.recv(tensor, src=1)
    else:
        dist.recv(tensor, src=0)  # both receive: nobody sends


def test_distributed_both_ranks_receive(tmp_path):
    tmp.start_processes(_p2p, args=(str(tmp_path / "s"),), nprocs=2, start_method="fork")


TRAIN_DIVERGES = """
import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")  # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR
dist.all_reduce(torch.ones(16))
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(1024))
else:
    dist.barrier()
"""


@pytest.mark.torch_hang(timeout=30)  # torchrun, then each rank, import torch: seconds each
def test_distributed_torchrun_ranks_diverge(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_DIVERGES)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    subprocess.run([*run, str(script)], check=True)


def _computes(rank, store):
    _join(rank, store)
    if rank == 1:
        end = time.monotonic() + 30
        while time.monotonic() < end:  # a long step on one rank: it will get there
            torch.ones(64, 64).sum()
    dist.barrier()


def test_distributed_slow_rank_computes(tmp_path):
    tmp.start_processes(_computes, args=(str(tmp_path / "s"),), nprocs=2, start_method="fork")


def _unmatched(rank, store):
    _join(rank, store)
    tensor = torch.zeros(4)
    if rank == 0:
        dist.send(tensor, dst=1, tag=1)
    else:
        dist.recv(tensor, src=0, tag=2)  # another tag: the pair never matches


def test_distributed_send_and_recv_never_match(tmp_path):
    tmp.start_processes(_unmatched, args=(str(tmp_path / "s"),), nprocs=2, start_method="fork")


# PyTorch's MultiProcessTestCase launch: each rank a plain multiprocessing.Process (no RANK
# variable, no torch.multiprocessing), meeting through a FileStore, the parent polling the
# ranks' exit codes. Only the process group says which process is which rank.


def _as_multiprocess_testcase(target, tmp_path):
    file_name = str(tmp_path / "store")
    ctx = multiprocessing.get_context("fork")
    ranks = [
        ctx.Process(target=target, name=f"process {rank}", args=(rank, file_name))
        for rank in range(2)
    ]
    for rank in ranks:
        rank.start()
    while any(rank.exitcode is None for rank in ranks):
        time.sleep(0.1)


def _init_pg(rank, file_name):
    torch.set_num_threads(1)
    store = dist.FileStore(file_name, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    return store


def _skips_a_reduce(rank, file_name):
    _init_pg(rank, file_name)
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    if rank == 0:
        dist.all_reduce(tensor)  # a metric, reduced on rank 0 only
    dist.barrier()


def test_distributed_plain_process_ranks_one_skips_an_all_reduce(tmp_path):
    _as_multiprocess_testcase(_skips_a_reduce, tmp_path)


def _reduce_or_broadcast(rank, file_name):
    _init_pg(rank, file_name)
    tensor = torch.ones(4)
    dist.all_reduce(tensor)
    if rank == 0:
        dist.all_reduce(tensor)
    else:
        dist.broadcast(tensor, src=1)


def test_distributed_plain_process_ranks_in_different_collectives(tmp_path):
    _as_multiprocess_testcase(_reduce_or_broadcast, tmp_path)


def _waits_for_a_key(rank, file_name):
    store = _init_pg(rank, file_name)
    store.set(f"ready_{rank}", "1")
    store.get(f"ready_{rank + 2}")  # off by two: nobody sets ready_2 or ready_3


def test_distributed_plain_process_ranks_wait_for_a_store_key_nobody_sets(tmp_path):
    _as_multiprocess_testcase(_waits_for_a_key, tmp_path)


class _Shards(torch.utils.data.Dataset):
    def __init__(self, rank):
        self.rank = rank

    def __len__(self):
        return 4

    def __getitem__(self, index):
        if self.rank == 1:
            time.sleep(1000)  # rank 1's shard is on a mount that stopped answering
        return torch.ones(2)


def _trains_on_shards(rank, file_name):
    _init_pg(rank, file_name)
    for batch in torch.utils.data.DataLoader(_Shards(rank), num_workers=1):
        dist.all_reduce(batch)


def test_distributed_plain_process_rank_waits_for_its_dataloader_worker(tmp_path):
    _as_multiprocess_testcase(_trains_on_shards, tmp_path)


def _sets_late(rank, file_name):
    store = _init_pg(rank, file_name)
    if rank == 0:
        end = time.monotonic() + 30
        while time.monotonic() < end:  # a long preparation: it will set the key
            torch.ones(64, 64).sum()
        store.set("prepared", "1")
    store.get("prepared")


def test_distributed_plain_process_rank_waits_for_a_key_a_computing_rank_sets_later(tmp_path):
    _as_multiprocess_testcase(_sets_late, tmp_path)


def _publishes_under_its_own_name(rank, file_name):
    store = _init_pg(rank, file_name)
    run_name = f"{socket.gethostname()}-{os.getpid()}"  # each rank names the run itself
    if rank == 0:
        store.set(f"runs/{run_name}/config", "{}")
    else:
        store.get(f"runs/{run_name}/config")
    dist.barrier()


def test_distributed_plain_process_rank_waits_for_a_key_named_from_its_own_value(tmp_path):
    _as_multiprocess_testcase(_publishes_under_its_own_name, tmp_path)


def _builds_a_group_on_rank_0_only(rank, file_name):
    _init_pg(rank, file_name)
    if rank == 0:
        dist.new_group(ranks=[0])  # only the rank that evaluates builds its group
    group = dist.new_group(ranks=[0, 1])
    dist.all_reduce(torch.ones(2), group=group)


def test_distributed_plain_process_ranks_build_a_group_on_one_rank_only(tmp_path):
    _as_multiprocess_testcase(_builds_a_group_on_rank_0_only, tmp_path)
