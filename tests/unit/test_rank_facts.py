"""Ranks known by their process group and the store keys they wait for: the roles' text, the
FileStore reader, the reading of a skipped collective from the source, and the recorded hangs
of ranks started as PyTorch's MultiProcessTestCase starts them (``record.py``)."""

from __future__ import annotations

import linecache
import struct
from pathlib import Path

import pytest

from pytest_torchhang.capture.collectives import filestore_keys
from pytest_torchhang.diagnosis.rules.distributed import _skip_condition
from pytest_torchhang.report.model import SPAWNED, TORCHRUN, Role, StoreWait

from .conftest import RECORDED, Replay


@pytest.mark.parametrize(
    ("role", "text"),
    [
        (Role("rank", rank=1, world=2, backend="gloo"), "rank 1/2 (gloo)"),
        (
            Role("rank", rank=0, world=2, backend="gloo", detail=SPAWNED),
            f"rank 0/2 (gloo) ({SPAWNED})",
        ),
        (
            Role("rank", rank=0, world=2, backend="gloo", detail=TORCHRUN),
            "rank 0/2 (gloo) (torchrun)",
        ),
        (Role("rank", rank=1, world=2, detail=SPAWNED), f"rank 1/2 ({SPAWNED})"),
        (
            Role("DataLoader worker", index=0, count=2, owner="rank 1"),
            "rank 1's DataLoader worker 0/2",
        ),
        (
            Role("DataLoader worker", index=1, count=2, dataset="Shards", owner="rank 0"),
            "rank 0's DataLoader worker 1/2 (dataset Shards)",
        ),
    ],
)
def test_a_rank_and_a_ranks_worker_read_as_text_and_parse_back(role: Role, text: str) -> None:
    assert role.text() == text
    assert Role.parse(text) == role


def test_a_ranks_workers_are_numbered_apart_from_another_ranks() -> None:
    zero = Role("DataLoader worker", index=1, count=2, owner="rank 0").numbered()
    one = Role("DataLoader worker", index=1, count=2, owner="rank 1").numbered()
    assert zero == ("rank 0's DataLoader worker {}/2", 1) and zero[0] != one[0]
    assert Role("DataLoader worker", index=1, count=2, owner="rank 1").general() == (
        "DataLoader worker"
    )


def _record(data: bytes) -> bytes:
    return struct.pack("=I", len(data)) + data


def _filestore(*records: tuple[str, str]) -> bytes:
    """A file in torch's FileStore format: each set appends its key record, then its value's."""
    return b"".join(_record(k.encode()) + _record(v.encode()) for k, v in records)


def test_a_filestores_keys_are_read_from_its_file(tmp_path: Path) -> None:
    path = tmp_path / "store"
    path.write_bytes(
        _filestore(
            ("refcount/", "2"),  # the store's own count of users
            ("/ready_1", "1"),
            ("/0//cpu//0/0", "addr"),
            ("/ready_0", "1"),
            ("/gone", "x"),
            ("-/gone", ""),  # delete_key
            ("/ready_1", "2"),  # set again: keeps its place
        )
        + struct.pack("=I", 40)  # a record still being written
    )
    assert filestore_keys(str(path)) == ["ready_1", "0//cpu//0/0", "ready_0"]
    assert "could not be read" in str(filestore_keys(str(tmp_path / "missing")))


def test_a_store_wait_is_missing_the_keys_the_store_does_not_hold() -> None:
    wait = StoreWait("0x1", "wait", keys=["a", "b"], store="FileStore", keys_set=["a", "c"])
    assert wait.missing() == ["b"] and wait.call() == "store.wait(['a', 'b'])"
    assert StoreWait("0x1", "get", keys=["b"], keys_set=None).missing() == []  # not known
    prefixed = StoreWait("0x1", "get", keys=["b"], prefixed=True, keys_set=["run/b"])
    assert prefixed.missing() == [] and prefixed.call() == "store.get('b')"


SOURCE = """\
def step(rank):
    reduce()
    if rank == 0:
        metric()
    barrier()


def branches(rank):
    if rank == 0:
        first()
    elif rank == 1:
        second()
    else:
        third()
    done()


def nested(rank):
    for batch in range(2):
        if rank == 0:
            with lock:
                metric()
        barrier()


def unconditional(rank):
    metric()
    barrier()


def inside(rank):
    if rank == 0:
        metric()
        barrier()
"""


