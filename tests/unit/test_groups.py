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
from pytest_torchhang.report.text import _process_text, to_text

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
    text = to_text(hang)
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
    text = to_text(hang)
    assert len(blocks(text)) == 2  # pytest, and the 64 workers once
    same = next(line for line in text.splitlines() if "the same stacks, shown once:" in line)
    workers = [p.pid for p in hang.processes if p.role.startswith("DataLoader worker")]
    assert all(str(pid) in same for pid in workers[1:])
    assert "and 55 more (pids " in same
    every_block = sum(len("\n".join(_process_text(p))) for p in hang.processes)
    shown = text[text.index("--- process ") : text.index("\ncleanup: ")]
    assert len(shown) < every_block / 8, (len(shown), every_block)  # not 64 blocks of stacks


def test_two_identical_workers_are_counted_together_with_no_odd_one_named() -> None:
    hang = recorded("dataloader_two_workers")
    assert headline(hang).endswith("3 processes, 2 stuck in DataLoader worker __getitem__")
    assert engine.odd_one_out(hang.processes, root_pid(hang)) is None
    assert len(blocks(to_text(hang))) == 2


def test_ranks_in_different_collectives_stay_apart_and_name_their_process_group() -> None:
    hang = corpus("test_distributed_different_collectives")
    ranks = [g for g in groups.group_processes(hang.processes) if g.role == "rank"]
    assert [g.where.split(", in ")[1] for g in ranks] == [
        "#2 all_reduce([1024]) on process group 'default_pg'",
        "#2 barrier on process group 'default_pg'",
    ]
    text = to_text(hang)
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
    text = to_text(hang)
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


MP = f"{SITE}/multiprocessing"
BOOT = "<frozen importlib._bootstrap>"
#: The frames of real stacks (Python 3.11), innermost first, by name: (file, function, line).
F: dict[str, tuple[str, str, str]] = {
    "flock": ("/t/test_x.py", "<module>", "fcntl.flock(cache, fcntl.LOCK_SH)"),
    "script": ("/t/train.py", "<module>", "lock.acquire()"),
    "torch": ("/site-packages/torch/__init__.py", "<module>", "from torch._C import *"),
    "exec": ("<frozen importlib._bootstrap_external>", "exec_module", ""),
    "load": (BOOT, "_load_unlocked", ""),
    "find": (BOOT, "_find_and_load", ""),
    "run_code": ("<frozen runpy>", "_run_code", ""),
    "run_module_code": ("<frozen runpy>", "_run_module_code", ""),
    "run_path": ("<frozen runpy>", "run_path", ""),
    "fixup": (f"{MP}/spawn.py", "_fixup_main_from_path", "main_content = runpy.run_path("),
    "prepare": (f"{MP}/spawn.py", "prepare", "_fixup_main_from_path(data['init_main_from_path'])"),
    "unpickle": (f"{MP}/spawn.py", "_main", "self = reduction.pickle.load(from_parent)"),
    "prepare_main": (f"{MP}/spawn.py", "_main", "prepare(preparation_data)"),
    "spawn_main": (f"{MP}/spawn.py", "spawn_main", "exitcode = _main(fd, parent_sentinel)"),
    "string": ("<string>", "<module>", ""),
    "serve_one": (
        f"{MP}/forkserver.py",
        "_serve_one",
        "code = spawn._main(child_r, parent_sentinel)",
    ),
    "fs_main": (f"{MP}/forkserver.py", "main", "code = _serve_one(child_r, fds,"),
    "fs_preload": (f"{MP}/forkserver.py", "main", "spawn.import_main_path(main_path)"),
    "import_main": (f"{MP}/spawn.py", "import_main_path", "_fixup_main_from_path(main_path)"),
    "select": (f"{SITE}/selectors.py", "select", "fd_event_list = self._selector.poll(timeout)"),
    "target": ("/t/test_x.py", "target", "lock.acquire()"),
    "init": ("/t/test_x.py", "_read_the_cache", "with CACHE:"),
    "get": (f"{MP}/queues.py", "get", "res = self._reader.recv_bytes()"),
    "worker_init": (f"{MP}/pool.py", "worker", "initializer(*initargs)"),
    "worker_get": (f"{MP}/pool.py", "worker", "task = get()"),
    "run": (f"{MP}/process.py", "run", "self._target(*self._args, **self._kwargs)"),
    "bootstrap": (f"{MP}/process.py", "_bootstrap", "self.run()"),
    "bootstrap_fork": (f"{MP}/process.py", "_bootstrap", "self._after_fork()"),
    "after_fork": (f"{MP}/util.py", "_run_after_forkers", "func(obj)"),
    "exit": (f"{MP}/util.py", "_exit_function", "_run_finalizers()"),
    "launch": (
        f"{MP}/popen_fork.py",
        "_launch",
        "code = process_obj._bootstrap(parent_sentinel=child_r)",
    ),
    "start": (f"{MP}/process.py", "start", "self._popen = self._Popen(self)"),
    "repopulate": (f"{MP}/pool.py", "_repopulate_pool_static", "w.start()"),
    "maintain": (f"{MP}/pool.py", "_maintain_pool", "Pool._repopulate_pool_static(ctx, Process,"),
    "handle": (f"{MP}/pool.py", "_handle_workers", "cls._maintain_pool(ctx, Process, processes,"),
    "pool_init": (f"{MP}/pool.py", "__init__", "self._repopulate_pool()"),
    "t_run": (f"{SITE}/threading.py", "run", "self._target(*self._args, **self._kwargs)"),
    "t_inner": (f"{SITE}/threading.py", "_bootstrap_inner", "self.run()"),
    "t_boot": (f"{SITE}/threading.py", "_bootstrap", "self._bootstrap_inner()"),
    "test": ("/t/test_x.py", "test_x", "pool.apply(f, (2,))"),
    "pytest": ("<pytest>", 0, "... pytest's own frames cut"),  # type: ignore[dict-item]
}
CUT = "... multiprocessing's start-up frames cut"
THREAD_CUT = "... threading's start-up frames cut"


