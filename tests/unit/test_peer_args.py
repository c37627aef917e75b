"""Peers compared argument by argument: the child's bounded text of a value (which never runs the
user's code), its choice of a stuck call's frame, and the comparison of peers in one call."""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest

from pytest_torchhang.diagnosis.peers import PeerDifference, differences, lone_root
from pytest_torchhang.diagnosis.rules.distributed import with_peer_difference
from pytest_torchhang.diagnosis.rules.p2p import p2p_arguments
from pytest_torchhang.inject.peerargs import (
    MAX_CHARS,
    MAX_ITEMS,
    bounded_repr,
    stuck_frames,
    thread_frames,
)
from pytest_torchhang.report.model import (
    Collective,
    FrameArgs,
    HangReport,
    Hint,
    ProcessReport,
    Role,
)


class Hostile:
    """Every hook a careless repr would call raises; a test fails if any of them runs."""

    calls: ClassVar[list[str]] = []

    def __repr__(self) -> str:
        Hostile.calls.append("__repr__")
        raise AssertionError("__repr__ ran")

    __str__ = __repr__

    def __getattr__(self, name: str) -> Any:
        Hostile.calls.append(f"__getattr__ {name}")
        raise AssertionError(f"__getattr__({name!r}) ran")

    def __getattribute__(self, name: str) -> Any:
        Hostile.calls.append(f"__getattribute__ {name}")
        raise AssertionError(f"__getattribute__({name!r}) ran")

    def __eq__(self, other: object) -> bool:
        Hostile.calls.append("__eq__")
        raise AssertionError("__eq__ ran")

    def __hash__(self) -> int:
        Hostile.calls.append("__hash__")
        raise AssertionError("__hash__ ran")

    def __len__(self) -> int:
        Hostile.calls.append("__len__")
        raise AssertionError("__len__ ran")


class Looping:
    def __repr__(self) -> str:  # would never return
        while True:
            pass


class LoudMeta(type):
    """A metaclass whose attributes (the class's name, module), equality and hash would run user
    code if asked."""

    def __getattribute__(cls, name: str) -> Any:
        raise AssertionError(f"the metaclass's __getattribute__({name!r}) ran")

    def __eq__(cls, other: object) -> bool:
        raise AssertionError("the metaclass's __eq__ ran")

    def __hash__(cls) -> int:
        raise AssertionError("the metaclass's __hash__ ran")


class Shady(metaclass=LoudMeta):
    pass


class MyInt(int):
    def __repr__(self) -> str:
        raise AssertionError("an int subclass's __repr__ ran")


class MyList(list[int]):
    def __repr__(self) -> str:
        raise AssertionError("a list subclass's __repr__ ran")


_LONG = "x" * (MAX_CHARS + 10)
_NESTED: list[Any] = [[[1]]]
_SELF: list[Any] = []
_SELF.append(_SELF)


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (lambda: 0, "0"),
        (lambda: -3, "-3"),
        (lambda: True, "True"),
        (lambda: None, "None"),
        (lambda: 1.5, "1.5"),
        (lambda: "dst", "'dst'"),
        (lambda: _LONG, repr("x" * MAX_CHARS) + "...+10"),
        (lambda: b"ab", "b'ab'"),
        (lambda: (1,), "(1,)"),
        (lambda: (1, "a"), "(1, 'a')"),
        (lambda: [0, 1], "[0, 1]"),
        (lambda: {"dst": 1}, "{'dst': 1}"),
        (lambda: list(range(MAX_ITEMS + 3)), "[0, 1, 2, 3, 4, 5, ...+3]"),
        (
            lambda: dict.fromkeys(range(10**6), 0),
            "{0: 0, 1: 0, 2: 0, 3: 0, 4: 0, 5: 0, ...+999994}",
        ),
        (lambda: _NESTED, "[[list(len=1)]]"),
        (lambda: _SELF, "[[list(len=1)]]"),  # a list that holds itself: bounded by depth
        (lambda: Hostile(), f"{__name__}.Hostile"),
        (lambda: [Hostile()], f"[{__name__}.Hostile]"),
        (lambda: {1: Hostile()}, f"{{1: {__name__}.Hostile}}"),
        (lambda: Looping(), f"{__name__}.Looping"),
        (
            lambda: Shady(),
            f"{__name__}.Shady",
        ),  # the type's own slots, never the metaclass's lookup
        (lambda: MyInt(3), f"{__name__}.MyInt"),
        (lambda: MyList([1]), f"{__name__}.MyList"),
        (lambda: threading.Event(), "threading.Event"),
    ],
)
def test_a_value_is_said_in_bounded_text_without_running_its_code(
    make: Callable[[], object], text: str
) -> None:
    value = make()  # made here: pytest's parametrize ids would touch a hostile value
    Hostile.calls.clear()
    assert bounded_repr(value) == text
    assert Hostile.calls == []