@pytest.mark.parametrize(
    ("called", "passed", "condition"),
    [
        (4, 5, "if rank == 0:"),  # skipped the call under the if, at the barrier after it
        (10, 12, ""),  # another branch of the same if: a mismatch, not a skip
        (12, 14, ""),
        (10, 15, "if rank == 0:"),  # past the whole chain
        (12, 15, "elif rank == 1:"),
        (22, 23, "if rank == 0:"),  # under a with, under an if
        (27, 28, ""),  # nothing conditional about the call
        (32, 33, ""),  # under the same if
        (5, 4, ""),  # not further on
    ],
)
def test_a_rank_further_on_than_a_conditional_collective_skipped_it(
    called: int, passed: int, condition: str
) -> None:
    name = "<test_rank_facts SOURCE>"
    linecache.cache[name] = (len(SOURCE), None, SOURCE.splitlines(True), name)
    try:
        assert _skip_condition(name, called, passed) == condition
    finally:
        del linecache.cache[name]


def _recorded(name: str, replay: Replay) -> tuple[list[dict[str, object]], list[str]]:
    paths = [p for p in RECORDED if p.stem == name]
    if not paths:
        pytest.skip(f"{name} is not recorded yet: run tests/unit/record.py")
    report = replay.load(paths[0])
    hints = replay.hints(report)
    return [{"rule": h.rule, "text": h.text, "pids": h.pids} for h in hints], [
        p.role for p in replay.diagnosed(report)
    ]


def test_multiprocess_testcase_ranks_are_named_by_their_group_in_the_recordings(
    replay: Replay,
) -> None:
    names = [p.stem for p in RECORDED if p.stem.startswith("test_distributed_plain_process")]
    assert len(names) == 7, names
    for name in names:
        report = replay.load(next(p for p in RECORDED if p.stem == name))
        ranks = sorted(
            (p for p in report.processes if p.group_role is not None),
            key=lambda p: p.group_role.rank or 0,  # type: ignore[union-attr]
        )
        assert [p.group_role for p in ranks] == [
            Role("rank", rank=r, world=2, backend="gloo") for r in (0, 1)
        ]
        assert [p.role for p in ranks] == ["rank 0/2 (gloo)", "rank 1/2 (gloo)"]


def test_a_store_get_of_a_key_nobody_sets_names_the_key_the_keys_set_and_the_other_rank(
    replay: Replay,
) -> None:
    name = "test_distributed_plain_process_ranks_wait_for_a_store_key_nobody_sets"
    hints, _ = _recorded(name, replay)
    texts = [str(h["text"]) for h in hints if h["rule"] == "store_key"]
    assert len(texts) == 2, hints
    zero = next(t for t in texts if t.startswith("rank 0/2 waits in store.get('ready_2')"))
    assert "no process set 'ready_2'; keys set: 'ready_0', 'ready_1'" in zero
    assert "Meanwhile rank 1/2 waits in store.get('ready_3')." in zero  # not "too": another key
    report = replay.load(next(p for p in RECORDED if p.stem == name))
    waits = {w.keys[0]: w for p in report.processes for w in p.store_waits}
    assert sorted(waits) == ["ready_2", "ready_3"]
    assert all(w.store == "FileStore" and w.path and w.method == "get" for w in waits.values())
    assert all({"ready_0", "ready_1"} <= set(w.keys_set or []) for w in waits.values())


def test_a_skipped_all_reduce_is_told_apart_from_two_branches(replay: Replay) -> None:
    skipped, _ = _recorded("test_distributed_plain_process_ranks_one_skips_an_all_reduce", replay)
    assert skipped[0]["rule"] == "collectives"
    assert "rank 1/2 went past the all_reduce at test_corpus_distributed.py:" in str(
        skipped[0]["text"]
    )
    branches, _ = _recorded("test_distributed_plain_process_ranks_in_different_collectives", replay)
    assert branches[0]["rule"] == "collectives"
    assert "went past" not in str(branches[0]["text"])
    assert "rank 0/2 in all_reduce, rank 1/2 in broadcast" in str(branches[0]["text"])
