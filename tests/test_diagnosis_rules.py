"""Hints driven by real hangs of their kind: OpenMP after fork, busy processes, a rank gone early.

The sessions of the last four tests mostly wait (for a deadline, for ranks or children that
import torch): they run in one batch (``sessions``), two at a time, paired so that the spinning
child of one never runs beside the torch imports of the 20 s rank; the OpenMP session, whose
busy child must be seen spinning in a 0.1 s sample, runs alone.
"""

from __future__ import annotations

import pytest

from conftest import GuardedRunner, Session, assert_hang, batch_runner
from outcomes import assert_outcomes

OPENMP_AND_BUSY = """
import multiprocessing as mp

import torch


def child_op():
    x = torch.randn(512, 512)
    y = x @ x
    return y.sum()


def test_op_in_a_fork_after_the_parent_ran_ops():
    a = torch.randn(1024, 1024)
    (a @ a).sum()  # starts the parent's OpenMP thread pool
    child = mp.get_context("fork").Process(target=child_op)
    child.start()
    child.join()


def spin():
    while True:
        pass


def test_child_spins():
    child = mp.get_context("fork").Process(target=spin)
    child.start()
    child.join()
"""


def test_openmp_after_fork_and_busy_children_get_their_hints(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_rules=OPENMP_AND_BUSY)
    # torch is imported at collection: both children are forked and stuck within 0.1 s
    session = guarded.run(timeout=2)
    assert_outcomes(session.result, hang=2)
    assert_hang(
        session,
        "test_op_in_a_fork_after_the_parent_ran_ops",
        "hint: 1 forked process(es) are stuck (blocked or spinning) in a C call*OpenMP after fork*torch.set_num_threads(1)*",
        "*based on: multiprocessing.Process(target=child_op) (pid *), forked from pid *: y = x @ x; "
        "its 1 thread(s): futex",
    )
    busy = assert_hang(
        session,
        "test_child_spins",
        "hint: 1 process(es) used CPU during the capture: they are computing or spinning, not waiting*",
        "*based on: multiprocessing.Process(target=spin) (pid *) +*s CPU at spin",
    )
    assert "OpenMP" not in busy
    session.assert_clean()


RANK_LEAVES = """
import pytest
import torch
import torch.distributed as dist


def rank_one_leaves_early(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    return rank


def test_a_rank_returning_early_is_named_when_its_peer_fails(torch_hang):
    with pytest.raises(RuntimeError) as info:
        torch_hang.distributed(rank_one_leaves_early, world_size=2, timeout=20)
    notes = "\\n".join(info.value.__notes__)
    assert "rank 0/2 (gloo) failed first; the other ranks:" in notes
    assert "rank 1/2 (gloo): returned 1" in notes
    assert "a rank that returns (or dies) while its peers are still in a collective" in notes
"""


def test_with_gloo_a_rank_that_leaves_early_is_named_in_its_peers_error(
    sessions: dict[str, Session],
) -> None:
    # gloo turns "a rank left while its peers wait" into a connection error on the peers, not
    # a hang (the hang form needs nccl): the error says which rank left and how
    session = sessions["rank_leaves"]
    assert_outcomes(session.result, passed=1)
    session.assert_clean()


RANK_GONE_HANG = '''
import os
import subprocess
import sys

RANK = """
import os, subprocess, sys
import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
if rank == 1:
    # leaks its gloo sockets into a helper that outlives it, then leaves: rank 0 never notices
    subprocess.Popen(["sleep", "1000"], close_fds=False, env={})
    os._exit(0)
dist.all_reduce(torch.ones(1))
"""


def test_torchrun_style_rank_leaves_while_its_peer_waits(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "WORLD_SIZE": "2"}
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(tmp_path / "store")], env={**env, "RANK": str(r)})
        for r in range(2)
    ]
    for rank in ranks:
        rank.wait()
'''


