"""torch.distributed hangs: gloo ranks started by torch.multiprocessing (spawned, or forked) that never meet."""

from __future__ import annotations

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

TIMEOUT_S = 25

#: The ranks of the last two scenarios are forked from the test (torch already imported): no
#: start-up to wait for, so a short deadline still has a wide margin.
FORKED_TIMEOUT_S = 8

MISMATCH = f"""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp


def _rank(rank, world_size, store):
    dist.init_process_group("gloo", init_method=f"file://{{store}}", rank=rank, world_size=world_size)
    tensor = torch.ones(1)
    if rank == 0:
        dist.all_reduce(tensor)
    else:
        dist.barrier()


def test_ranks_in_different_collectives(tmp_path):
    tmp.spawn(_rank, args=(2, str(tmp_path / "store")), nprocs=2)


def _lonely(rank, world_size, store):
    dist.init_process_group("gloo", init_method=f"file://{{store}}", rank=rank, world_size=world_size)


@pytest.mark.torch_hang(timeout={FORKED_TIMEOUT_S})
def test_rendezvous_waits_for_ranks_never_started(tmp_path):
    tmp.start_processes(_lonely, args=(3, str(tmp_path / "store")), nprocs=2, start_method="fork")


def _late(rank, world_size, store):
    import time
    dist.init_process_group("gloo", init_method=f"file://{{store}}", rank=rank, world_size=world_size)
    if rank == 1:
        time.sleep(1000)  # stuck before the collective its peer already waits in
    dist.barrier()


@pytest.mark.torch_hang(timeout={FORKED_TIMEOUT_S})
def test_one_rank_never_reaches_the_collective(tmp_path):
    tmp.start_processes(_late, args=(2, str(tmp_path / "store")), nprocs=2, start_method="fork")


def test_next_test_runs():
    pass
"""


def test_gloo_ranks_in_different_collectives_are_named(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_ddp=MISMATCH)
    # Spawned ranks import torch first (3 s idle, 2-3x that on a busy machine, two at a time):
    # the deadline covers that with a wide margin. The forked ranks' two hangs (8 s each) wait
    # in a second session beside it: both mostly wait, and the forked ranks import nothing.
    sessions = guarded.run_many(
        {
            "spawned": ("test_ddp.py::test_ranks_in_different_collectives",),
            "forked": (
                "test_ddp.py",
                "--deselect",
                "test_ddp.py::test_ranks_in_different_collectives",
            ),
        },
        at_once=2,
        timeout=TIMEOUT_S,
    )
    assert_outcomes(sessions["spawned"].result, hang=1)
    session = sessions["forked"]
    assert_outcomes(session.result, hang=2, passed=1)
    assert_hang(
        sessions["spawned"],
        "test_ranks_in_different_collectives",
        f"HANG after {TIMEOUT_S}.* 2 stuck in rank _rank",
        "*[[]rank 0/2 (gloo) (torch.multiprocessing.spawn)[]]*",
        "*[[]rank 1/2 (gloo) (torch.multiprocessing.spawn)[]]*",
        "hint: ranks wait in different collectives (rank 0/2 in all_reduce, rank 1/2 in barrier)*",
        "*dist.all_reduce(tensor)",
        "*dist.barrier()",
    )
    assert_hang(
        session,
        "test_rendezvous_waits_for_ranks_never_started",
        "hint: 2 rank(s) wait in the process-group rendezvous*and 2 rank(s) were started*",
    )
    assert_hang(
        session,
        "test_one_rank_never_reaches_the_collective",
        "hint: 1 rank(s) wait in barrier for a rank that is not in a collective (rank 1/2 at _late)*",
        "*time.sleep(1000)*",
    )
    for each in sessions.values():
        each.assert_clean()