def _fake_distributed(tmp_path: Path) -> ModuleType:
    """A module whose file lies under ``torch/distributed/`` (as torch's wrapper does), loaded by
    path: its frames are real frames of that file, and no torch is imported."""
    folder = tmp_path / "torch" / "distributed"
    folder.mkdir(parents=True)
    path = folder / "distributed_c10d.py"
    path.write_text(
        "def reduce(tensor, dst, op='SUM', group=None, async_op=False):\n"
        "    return _wait(tensor)\n"
        "\n"
        "def _wait(tensor):\n"
        "    tensor['release'].wait()\n"
    )
    spec = importlib.util.spec_from_file_location("fake_c10d", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stuck_calls_frame_and_its_callers_locals_are_read_from_another_thread(
    tmp_path: Path,
) -> None:
    c10d = _fake_distributed(tmp_path)
    release = threading.Event()
    entered = threading.Event()

    def train_step(log_rank: int) -> None:
        step = 7
        hostile = Hostile()  # said by its type only, so left out of the locals
        entered.set()
        c10d.reduce({"release": release}, dst=log_rank)
        del step, hostile

    worker = threading.Thread(target=train_step, args=(1,))
    worker.start()
    try:
        assert entered.wait(10)
        import sys
        import time

        deadline = time.monotonic() + 10
        while True:  # until the thread is inside the wait (past ``entered.set()``)
            rows = thread_frames(sys._current_frames()[worker.ident or 0])
            if rows or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        Hostile.calls.clear()
        rows = thread_frames(sys._current_frames()[worker.ident or 0])
        listed = stuck_frames()
    finally:
        release.set()
        worker.join(10)
    assert Hostile.calls == []
    call, user = rows
    assert (call["function"], call["call"]) == ("reduce", True)  # the outermost frame in the file
    assert call["args"] == {
        "tensor": "{'release': threading.Event}",
        "dst": "1",
        "op": "'SUM'",
        "group": "None",
        "async_op": "False",
    }
    assert (user["function"], user["call"]) == ("train_step", False)
    assert user["args"] == {"log_rank": "1", "step": "7"}
    assert [r["function"] for r in listed if r["thread"] == hex(worker.ident or 0)] == [
        "reduce",
        "train_step",
    ]


def test_the_call_is_the_collective_not_a_torch_distributed_wrapper_above_it(
    tmp_path: Path,
) -> None:
    c10d = _fake_distributed(tmp_path)
    wrapper = tmp_path / "torch" / "distributed" / "fsdp"
    wrapper.mkdir()
    (wrapper / "wrap.py").write_text(
        "def forward(c10d, batch, tensor):\n    return c10d.reduce(tensor, dst=0)\n"
    )
    spec = importlib.util.spec_from_file_location("fake_fsdp", wrapper / "wrap.py")
    assert spec is not None and spec.loader is not None
    fsdp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fsdp)
    release = threading.Event()
    worker = threading.Thread(target=fsdp.forward, args=(c10d, [1, 2], {"release": release}))
    worker.start()
    try:
        import sys
        import time

        deadline = time.monotonic() + 10
        rows: list[dict[str, Any]] = []
        while not rows and time.monotonic() < deadline:
            rows = thread_frames(sys._current_frames()[worker.ident or 0])
            time.sleep(0.01)
    finally:
        release.set()
        worker.join(10)
    assert [(r["function"], r["call"]) for r in rows] == [("reduce", True)]  # no user frame
    assert rows[0]["args"]["dst"] == "0"


def _rank(pid: int, rank: int, /, **args: str) -> ProcessReport:
    proc = ProcessReport(pid, 1, f"rank {rank}/2 (gloo)", "python", "S", 0, 0, 0, 1, 0, "ok")
    proc.role_facts = Role("rank", rank=rank, world=2, backend="gloo")
    proc.frame_args = [
        FrameArgs("0x1", "reduce", "/x/torch/distributed/distributed_c10d.py", 10, args, True),
        FrameArgs("0x1", "rank_main", "/t/test_x.py", 5, {"rank": str(rank)}, False),
    ]
    return proc


_C10D = "/x/torch/distributed/distributed_c10d.py"