def _stack(names: str) -> list[Frame]:
    return [
        Frame(F[n][0], 1, F[n][1], F[n][2]) if n != "pytest" else Frame("<pytest>", 0, F[n][2])
        for n in names.split()
    ]


def _names(frames: list[Frame]) -> list[str]:
    by_frame = {(f, n, line): key for key, (f, n, line) in F.items()}
    return [by_frame.get((f.filename, f.name, f.line), f.name) for f in frames]


#: (what, the stack innermost first, what the cut keeps: the frames' keys, or "all").
CUTS = [
    # the child's own code runs: the start-up below says nothing
    ("a fork child in its target", "target run bootstrap launch start test pytest", "target CUT"),
    (
        "a spawn child in its target",
        "target run bootstrap prepare_main spawn_main string",
        "target CUT",
    ),
    ("a target that is a C function", "run bootstrap launch start test pytest", "run CUT"),
    ("a child flushing a queue at exit", "exit bootstrap spawn_main string", "exit CUT"),
    ("the forkserver serving", "select fs_main string", "select CUT"),
    (
        "an idle Pool worker the maintenance thread forked",
        "get worker_get run bootstrap launch start repopulate maintain handle t_run t_inner t_boot",
        "get worker_get CUT",
    ),
    (
        "a Pool worker the test forked, in its initializer",
        "init worker_init run bootstrap launch start repopulate pool_init test pytest",
        "init worker_init CUT",
    ),
    # the stuck frame is inside the start-up: every frame is the evidence
    (
        "spawn re-imports the main module (a script)",
        "script run_code run_module_code run_path fixup prepare prepare_main spawn_main string",
        "all",
    ),
    (
        "spawn unpickles the target and imports the test module",
        "flock exec load find unpickle spawn_main string",
        "all",
    ),
    ("spawn's child waits for what its parent sends", "unpickle spawn_main string", "all"),
    (
        "a forkserver child imports the test module",
        "flock exec load find unpickle serve_one fs_main string",
        "all",
    ),
    (
        "the forkserver preloads the main module",
        "script run_code run_module_code run_path fixup import_main fs_preload string",
        "all",
    ),
    (
        "a fork child in _bootstrap's after-fork work",
        "after_fork bootstrap_fork launch start test pytest",
        "all",
    ),
    (
        "a Pool worker the maintenance thread forked, in its initializer",
        "init worker_init run bootstrap launch start repopulate maintain handle t_run t_inner t_boot",
        "init worker_init run bootstrap launch start repopulate maintain handle THREAD_CUT",
    ),
    # no child entry: a parent starting a child keeps its launch; a thread loses threading's
    ("a parent starting a child", "launch start test pytest", "all"),
    (
        "a Pool's maintenance thread starting a worker",
        "launch start repopulate maintain handle t_run t_inner t_boot",
        "launch start repopulate maintain handle THREAD_CUT",
    ),
]


