"""HANGS ON PURPOSE: two DDP ranks wait in different collectives.

After validation, rank 0 alone reduces the validation metric (``all_reduce``) while rank 1 goes
straight to the end-of-epoch ``barrier``. Each rank waits for the other to join its own
collective: without the plugin, gloo gives up after 30 minutes with a timeout that says nothing
about the branch.

What the plugin reports: the hint ``ranks wait in different collectives (rank 0/2 in all_reduce,
rank 1/2 in barrier)`` and each rank's stack at the call. The fix: every rank calls the same
collectives in the same order; move the ``all_reduce`` out of the ``if rank == 0`` branch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from pytest_torchhang.runner.api import TorchHang


def epoch_end_with_a_rank_dependent_branch(rank: int, world_size: int) -> None:
    model = nn.Linear(8, 2)  # stands for the trained model (kept in sync by DDP during training)
    with torch.no_grad():  # validation on this rank's shard
        metric = (model(torch.randn(64, 8)).argmax(dim=1) == 0).float().mean()
    if rank == 0:  # BUG: only rank 0 reduces the validation metric
        dist.all_reduce(metric)
    dist.barrier()  # end of epoch


# The call's own timeout (3 s from the start of the ranks) reports the hang. The marker's bound is
# larger: the first fixture call of a session also starts a warm process that imports torch (~3 s).
@pytest.mark.torch_hang(timeout=30)
def test_only_rank_zero_reduces_the_validation_metric(torch_hang: TorchHang) -> None:
    torch_hang.distributed(epoch_end_with_a_rank_dependent_branch, world_size=2, timeout=3)
