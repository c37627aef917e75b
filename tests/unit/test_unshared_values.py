"""A store key named from a value each rank made itself: a part of the key one rank waits for,
matched against the locals the other ranks' own frames held at the capture (issue 28, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_torchhang.diagnosis.rules.stores import _text_value, key_from_unshared_value
from pytest_torchhang.report.model import Frame, FrameArgs, ProcessReport, Role, ThreadStack


def _rank(pid: int, rank: int, /, **user_locals: str) -> ProcessReport:
    """A rank in a barrier whose user's frame held ``user_locals`` (as bounded reprs)."""
    proc = ProcessReport(pid, 1, f"rank {rank}/2 (gloo)", "python", "S", 0, 0, 0, 1, 0, "ok")
    proc.role_facts = Role("rank", rank=rank, world=2, backend="gloo")
    proc.frame_args = [
        FrameArgs("0x1", "barrier", "/x/torch/distributed/distributed_c10d.py", 10, {}, True),
        FrameArgs("0x1", "rank_main", "/t/test_x.py", 45, user_locals, False),
    ]
    return proc


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        ("'20261203-105334-5b7a90'", "20261203-105334-5b7a90"),
        ('"vm-12573"', "vm-12573"),
        ("3", None),
        ("None", None),
        ("Tensor(shape=[8], dtype=float32)", None),
        ("'abc", None),
        ("b'abc'", None),  # bytes: never a key's text
    ],
)
def test_only_a_str_literal_is_a_value_a_key_can_be_made_of(raw: str, text: str | None) -> None:
    assert _text_value(raw) == text


#: The waiting rank's function: the key is made from ``run_id``, ``run_name`` and ``name``.
WAITER_SOURCE = """\
def share(store, rank, run_id, run_name, name):
    key = f"runs/{run_id or run_name or name}/vocab"
    return store.get(key)
"""


def _waiter(tmp_path: Path) -> ProcessReport:
    """Rank 1, waiting in ``store.get`` at line 3 of a file of WAITER_SOURCE."""
    source = tmp_path / "test_share.py"
    source.write_text(WAITER_SOURCE)
    proc = ProcessReport(8, 1, "rank 1/2 (gloo)", "python", "S", 0, 0, 0, 1, 0, "ok")
    proc.role_facts = Role("rank", rank=1, world=2, backend="gloo")
    frame = Frame(str(source), 3, "share", "return store.get(key)")
    proc.threads = [ThreadStack("0x1", current=True, frames=[frame])]
    return proc


@pytest.mark.parametrize(
    ("key", "peer_locals", "found"),
    [
        # a run id made on each rank: a timestamp and another random suffix
        (
            "runs/20261203-105334-1a80cd/vocab",
            {"run_id": "'20261203-105334-5b7a90'"},
            ("20261203-105334-1a80cd", "run_id"),
        ),
        # a host and pid: the same host, another pid
        ("runs/vm-12575/config", {"run_name": "'vm-12573'"}, ("vm-12575", "run_name")),
        # the same value on both ranks: the key is shared, nothing differs
        ("runs/vm-12573/config", {"run_name": "'vm-12573'"}, None),
        # a value of another making (another length): no claim
        ("runs/vm-12575/config", {"name": "'vm-125751'"}, None),
        # unlike values of the same length: no claim
        ("runs/abcdefgh/config", {"name": "'12345678'"}, None),
        # short parts say nothing (ranks, indices)
        ("ready_2", {"name": "'ready'"}, None),
        # the variable the key is made from holds another value on the peer: said, whatever
        # the reason (made per rank, or an off-by-one): the waiter's key is not the peer's
        ("ready_2", {"name": "'ready_3'"}, ("ready_2", "name")),
        # a local the waiter's function does not use: not what the key was made from
        ("runs/vm-12575/config", {"host": "'vm-12573'"}, None),
        ("step/7/done", {"step": "'8'"}, None),
        # values that are not text
        ("runs/vm-12575/config", {"n": "12573", "t": "Tensor(shape=[8], dtype=float32)"}, None),
    ],
)
def test_a_key_part_a_peer_made_differently_is_named(
    key: str, peer_locals: dict[str, str], found: tuple[str, str] | None, tmp_path: Path
) -> None:
    peer = _rank(7, 0, **peer_locals)
    got = key_from_unshared_value([key], _waiter(tmp_path), [peer])
    assert (None if got is None else (got.part, got.name)) == found
    if got is not None:
        words = got.words()
        assert f"its part {got.part!r} differs from rank 0/2's `{got.name}`" in words
        assert "test_x.py:45" in words and "passed to every rank" in words


def test_the_stuck_call_s_own_arguments_are_not_a_rank_s_value(tmp_path: Path) -> None:
    peer = _rank(7, 0)
    peer.frame_args[0].args = {"name": "'vm-12573'"}  # the call's frame, not the user's
    assert key_from_unshared_value(["runs/vm-12575/config"], _waiter(tmp_path), [peer]) is None