@pytest.mark.parametrize(
    ("ranks", "found"),
    [
        (  # a rooted collective with two roots
            [_rank(10, 0, tensor="T", dst="0"), _rank(11, 1, tensor="T", dst="1")],
            [PeerDifference("reduce", "dst", {10: "0", 11: "1"})],
        ),
        (  # torch's group_dst, set from dst inside the call, says dst again
            [
                _rank(10, 0, tensor="T", dst="0", group_dst="0"),
                _rank(11, 1, tensor="T", dst="1", group_dst="1"),
            ],
            [PeerDifference("reduce", "dst", {10: "0", 11: "1"})],
        ),
        (  # the same arguments: nothing to say
            [_rank(10, 0, tensor="T", dst="0"), _rank(11, 1, tensor="T", dst="0")],
            [],
        ),
        (  # a gather's list is the root's only: not a difference
            [
                _rank(10, 0, tensor="T", gather_list="[T, T]", dst="0"),
                _rank(11, 1, tensor="T", gather_list="None", dst="0"),
            ],
            [],
        ),
        (  # group=None and the default group passed by name are one group
            [
                _rank(10, 0, group="None"),
                _rank(11, 1, group="ProcessGroup(default, ranks=[0, 1], name='0')"),
            ],
            [],
        ),
        (  # a rendezvous: each rank names itself
            [_rank(10, 0, rank="0", world_size="2"), _rank(11, 1, rank="1", world_size="2")],
            [],
        ),
        (  # each rank's own object to gather
            [_rank(10, 0, obj="{'loss': 0.5}"), _rank(11, 1, obj="{'loss': 1.5}")],
            [],
        ),
        (  # one process alone in its call has no peer
            [_rank(10, 0, dst="0")],
            [],
        ),
        (  # tensors of different shapes, and the group
            [
                _rank(10, 0, tensor="Tensor(shape=[8], dtype=float32)", group="None"),
                _rank(11, 1, tensor="Tensor(shape=[16], dtype=float32)", group="ProcessGroup"),
            ],
            [
                PeerDifference(
                    "reduce",
                    "tensor",
                    {
                        10: "Tensor(shape=[8], dtype=float32)",
                        11: "Tensor(shape=[16], dtype=float32)",
                    },
                ),
                PeerDifference("reduce", "group", {10: "None", 11: "ProcessGroup"}),
            ],
        ),
    ],
)
def test_peers_in_one_call_differ_by_the_arguments_whose_values_differ(
    ranks: list[ProcessReport], found: list[PeerDifference]
) -> None:
    assert differences(ranks) == found


def test_point_to_point_peers_differ_by_design() -> None:
    ranks = [_rank(10, 0, dst="1"), _rank(11, 1, dst="0")]
    for proc in ranks:
        proc.frame_args[0].function = "send"
    assert differences(ranks) == []


def test_processes_in_different_calls_are_not_compared() -> None:
    zero, one = _rank(10, 0, dst="0"), _rank(11, 1, dst="1")
    one.frame_args[0].function = "barrier"
    assert differences([zero, one]) == []


def test_the_flight_recorders_input_sizes_are_compared_for_one_pending_collective() -> None:
    zero, one = _rank(10, 0, tensor="T"), _rank(11, 1, tensor="T")
    zero.collectives = [Collective(3, "all_reduce", "0", [[8]])]
    one.collectives = [Collective(3, "all_reduce", "0", [[16]])]
    assert differences([zero, one]) == [
        PeerDifference("all_reduce", "input sizes", {10: "[[8]]", 11: "[[16]]"})
    ]
    one.collectives = [Collective(4, "all_reduce", "0", [[16]])]  # not the same collective
    assert differences([zero, one]) == []


