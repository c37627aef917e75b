"""Ranks stuck in the same collective with different arguments: the values each rank passed,
read in the rank while it waits, compared in the hint (a reduce with two roots, a barrier on a
subgroup and on the default group), and kept in the JSON report."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

#: Forked ranks start at once (the test module imported torch): a short deadline, wide margin.
FORKED_TIMEOUT_S = 8

#: Ranks launched as PyTorch's MultiProcessTestCase does: plain forked processes on a FileStore.
RANKS = """
import multiprocessing
import tempfile

import torch
import torch.distributed as dist


def _run_ranks(target):
    with tempfile.NamedTemporaryFile(delete=False) as f:
        path = f.name
    ranks = [
        multiprocessing.get_context("fork").Process(target=target, args=(rank, path))
        for rank in range(2)
    ]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()


def _init(rank, path):
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2)


def _reduce_to_own_logger(rank, path):
    _init(rank, path)
    log_rank = rank  # "I log my own metrics"
    dist.reduce(torch.ones(4), dst=log_rank)


def _barrier_on_two_groups(rank, path):
    _init(rank, path)
    pair = dist.new_group([0, 1])
    dist.barrier(group=pair if rank == 0 else None)


def test_reduce_to_each_ranks_own_logger():
    _run_ranks(_reduce_to_own_logger)


def test_barrier_on_a_subgroup_and_the_default_group():
    _run_ranks(_barrier_on_two_groups)


def test_next_test_runs():
    pass
"""


def test_ranks_in_one_collective_are_compared_argument_by_argument(
    guarded: GuardedRunner, tmp_path: Path
) -> None:
    guarded.pytester.makepyfile(test_peer_ranks=RANKS)
    reports = tmp_path / "reports"
    session = guarded.run(f"--torch-hang-report-dir={reports}", timeout=FORKED_TIMEOUT_S)
    assert_outcomes(session.result, hang=2, passed=1)
    assert_hang(
        session,
        "test_reduce_to_each_ranks_own_logger",
        "hint: every rank waits in the same collective, #1 reduce, *"
        " The arguments differ: reduce(dst=0) on rank 0/2 vs reduce(dst=1) on rank 1/2.",
    )
    assert_hang(
        session,
        "test_barrier_on_a_subgroup_and_the_default_group",
        "hint: every rank waits in the same collective, #1 barrier, *"
        " The arguments differ: barrier(group=ProcessGroup(ranks=[[]0, 1[]], name=*)) on rank"
        " 0/2 vs barrier(group=ProcessGroup(default, ranks=[[]0, 1[]], name=*)) on rank 1/2.",
    )
    docs = {
        d["test_id"].rsplit("::", 1)[-1]: d
        for d in (json.loads(p.read_text()) for p in reports.glob("*.json"))
    }
    doc = docs["test_reduce_to_each_ranks_own_logger"]
    assert doc["hints"][0]["rule"] == "collectives"
    ranks = sorted(
        (p for p in doc["processes"] if p.get("group_role")), key=lambda p: p["group_role"]["rank"]
    )
    calls = [next(f for f in p["frame_args"] if f["call"]) for p in ranks]
    assert [(c["function"], c["args"]["dst"]) for c in calls] == [("reduce", "0"), ("reduce", "1")]
    assert [c["args"]["tensor"] for c in calls] == ["Tensor(shape=[4], dtype=float32)"] * 2
    callers = [next(f for f in p["frame_args"] if not f["call"]) for p in ranks]
    assert [(c["function"], c["args"].get("log_rank")) for c in callers] == [
        ("_reduce_to_own_logger", "0"),
        ("_reduce_to_own_logger", "1"),
    ]
    session.assert_clean()