@pytest.mark.parametrize(("stack", "kept"), [c[1:] for c in CUTS], ids=[c[0] for c in CUTS])
def test_the_start_up_is_cut_only_where_it_says_nothing_of_the_stuck_frame(
    stack: str, kept: str
) -> None:
    frames = _stack(stack)
    entries = ("bootstrap", "bootstrap_fork", "spawn_main", "serve_one", "fs_main", "fs_preload")
    child = any(name in entries for name in stack.split())
    # kept whole (but for the bottom frames of the thread that forked it): inside its start-up
    assert groups.in_startup(frames) == (child and "CUT" not in kept.split())
    cut = groups.cut_startup(frames)
    if kept == "all":
        assert cut == frames
    else:
        expected = [{"CUT": CUT, "THREAD_CUT": THREAD_CUT}.get(k, k) for k in kept.split()]
        assert _names(cut) == expected


#: (the stack, what the headline says of a child stuck in it).
REIMPORTS = [
    (
        "script run_code run_module_code run_path fixup prepare prepare_main spawn_main string",
        "while spawn re-imports train",
    ),
    ("flock exec load find unpickle spawn_main string", "while spawn re-imports test_x"),
    (
        "flock exec load find torch exec load find unpickle spawn_main string",
        "while spawn re-imports torch",
    ),  # the outermost module: the test module waits in torch's
    (
        "flock exec load find unpickle serve_one fs_main string",
        "while forkserver re-imports test_x",
    ),
    ("unpickle spawn_main string", ""),  # reading, not importing
    ("after_fork bootstrap_fork launch start test pytest", ""),  # a fork child imports nothing
    ("target run bootstrap prepare_main spawn_main string", ""),  # its own code runs
]


@pytest.mark.parametrize(("stack", "said"), REIMPORTS, ids=[r[1] or r[0] for r in REIMPORTS])
def test_a_child_stuck_importing_in_its_start_up_is_said_to_be_re_imported(
    stack: str, said: str
) -> None:
    assert groups.reimports(_stack(stack)) == said


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
    assert len(blocks(to_text(hang))) == 3


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
    first = blocks(to_text(hang))[0]
    assert "(dataset MostIndicesDeadlock)" in first, first
    again = HangReport.from_json(json.loads(json.dumps(hang.to_json())))
    assert again.culprits == hang.culprits and to_text(again) == to_text(hang)


# --- recorded hangs inside the start-up (tests/corpus/corpus_startup.py) ---


