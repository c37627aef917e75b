"""Ranks known by their process group, whoever started them: PyTorch's MultiProcessTestCase
launch (plain multiprocessing.Process ranks meeting through a FileStore, no RANK variable, no
torch.multiprocessing.spawn), with a skipped collective, a collective mismatch and a store key
nobody sets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

#: The spawned ranks import torch first (seconds each, two at a time on a busy machine).
SPAWNED_TIMEOUT_S = 25
#: Forked ranks start at once (the test module imported torch): a short deadline, wide margin.
FORKED_TIMEOUT_S = 8
#: torch's harness spawns its ranks, which import torch's test utilities first (seconds more).
REAL_HARNESS_TIMEOUT_S = 60

#: ``torch.testing._internal.common_distributed.MultiProcessTestCase`` needs ``expecttest``
#: (not a dependency here), so its launch is written out as it does it: each rank a
#: ``multiprocessing.Process(target=cls._run)``, the test method run in the rank, the parent
#: polling the ranks' exit codes.
RANKS = f"""
import multiprocessing
import tempfile
import time
import unittest

import pytest
import torch
import torch.distributed as c10d

WORLD_SIZE = 2


class RankedTestCase(unittest.TestCase):
    MAIN_PROCESS_RANK = -1
    start_method = "spawn"

    def __init__(self, methodName="runTest"):
        super().__init__(methodName)
        fn = getattr(self, methodName, None)
        if fn is None:  # unittest's instance without a test (pytest's collection makes one)
            return

        def join_or_run():
            if self.rank == self.MAIN_PROCESS_RANK:
                self._join_processes()
            else:
                fn()

        setattr(self, methodName, join_or_run)

    def setUp(self):
        self.rank = self.MAIN_PROCESS_RANK
        with tempfile.NamedTemporaryFile(delete=False) as f:
            self.file_name = f.name
        ctx = multiprocessing.get_context(self.start_method)
        self.processes = [
            ctx.Process(
                target=type(self)._run,
                name=f"process {{rank}}",
                args=(rank, self._testMethodName, self.file_name),
            )
            for rank in range(WORLD_SIZE)
        ]
        for process in self.processes:
            process.start()

    @classmethod
    def _run(cls, rank, test_name, file_name):
        self = cls(test_name)
        self.rank, self.file_name = rank, file_name
        getattr(self, test_name)()

    def _join_processes(self):
        while any(p.exitcode is None for p in self.processes):
            time.sleep(0.1)

    def tearDown(self):
        for process in self.processes:
            process.terminate()

    def init_pg(self):
        store = c10d.FileStore(self.file_name, WORLD_SIZE)
        c10d.init_process_group("gloo", store=store, rank=self.rank, world_size=WORLD_SIZE)
        return store


class TestSpawnedRanks(RankedTestCase):
    pytestmark = pytest.mark.torch_hang(timeout={SPAWNED_TIMEOUT_S})

    def test_a_rank_skips_an_all_reduce(self):
        self.init_pg()
        tensor = torch.ones(4)
        c10d.all_reduce(tensor)
        if self.rank == 0:
            c10d.all_reduce(tensor)  # metrics, reduced on rank 0 only
        c10d.barrier()


class TestForkedRanks(RankedTestCase):
    start_method = "fork"

    def test_ranks_in_different_collectives(self):
        self.init_pg()
        tensor = torch.ones(4)
        c10d.all_reduce(tensor)
        if self.rank == 0:
            c10d.all_reduce(tensor)
        else:
            c10d.broadcast(tensor, src=1)

    def test_a_store_get_of_a_key_nobody_sets(self):
        store = self.init_pg()
        store.set(f"ready_{{self.rank}}", "1")
        store.get(f"ready_{{WORLD_SIZE}}")  # off by one: the ranks are 0 and 1


def test_next_test_runs():
    pass
