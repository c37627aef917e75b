"""``torch_hang.dataloader`` and ``torch_hang.distributed``: stats, ranks, errors, hangs, bad input."""

from __future__ import annotations

import pytest

from conftest import GuardedRunner
from outcomes import assert_outcomes

LOADER = """
import threading

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from pytest_torchhang import ChildCrashed, HangError
from pytest_torchhang.report.text import to_text


class Squares(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.tensor([index * index])


class Broken(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        raise ValueError(f"bad sample {index}")


_LOCK = threading.Lock()


class Stuck(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        with _LOCK:
            with _LOCK:
                return index


def make_loader():
    return DataLoader(Squares(), batch_size=8, num_workers=1)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_stats(torch_hang, context):
    stats = torch_hang.dataloader(Squares(), batches=5, batch_size=4, num_workers=2,
                                  multiprocessing_context=context)
    assert stats.batches == 5 and len(stats.batch_times) == 5
    assert stats.first_batch_s is not None and stats.first_batch_s > 0
    assert len(stats.worker_pids) == 2 and stats.start_method == context


def test_factory_returning_a_loader_iterates_all(torch_hang):
    stats = torch_hang.dataloader(make_loader)
    assert stats.batches == 8 and len(stats.worker_pids) == 1


def test_dataset_error_is_raised_with_its_traceback(torch_hang):
    with pytest.raises(ValueError, match="bad sample"):
        torch_hang.dataloader(Broken(), batches=1, num_workers=2)


def test_worker_hang_reports_each_worker(torch_hang):
    with pytest.raises(HangError) as info:
        torch_hang.dataloader(Stuck(), batches=1, num_workers=2, timeout=2)
    text = to_text(info.value.report)
    assert "[DataLoader worker 0/2 (dataset Stuck)]" in text
    assert "[DataLoader worker 1/2 (dataset Stuck)]" in text
    assert "with _LOCK:" in text
    assert "[torch_hang.dataloader(Stuck) child]" in text


class Segfaults(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        import ctypes
        ctypes.string_at(0)


def test_the_loader_child_crashing_is_a_crash(torch_hang):
    with pytest.raises(ChildCrashed, match="torch_hang.dataloader.Segfaults. child .* SIGSEGV") as info:
        torch_hang.dataloader(Segfaults(), batches=1, num_workers=0)
    assert "in __getitem__" in info.value.crash_trace


def test_bad_batches(torch_hang):
    with pytest.raises(ValueError, match="batches must be None or an int >= 0"):
        torch_hang.dataloader(Squares(), batches=-1)
"""


DISTRIBUTED = """
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from pytest_torchhang import ChildCrashed, HangError
from pytest_torchhang.report.text import to_text


def ranks_sum(rank, world_size):
    tensor = torch.tensor([float(rank + 1)])
    dist.all_reduce(tensor)
    return (rank, dist.get_backend(), tensor.item())


def rank_one_fails(rank, world_size):
    if rank == 1:
        raise RuntimeError("rank 1 lost its data")
    dist.all_reduce(torch.ones(1))


def mismatch(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        dist.barrier()


def ddp_step(rank, world_size, seed):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(seed + rank)
    inputs, targets = torch.randn(16, 8), torch.randint(0, 2, (16,))
    loss = nn.functional.cross_entropy(model(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_results_per_rank(torch_hang):
    assert torch_hang.distributed(ranks_sum, world_size=2) == [(0, "gloo", 3.0), (1, "gloo", 3.0)]


def test_ddp_training_step_keeps_ranks_in_sync(torch_hang):
    params = torch_hang.distributed(ddp_step, 0, world_size=2)
    for a, b in zip(*params):
        assert torch.equal(a, b)


def test_first_failing_rank_is_named_and_waiting_ranks_shown(torch_hang):
    with pytest.raises(RuntimeError, match="rank 1 lost its data") as info:
        torch_hang.distributed(rank_one_fails, world_size=2)
    notes = "\\n".join(info.value.__notes__)
    assert "rank 1/2 (gloo) (pid" in notes.splitlines()[0]
    assert "rank 1/2 (gloo) failed first; the other ranks:" in notes
    assert "rank 0/2 (gloo): still running" in notes
    assert "stacks of the ranks still running (then killed):" in notes
    assert "[rank 0/2 (gloo)]" in notes and "all_reduce" in notes


def test_collective_mismatch_hang_shows_every_rank(torch_hang):
    with pytest.raises(HangError) as info:
        torch_hang.distributed(mismatch, world_size=2, timeout=3)
    text = to_text(info.value.report)
    assert "ranks wait in different collectives (rank 0/2 in all_reduce, rank 1/2 in barrier)" in text


def rank_one_segfaults(rank, world_size):
    if rank == 1:
        import ctypes
        ctypes.string_at(0)
    dist.all_reduce(torch.ones(1))


def test_a_rank_killed_by_a_signal_is_a_crash_naming_it(torch_hang):
    with pytest.raises(ChildCrashed, match="rank 1/2 .gloo. .pid [0-9]+. was killed by SIGSEGV") as info:
        torch_hang.distributed(rank_one_segfaults, world_size=2)
    assert "in rank_one_segfaults" in info.value.crash_trace
    notes = "\\n".join(info.value.__notes__)
    assert "rank 1/2 (gloo) failed first; the other ranks:" in notes


def test_bad_input(torch_hang):
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        torch_hang.distributed(ranks_sum, world_size=0)
    with pytest.raises(ValueError, match="backend 'nccl' needs one GPU per rank"):
        torch_hang.distributed(ranks_sum, backend="nccl")
    with pytest.raises(TypeError, match="must be picklable"):
        torch_hang.distributed(lambda rank, world_size: rank)
"""


def test_dataloader_and_distributed_stats_results_errors_crashes_and_hangs(
    guarded: GuardedRunner,
) -> None:
    # one inner session for both fixtures: pytest, torch and the zygote start once
    guarded.pytester.makepyfile(test_loader=LOADER, test_dist=DISTRIBUTED)
    session = guarded.run(timeout=60)
    assert_outcomes(session.result, passed=13)
    session.assert_clean()


GPU_PLACEMENT = """
import os

import pytest


def visible(rank, world_size):
    return os.environ["CUDA_VISIBLE_DEVICES"]


@pytest.mark.gpu(2)
def test_one_rank_per_leased_gpu(torch_hang):
    leased = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    assert len(leased) == 2
    assert torch_hang.distributed(visible, world_size=2) == leased


def cuda_visible():
    return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.cpu
def test_cpu_marker_hides_cuda_from_fixture_children(torch_hang):
    assert torch_hang.run(cuda_visible) == ""
"""


def test_distributed_places_one_rank_per_leased_gpu(
    guarded: GuardedRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_TORCH_HANG_FAKE_GPUS", "4")
    guarded.pytester.makepyfile(test_gpus=GPU_PLACEMENT)
    session = guarded.run(timeout=60)
    assert_outcomes(session.result, passed=2)
    session.assert_clean()