def test_a_rank_gone_while_its_peer_waits_in_a_collective_is_named(
    sessions: dict[str, Session],
) -> None:
    # ranks launched torchrun-style (RANK/WORLD_SIZE in their environment)
    session = sessions["rank_gone"]
    assert_outcomes(session.result, hang=1)
    assert_hang(
        session,
        "test_torchrun_style_rank_leaves_while_its_peer_waits",
        "hint: rank(s) 1 of 2 are no longer running*while rank 0/2 waits in all_reduce*",
        "*[[]rank 0/2 (gloo)[]]*",  # its process group says so
        "*dist.all_reduce(torch.ones(1))*",
    )
    session.assert_clean()


STILL_STARTING = """
import multiprocessing as mp
import os

import torch

if os.environ.get("STILL_STARTING_CHILD"):
    # in the spawned child, importing this module computes for longer than any deadline (as
    # an import that builds a large table): it is importing, and moving, at the deadline on
    # any machine. (Not mp.parent_process(): a spawned child sets it only after it has
    # imported its target.) One blocked in its import is not "still starting": see
    # tests/test_startup_hangs.py.
    while True:
        sum(range(10_000))


def work():
    return torch.ones(1)


def test_deadline_shorter_than_a_spawned_childs_start():
    os.environ["STILL_STARTING_CHILD"] = "1"  # this module is imported here already
    child = mp.get_context("spawn").Process(target=work)
    child.start()  # the child imports this module, hence torch, before it runs anything
    child.join()
"""


def test_children_still_importing_at_the_deadline_get_their_hint(
    sessions: dict[str, Session],
) -> None:
    session = sessions["still_starting"]
    assert_outcomes(session.result, hang=1)
    assert_hang(
        session,
        "test_deadline_shorter_than_a_spawned_childs_start",
        "hint: 1 process(es) are still starting up, importing modules*the deadline may be shorter*",
        "*[[]multiprocessing child (still starting: importing)[]]*",
    )
    session.assert_clean()


PLUGIN_FRAMES = """
import threading

import pytest

from pytest_torchhang import HangError
from pytest_torchhang.report.text import to_text


def wait_for_ever():
    threading.Event().wait()


def test_a_child_hangs(torch_hang):
    with pytest.raises(HangError) as caught:
        torch_hang.run(wait_for_ever, timeout=2)
    print(to_text(caught.value.report))
"""


def test_the_plugins_own_frames_are_cut_in_children(sessions: dict[str, Session]) -> None:
    # as pytest's own frames are cut in the pytest process: the child's stack ends at the
    # user's function, not in the zygote, child.py or runpy
    session = sessions["frames"]
    assert_outcomes(session.result, passed=1)
    out = session.result.stdout.str()
    child = out[out.index("[torch_hang.run(wait_for_ever) child]") :]
    assert "in wait_for_ever\n" in child and "threading.Event().wait()" in child
    assert "... pytest-torchhang's own frames cut" in child
    for internal in ("zygote.py", "pytest_torchhang/child.py", "runpy.py"):
        assert internal not in child
    assert "hint: torch_hang.run(wait_for_ever) child (pid " in out
    assert "waits in Event.wait() at test_frames.py:" in out
    session.assert_clean()


@pytest.fixture(scope="module")
def sessions(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Session]:
    """The sessions of the batched tests, by name."""
    with batch_runner(request, tmp_path_factory) as guarded:
        guarded.pytester.makepyfile(
            test_rank=RANK_LEAVES,
            test_rank_gone=RANK_GONE_HANG,
            test_starting=STILL_STARTING,
            test_frames=PLUGIN_FRAMES,
        )
        # two fresh interpreters import torch first: 20 s; beside it, the zygote's child
        sessions = guarded.run_many(
            {
                "rank_gone": ("test_rank_gone.py", "--torch-hang-timeout=20"),
                "frames": ("test_frames.py", "-s", "--torch-hang-timeout=60"),
            },
            at_once=2,
            timeout=None,
        )
        # The still-starting child's import never ends, so a longer deadline changes nothing
        # but this: on a busy machine a fresh interpreter may take seconds to reach that import
        # (with 2 s it was still in the interpreter's own start, where no Python frame shows).
        sessions |= guarded.run_many(
            {
                "still_starting": ("test_starting.py", "--torch-hang-timeout=8"),
                "rank_leaves": ("test_rank.py", "--torch-hang-timeout=30"),
            },
            at_once=2,
            timeout=None,
        )
        return sessions
