"""The odd one out first: processes grouped by identical stacks, the headline that names the
outlier, and the one-screen text, on hang reports recorded from real hangs."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

import pytest

from pytest_torchhang.diagnosis import engine
from pytest_torchhang.report import groups, model
from pytest_torchhang.report.model import Frame, HangReport

HERE = Path(__file__).parent


def recorded(name: str) -> HangReport:
    path = HERE / "recorded_views" / f"{name}.json.gz"
    return HangReport.from_json(json.loads(gzip.decompress(path.read_bytes())))


def corpus(name: str) -> HangReport:
    return HangReport.from_json(json.loads((HERE / "data" / f"{name}.json").read_text()))


def root_pid(hang: HangReport) -> int:
    (root,) = [p for p in hang.processes if p.role_data().kind == "pytest"]
    return root.pid


def headline(hang: HangReport) -> str:
    own = [p for p in hang.processes if not p.role.startswith("started before")]
    return engine.headline(hang.test_id, hang.elapsed_s, own, root_pid(hang))


def blocks(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("--- process ")]


def test_of_four_workers_the_headline_names_the_one_stuck_in_getitem_not_the_three_idle() -> None:
    hang = recorded("dataloader_one_stuck_of_four")
    # as the capture wrote it, before the odd one out: it named the three idle workers
    assert hang.headline.endswith("5 processes, 3 stuck in DataLoader worker select")
    (stuck,) = [p for p in hang.processes if "OneSlowIndex" in p.role]
    assert headline(hang) == (
        f"HANG after 6.0s in {hang.test_id}: 5 processes, {stuck.role} (pid {stuck.pid}) stuck "
        "in __getitem__ (3 other DataLoader workers wait in _worker_loop -> queues.get -> select)"
    )
    assert engine.culprits(hang.processes, root_pid(hang)) == [stuck.pid]


def test_the_cause_is_the_first_hint_about_the_process_the_headline_names() -> None:
    hang = recorded("dataloader_one_stuck_of_four")
    (stuck,) = [p for p in hang.processes if "OneSlowIndex" in p.role]
    cause = engine.cause(hang.hints, hang.processes, root_pid(hang))
    assert cause == next(h.text for h in hang.hints if stuck.pid in h.pids)
    assert engine.cause([], hang.processes, root_pid(hang)) == ""  # nothing known: no guess


def test_the_outlier_comes_first_then_pytest_then_the_crowd_folded_with_its_pids() -> None:
    hang = recorded("dataloader_one_stuck_of_four")
    found = groups.group_processes(hang.processes)
    assert [(g.role, len(g.processes), g.outlier, g.crowd) for g in found] == [
        ("DataLoader worker", 1, True, False),
        ("pytest", 1, False, False),
        ("DataLoader worker", 3, False, True),
    ]
    assert found[2].where == "_worker_loop -> queues.get -> select"
    assert found[0].where == "_worker_loop -> fetch.fetch -> __getitem__"
    workers = [p for p in hang.processes if p.role.startswith("DataLoader worker")]
    idle = [p.pid for p in workers if "OneSlowIndex" not in p.role]
    assert found[2].line() == (
        f"3 DataLoader workers (pids {', '.join(map(str, idle))}): "
        "_worker_loop -> queues.get -> select"
    )


def test_the_text_shows_the_odd_one_first_and_the_idle_three_once() -> None:
    hang = recorded("dataloader_one_stuck_of_four")
    text = hang.to_text()
    (stuck,) = [p for p in hang.processes if "OneSlowIndex" in p.role]
    shown = blocks(text)
    assert len(shown) == 3 and shown[0].startswith(f"--- process {stuck.pid} ")
    assert "processes, the odd one out first:\n  DataLoader worker 1/4" in text
    assert "<- differs from 3 identical" in text
    assert re.search(r"the same stacks, shown once: pid \d+ \[DataLoader worker \d/4\], pid", text)
    # multiprocessing's start-up (and, in a fork child, the parent's frames) are cut
    assert "popen_fork.py" not in text and "_bootstrap" not in text
    assert text.count("... multiprocessing's start-up frames cut") == 2
    # the plugin's own /proc reader in pytest is one line, not a stack
    ours = "1 thread(s) of pytest-torchhang itself, not shown: pytest-torchhang /proc reader"
    assert ours in text
    assert "pytest_torchhang/capture/procfs.py" not in text
    # four queue feeder threads of pytest with one stack: shown once
    assert "and 3 more with the same stack" in text


def test_sixty_four_identical_workers_are_one_block_with_every_pid_named() -> None:
    hang = recorded("dataloader_64_workers")
    assert headline(hang).endswith("65 processes, 64 stuck in DataLoader worker __getitem__")
    text = hang.to_text()
    assert len(blocks(text)) == 2  # pytest, and the 64 workers once
    same = next(line for line in text.splitlines() if "the same stacks, shown once:" in line)
    workers = [p.pid for p in hang.processes if p.role.startswith("DataLoader worker")]
    assert all(str(pid) in same for pid in workers[1:])
    assert "and 55 more (pids " in same
    every_block = sum(len("\n".join(model._process_text(p))) for p in hang.processes)
    shown = text[text.index("--- process ") : text.index("\ncleanup: ")]
    assert len(shown) < every_block / 8, (len(shown), every_block)  # not 64 blocks of stacks


def test_two_identical_workers_are_counted_together_with_no_odd_one_named() -> None:
    hang = recorded("dataloader_two_workers")
    assert headline(hang).endswith("3 processes, 2 stuck in DataLoader worker __getitem__")
    assert engine.odd_one_out(hang.processes, root_pid(hang)) is None
    assert len(blocks(hang.to_text())) == 2


def test_ranks_in_different_collectives_stay_apart_and_name_their_process_group() -> None:
    hang = corpus("test_distributed_different_collectives")
    ranks = [g for g in groups.group_processes(hang.processes) if g.role == "rank"]
    assert [g.where.split(", in ")[1] for g in ranks] == [
        "#2 all_reduce([1024]) on process group 'default_pg'",
        "#2 barrier on process group 'default_pg'",
    ]
    text = hang.to_text()
    assert "        #2 barrier on process group 'default_pg' NOT COMPLETED" in text
    assert engine.odd_one_out(hang.processes, root_pid(hang)) is None  # one against one


def test_a_stopped_worker_and_an_idle_one_are_no_crowd() -> None:
    hang = corpus("test_loading_worker_stopped")
    assert headline(hang) == hang.headline  # no odd one out of two: the headline as it was


@pytest.mark.parametrize("path", sorted((HERE / "data").glob("test_*.json")), ids=lambda p: p.stem)
def test_every_recorded_process_is_in_exactly_one_group_and_one_block(path: Path) -> None:
    hang = HangReport.from_json(json.loads(path.read_text()))
    found = groups.group_processes(hang.processes)
    assert sorted(p.pid for g in found for p in g.processes) == sorted(
        p.pid for p in hang.processes
    )
    text = hang.to_text()
    for proc in hang.processes:
        assert str(proc.pid) in text


SITE = "/usr/lib/python3.11"


def test_a_child_is_cut_at_its_entry_and_a_parent_starting_one_keeps_its_launch() -> None:
    child = [
        Frame("/t/test_x.py", 9, "target"),
        Frame(f"{SITE}/multiprocessing/process.py", 108, "run"),
        Frame(f"{SITE}/multiprocessing/process.py", 314, "_bootstrap"),
        Frame(f"{SITE}/multiprocessing/popen_fork.py", 71, "_launch"),
        Frame("/t/test_x.py", 20, "test_x"),
    ]
    assert [f.name for f in groups.cut_startup(child)] == [
        "target",
        "... multiprocessing's start-up frames cut",
    ]
    parent = [
        Frame(f"{SITE}/multiprocessing/popen_fork.py", 66, "_launch"),
        Frame(f"{SITE}/multiprocessing/context.py", 281, "_Popen"),
        Frame("/t/test_x.py", 20, "test_x"),
    ]
    assert groups.cut_startup(parent) == parent  # a hang while starting a child stays visible
    in_c = child[1:]  # Process(target=time.sleep): the child waits in run itself
    assert [f.name for f in groups.cut_startup(in_c)] == [
        "run",
        "... multiprocessing's start-up frames cut",
    ]


@pytest.mark.parametrize(
    ("role", "many"),
    [
        ("DataLoader worker", "DataLoader workers"),
        ("rank", "ranks"),
        ("Python child", "Python children"),
        ("Pool worker", "Pool workers"),
        ("multiprocessing.Process(target=f)", "processes [multiprocessing.Process(target=f)]"),
    ],
)
def test_a_group_of_a_role_reads_in_the_plural(role: str, many: str) -> None:
    assert groups.plural(role) == many


def test_three_workers_deadlocked_in_getitem_are_the_story_not_the_idle_fourth() -> None:
    # recorded when the headline still named the outlier whatever it did: "DataLoader worker
    # 0/4 (pid N) stuck in select (3 other DataLoader workers wait in ... __getitem__)"
    hang = recorded("dataloader_three_stuck_one_idle")
    assert " stuck in select (3 other DataLoader workers wait in " in hang.headline
    assert headline(hang).endswith("5 processes, 3 stuck in DataLoader worker __getitem__")
    assert engine.odd_one_out(hang.processes, root_pid(hang)) is None
    stuck = [p.pid for p in hang.processes if "MostIndicesDeadlock" in p.role]
    assert sorted(engine.culprits(hang.processes, root_pid(hang))) == sorted(stuck)
    # the text still folds the three into one block
    assert len(blocks(hang.to_text())) == 3


def test_two_programs_with_the_same_frames_stay_apart_and_spawn_handles_do_not_matter() -> None:
    # two copies of one recorded idle worker: as two scripts whose <module> frames read alike
    # (fault matrix: a SIGTERM-ignoring child and an orphan), and as two spawn children
    hang = recorded("dataloader_one_stuck_of_four")
    worker = next(p for p in hang.processes if p.role == "DataLoader worker 0/4")
    apart = [
        dataclasses.replace(worker, pid=1, cmdline="python -c import signal; sleep()"),
        dataclasses.replace(worker, pid=2, cmdline="python -c import os; os.fork(); sleep()"),
    ]
    assert len(groups.group_processes(apart)) == 2
    spawned = "python -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle={})"
    together = [
        dataclasses.replace(worker, pid=n, cmdline=spawned.format(n + 10)) for n in (1, 2, 3)
    ]
    (group,) = groups.group_processes(together)
    assert group.pids == [1, 2, 3]


def test_the_processes_the_headline_names_come_first_in_the_text() -> None:
    # the capture stores the headline's processes: the deadlocked three lead, not the idle one
    hang = recorded("dataloader_three_stuck_one_idle")
    hang.culprits = engine.culprits(hang.processes, root_pid(hang))
    first = blocks(hang.to_text())[0]
    assert "(dataset MostIndicesDeadlock)" in first, first
    again = HangReport.from_json(json.loads(json.dumps(hang.to_json())))
    assert again.culprits == hang.culprits and again.to_text() == hang.to_text()
