"""The classic training loop (FakeData CIFAR, 4 DataLoader workers, SGD), guarded three ways.

1. In the test process, as users write it: the plugin bounds the test (``torch_hang_timeout``
   in pytest.ini, or ``--torch-hang-timeout``), and a hung DataLoader worker fails this test with
   every worker's stack instead of stalling the whole job.
2. Through ``torch_hang.dataloader``: only the data pipeline, in a child process, with timings.
3. Through ``torch_hang.run``: the whole loop in a child process; GPU tests use ``spawn``
   children, which see exactly the GPUs leased to the test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from cifar_task import cifar_loader, train

if TYPE_CHECKING:
    from pytest_torchhang.runner.api import TorchHang


@pytest.mark.cpu
def test_the_classic_loop_trains_in_the_test_process() -> None:
    result = train(steps=4)

    assert result.device == "cpu"  # the cpu marker hides CUDA from this test
    assert not result.data_parallel
    assert len(result.losses) == 4 and result.finite
    assert result.samples == 512  # one epoch of 4 full batches of 128


@pytest.mark.torch_hang(timeout=30)  # a per-test bound: a first batch slower than that is a bug
def test_the_loader_of_the_classic_loop_yields_batches_from_four_workers(
    torch_hang: TorchHang,
) -> None:
    stats = torch_hang.dataloader(cifar_loader, batches=4)

    assert stats.batches == 4
    assert len(stats.worker_pids) == 4
    assert stats.first_batch_s is not None and stats.first_batch_s < 20


def test_the_classic_loop_trains_in_a_child_process(torch_hang: TorchHang) -> None:
    result = torch_hang.run(train, steps=4, device="cpu")

    assert len(result.losses) == 4 and result.finite


def test_the_model_overfits_one_batch(torch_hang: TorchHang) -> None:
    # The usual sanity check of a model and its training step: it can learn 64 samples by heart
    # (without augmentation, which would make every pass a new batch).
    result = torch_hang.run(
        train, steps=8, size=64, batch_size=64, num_workers=0, augment=False, device="cpu"
    )

    assert result.finite
    assert result.losses[-1] < result.losses[0] / 4


@pytest.mark.gpu(1)
def test_the_classic_loop_trains_on_one_gpu(torch_hang: TorchHang) -> None:
    # spawn: a fresh interpreter that initialises CUDA with the GPU leased to this test
    result = torch_hang.run(train, steps=4, start_method="spawn")

    assert result.device == "cuda"
    assert not result.data_parallel
    assert len(result.losses) == 4 and result.finite


@pytest.mark.gpu(2)
def test_the_classic_loop_uses_data_parallel_on_two_gpus(torch_hang: TorchHang) -> None:
    result = torch_hang.run(train, steps=4, start_method="spawn")

    assert result.device == "cuda"
    assert result.data_parallel  # nn.DataParallel splits each batch of 128 over both GPUs
    assert len(result.losses) == 4 and result.finite