def _block(text: str, pid: int) -> str:
    start = text.index(f"--- process {pid} ")
    end = text.find("\n--- process ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _child(hang: HangReport) -> model.ProcessReport:
    """The stuck child: the one the headline names."""
    (pid,) = hang.culprits
    return next(p for p in hang.processes if p.pid == pid)


@pytest.mark.parametrize(
    "name",
    [
        "test_startup_spawned_loader_worker_imports_a_module_that_waits_for_the_tests_lock",
        "test_startup_pool_replaces_a_worker_that_waits_for_the_tests_lock",
    ],
)
def test_a_child_blocked_while_spawn_re_imports_the_test_module_shows_every_frame(
    name: str,
) -> None:
    from pytest_torchhang.diagnosis import frames

    hang = corpus(name)
    child = _child(hang)
    block = _block(to_text(hang), child.pid)
    # the module's blocking line, importlib, and spawn's frames that say it is spawn importing
    assert "fcntl.flock(_cache, fcntl.LOCK_SH)" in block
    assert "in _find_and_load" in block
    assert 'multiprocessing/spawn.py", line' in block and ", in _main" in block
    assert ", in spawn_main" in block
    assert "start-up frames cut" not in block
    # the headline names the re-import, from the frames, not "<module>"
    assert frames.stuck_at(child) == "while spawn re-imports test_corpus_startup"
    child.stuck_at = frames.stuck_at(child)
    said = headline(hang)
    assert said.endswith(
        "1 stuck in multiprocessing child while spawn re-imports test_corpus_startup"
    )
    assert "<module>" not in said


def test_a_pools_maintenance_thread_stuck_starting_a_worker_keeps_its_frames() -> None:
    hang = corpus("test_startup_pool_replaces_a_worker_that_waits_for_the_tests_lock")
    text = _block(to_text(hang), root_pid(hang))
    handler = text[text.index(' (_handle_workers)" [Pool handler thread]') :]
    handler = handler[: handler.index("\n    thread ")]
    for frame in (
        "_launch",
        "start",
        "_repopulate_pool_static",
        "_maintain_pool",
        "_handle_workers",
    ):
        assert f", in {frame}\n" in handler, handler
    assert "blocked in write(" in handler  # the initargs its new worker has not read


def test_a_pool_worker_forked_by_the_maintenance_thread_keeps_its_fork_history() -> None:
    hang = corpus("test_startup_pool_forks_a_replacement_while_the_test_holds_a_lock")
    child = _child(hang)
    block = _block(to_text(hang), child.pid)
    # where it waits (its initializer, in the pool's worker), and who forked it, with what held
    for frame in (
        "_read_the_cache",
        "worker",
        "_bootstrap",
        "_repopulate_pool_static",
        "_maintain_pool",
        "_handle_workers",
    ):
        assert f", in {frame}\n" in block, block
    assert "with CACHE:" in block
    assert block.count("... threading's start-up frames cut") == 1
    assert "multiprocessing's start-up frames cut" not in block
    (group,) = [g for g in groups.group_processes(hang.processes) if child in g.processes]
    assert group.where == "_handle_workers -> pool._maintain_pool -> _read_the_cache"


def test_a_scripts_spawned_child_shows_spawn_running_the_scripts_top_level_again() -> None:
    from pytest_torchhang.diagnosis import frames

    hang = corpus(
        "test_startup_spawned_child_of_a_script_runs_its_top_level_that_waits_for_its_lock"
    )
    (child,) = [p for p in hang.processes if p.role.startswith("multiprocessing child")]
    block = _block(to_text(hang), child.pid)
    shown = re.findall(r", in (\S+)\n", block)
    assert shown == [
        "<module>",  # train.py, at its flock
        "_run_code",
        "_run_module_code",
        "run_path",
        "_fixup_main_from_path",
        "prepare",
        "_main",
        "spawn_main",
        "<module>",  # the -c command line
    ], block
    assert "fcntl.flock(cache, fcntl.LOCK_SH)" in block
    assert frames.stuck_at(child) == "while spawn re-imports train"
    (group,) = [g for g in groups.group_processes(hang.processes) if child in g.processes]
    assert group.line().endswith("-> while spawn re-imports train")