@pytest.mark.parametrize(
    ("zero", "one", "sentence"),
    [
        (
            {"dst": "0"},
            {"dst": "1"},
            " The arguments differ: reduce(dst=0) on rank 0/2 vs reduce(dst=1) on rank 1/2.",
        ),
        (
            {"group": "ProcessGroup(ranks=[0, 1])"},
            {"group": "None"},
            " The arguments differ: reduce(group=ProcessGroup(ranks=[0, 1])) on rank 0/2 vs "
            "reduce(group=None) (the default group) on rank 1/2.",
        ),
        # two groups over the same ranks: each rank waits for the other on its own group
        (
            {"group": "ProcessGroup(ranks=[0, 1], name='1')"},
            {"group": "ProcessGroup(ranks=[0, 1], name='2')"},
            " The arguments differ: reduce(group=ProcessGroup(ranks=[0, 1], name='1')) on rank "
            "0/2 vs reduce(group=ProcessGroup(ranks=[0, 1], name='2')) on rank 1/2. Each rank "
            "waits in reduce on a different process group, and a collective completes only when "
            "every member of its group enters it on that same group: each waits for the others "
            "to reach its group's call. The ranks call collectives on their groups in a "
            "different order (or one skips a group's call): make every rank issue them on the "
            "groups in one order.",
        ),
        # groups of one rank each complete alone: no wait for the other is said
        (
            {"group": "ProcessGroup(ranks=[0], name='1')"},
            {"group": "ProcessGroup(ranks=[1], name='2')"},
            " The arguments differ: reduce(group=ProcessGroup(ranks=[0], name='1')) on rank "
            "0/2 vs reduce(group=ProcessGroup(ranks=[1], name='2')) on rank 1/2.",
        ),
    ],
)
def test_the_hint_says_the_difference_in_one_appended_sentence(
    zero: dict[str, str], one: dict[str, str], sentence: str
) -> None:
    ranks = [_rank(11, 1, **one), _rank(10, 0, **zero)]  # said in rank order whatever the input
    hint = with_peer_difference(Hint("ranks wait.", ["x"], rule="collectives"), ranks)
    assert hint.text == "ranks wait." + sentence
    assert hint.based_on[0] == "x" and len(hint.based_on) == 2
    same = with_peer_difference(Hint("ranks wait.", [], rule="collectives"), [_rank(10, 0)] * 2)
    assert same.text == "ranks wait."


#: Reports recorded from the world corpus's two rooted-collective cases (``bench/score_corpus.py
#: --only _mismatch --record DIR``): ranks with the arguments their listeners read.
PEERS = Path(__file__).parent / "data" / "peers"


def _recorded_ranks(name: str) -> list[ProcessReport]:
    report = HangReport.from_json(json.loads((PEERS / f"{name}.json").read_text()))
    return [p for p in report.processes if p.frame_args]


def test_a_recorded_broadcast_with_each_rank_as_its_source_differs_by_src() -> None:
    ranks = _recorded_ranks("test_dist_broadcast_src_mismatch")
    found = differences(ranks)
    assert [(d.name, sorted(d.values.values())) for d in found] == [("src", ["0", "1"])]
    assert lone_root(ranks) is None  # a broadcast's root sends: nobody waits as a lone root


def test_a_recorded_reduce_whose_root_waits_alone_is_said_so() -> None:
    ranks = _recorded_ranks("test_dist_reduce_dst_mismatch")
    assert differences(ranks) == []  # rank 0 is in its barrier already: no shared call
    alone = lone_root(ranks)
    assert alone is not None
    (stuck,) = [p for p in ranks if p.pid == alone.pid]
    assert (alone.function, alone.dst, alone.seq) == ("reduce", "1", 1)
    assert stuck.role_data().rank == 1
    hint = with_peer_difference(Hint("ranks wait.", [], rule="collectives"), ranks)
    assert hint.text == (
        "ranks wait. Rank 1/2 waits in reduce(dst=1) as its root, for the other ranks' "
        "contributions, but rank 0/2 already completed that #1 reduce: they sent to another "
        "root (a different dst)."
    )


def test_a_root_alone_is_not_said_when_a_rank_of_the_world_is_missing() -> None:
    ranks = _recorded_ranks("test_dist_reduce_dst_mismatch")
    assert lone_root([p for p in ranks if p.role_data().rank == 1]) is None
    for proc in ranks:  # nor when the others did not complete that entry
        proc.collectives = [c for c in proc.collectives if c.name != "reduce" or not c.completed]
    assert lone_root(ranks) is None


@pytest.mark.parametrize(
    ("call", "args", "said"),
    [
        ("send", {"tensor": "T", "dst": "1", "group": "None", "tag": "3"}, "dst=1, tag=3"),
        ("recv", {"tensor": "T", "src": "0", "tag": "0", "group_src": "0"}, "src=0, tag=0"),
        ("send", {"dst": "None", "tag": "0", "group_dst": "1"}, "group_dst=1, tag=0"),
        ("recv", {"src": "1", "tag": "0"}, "src=1, tag=0"),
    ],
)
def test_a_point_to_point_call_is_said_with_the_values_its_frame_held(
    call: str, args: dict[str, str], said: str
) -> None:
    proc = _rank(10, 0, **args)
    proc.frame_args[0].function = call
    assert p2p_arguments(proc, call) == said
