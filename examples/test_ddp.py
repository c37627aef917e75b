"""A 2-rank DistributedDataParallel training step through ``torch_hang.distributed``.

Each rank runs ``ddp_step(rank, world_size)`` after the fixture has set up its process group (gloo
on CPU; nccl where the test holds a GPU per rank). If one rank waits in a collective that the other
never calls, the test fails with both ranks' stacks instead of waiting for gloo's 30-minute timeout:
see hangs/test_collective_mismatch.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist
from cifar_task import CifarNet, fake_cifar
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

if TYPE_CHECKING:
    from pytest_torchhang.runner.api import TorchHang


@dataclass
class StepResult:
    """What one rank saw and did, compared across ranks by the test."""

    backend: str
    loss: float
    checksum: float  # the sum of all parameters after the step
    indices: list[int]  # the samples of this rank's batch


def ddp_step(rank: int, world_size: int, batch_size: int = 32) -> StepResult:
    """One training step on this rank's shard of the data."""
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway; the seed makes it visible
    model = DistributedDataParallel(
        CifarNet().to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    dataset = fake_cifar(world_size * batch_size)
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, seed=0
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images, labels = next(iter(loader))
    loss = nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
    optimizer.zero_grad()
    loss.backward()  # DDP averages the gradients of all ranks here (an all_reduce)
    optimizer.step()
    return StepResult(
        backend=dist.get_backend(),
        loss=loss.item(),
        checksum=sum(p.detach().double().sum().item() for p in model.parameters()),
        indices=sorted(sampler),
    )


def _check_ranks(results: list[StepResult], batch_size: int = 32) -> None:
    first, second = results
    assert first.loss != second.loss  # each rank saw different samples...
    assert first.checksum == pytest.approx(second.checksum)  # ...and took the same step
    assert set(first.indices).isdisjoint(second.indices)
    assert len(first.indices) == len(second.indices) == batch_size


@pytest.mark.cpu
def test_two_ranks_take_the_same_ddp_step_on_their_own_shards(torch_hang: TorchHang) -> None:
    results = torch_hang.distributed(ddp_step, world_size=2)

    assert [r.backend for r in results] == ["gloo", "gloo"]
    _check_ranks(results)


@pytest.mark.gpu(2)
def test_two_ranks_take_the_same_ddp_step_on_two_gpus_with_nccl(torch_hang: TorchHang) -> None:
    results = torch_hang.distributed(ddp_step, world_size=2)

    assert [r.backend for r in results] == ["nccl", "nccl"]
    _check_ranks(results)