"""


def _docs(reports: Path) -> dict[str, dict[str, Any]]:
    return {
        d["test_id"].rsplit("::", 1)[-1]: d
        for d in (json.loads(p.read_text()) for p in reports.glob("*.json"))
    }


def _ranks(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(
        (p for p in doc["processes"] if p.get("group_role")), key=lambda p: p["group_role"]["rank"]
    )


def test_multiprocess_testcase_ranks_are_named_by_their_process_group(
    guarded: GuardedRunner, tmp_path: Path
) -> None:
    guarded.pytester.makepyfile(test_mptc_ranks=RANKS)
    reports = tmp_path / "reports"
    session = guarded.run(f"--torch-hang-report-dir={reports}", timeout=FORKED_TIMEOUT_S)
    assert_outcomes(session.result, hang=3, passed=1)
    assert_hang(
        session,
        "TestSpawnedRanks.test_a_rank_skips_an_all_reduce",
        "*[[]rank 0/2 (gloo)[]]*",
        "*[[]rank 1/2 (gloo)[]]*",
        "hint: ranks wait in different collectives (rank 0/2 in all_reduce, rank 1/2 in barrier):"
        " rank 1/2 went past the all_reduce at test_mptc_ranks.py:* (under `if self.rank == 0:`)"
        " that rank 0/2 waits in as #2, and is at #2 barrier at line *: it skipped that"
        " all_reduce.*",
    )
    assert_hang(
        session,
        "TestForkedRanks.test_ranks_in_different_collectives",
        "*[[]rank 0/2 (gloo)[]]*",
        "*[[]rank 1/2 (gloo)[]]*",
        "hint: ranks wait in different collectives (rank 0/2 in all_reduce, rank 1/2 in "
        "broadcast): every rank must call the same collectives in the same order;*Flight "
        "recorder: rank 0/2 completed #1 all_reduce([[]4[]]) and is in #2 all_reduce([[]4[]]);"
        " rank 1/2 completed #1 all_reduce([[]4[]]) and is in #2 broadcast([[]4[]]).",
    )
    text = assert_hang(
        session,
        "TestForkedRanks.test_a_store_get_of_a_key_nobody_sets",
        "*[[]rank 0/2 (gloo)[]]*",
        "hint: rank 0/2 and rank 1/2 wait in store.get('ready_2') on FileStore *: no process set"
        " 'ready_2'; keys set: 'ready_0', 'ready_1' (and * of the process groups' own); the "
        "closest names set: *'ready_1'*",
        '*store.get(f"ready_{WORLD_SIZE}")*',
    )
    assert "inject/ranks.py" not in text  # the wrapper that records the key is not shown
    # the branches of one `if` are a mismatch, not a skip
    assert "went past" not in session.report_of(
        "TestForkedRanks.test_ranks_in_different_collectives"
    )
    docs = _docs(reports)
    for name, rule in [
        ("test_a_rank_skips_an_all_reduce", "collectives"),
        ("test_ranks_in_different_collectives", "collectives"),
        ("test_a_store_get_of_a_key_nobody_sets", "store_key"),
    ]:
        doc = docs[name]
        assert doc["hints"][0]["rule"] == rule, doc["hints"]
        ranks = _ranks(doc)
        assert [
            (p["group_role"]["rank"], p["group_role"]["world"], p["group_role"]["backend"])
            for p in ranks
        ] == [(0, 2, "gloo"), (1, 2, "gloo")]
        assert [p["role_facts"]["kind"] for p in ranks] == ["rank", "rank"]
        assert sorted(doc["hints"][0]["pids"]) == sorted(p["pid"] for p in ranks)
    for rank in _ranks(docs["test_a_store_get_of_a_key_nobody_sets"]):
        (wait,) = rank["store_waits"]
        assert (wait["method"], wait["keys"], wait["store"]) == ("get", ["ready_2"], "FileStore")
        assert {"ready_0", "ready_1"} <= set(wait["keys_set"])
        assert "ready_2" not in wait["keys_set"]
    session.assert_clean()


#: PyTorch's own harness, where it can be imported (its module needs ``expecttest``).
REAL_HARNESS = f"""
import pytest
import torch
import torch.distributed as c10d
from torch.testing._internal.common_distributed import MultiProcessTestCase


class TestRealHarness(MultiProcessTestCase):
    pytestmark = pytest.mark.torch_hang(timeout={REAL_HARNESS_TIMEOUT_S})

    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_a_store_get_of_a_key_nobody_sets(self):
        store = c10d.FileStore(self.file_name, self.world_size)
        c10d.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        store.set(f"ready_{{self.rank}}", "1")
        store.get(f"ready_{{self.world_size}}")
"""


def test_pytorchs_own_multiprocess_testcase_ranks_are_ranks(guarded: GuardedRunner) -> None:
    pytest.importorskip("expecttest", reason="torch's MultiProcessTestCase needs expecttest")
    guarded.pytester.makepyfile(test_real_harness=REAL_HARNESS)
    session = guarded.run(timeout=None)
    assert_outcomes(session.result, hang=1)
    assert_hang(
        session,
        "TestRealHarness.test_a_store_get_of_a_key_nobody_sets",
        "*[[]rank 0/2 (gloo)[]]*",
        "*[[]rank 1/2 (gloo)[]]*",
        "hint: rank 0/2 and rank 1/2 wait in store.get('ready_2') on FileStore *: no process set"
        " 'ready_2'; keys set: 'ready_0', 'ready_1'*",
    )
    session.assert_clean()
