"""Re-record the hang reports under tests/unit/data/ from real hangs of the corpus, with the plugin.

Run it from the repository root, with torch installed (it takes a few minutes)::

    python tests/unit/record.py

Re-record when the capture changes what a report holds (a new field of ``HangReport``, a new
fact read from /proc, a new role), or when a corpus scenario changes: the replay tests
(``tests/unit/test_diagnosis_replay.py``) then run the diagnosis rules on what the capture of
today writes. A rule change alone needs no re-recording: that is what the recordings are for.

It runs every scenario of ``tests/corpus/`` in one real pytest session with
``--torch-hang-report-dir``, as ``tests/test_diagnosis_corpus.py`` does, then the training loop
of ``tests/test_stall.py`` that stops making progress in its third epoch (a stall report), and
keeps the first report of each scenario named in ``CHOSEN``, written by the plugin and not edited, as
``data/<scenario>.json``. Beside them, ``data/recording.json`` keeps what the diagnosis reads
from the recording machine's disk rather than from the report (see ``replay`` in
``tests/unit/conftest.py``): the interpreter's stdlib directory, and the source lines of the
test files (whole: rules read what a test does after the line it waits on) and of the stdlib
modules the reports' frames point into, up to the deepest line a frame names. Check ``git diff --stat tests/unit/data`` afterwards: the set stays
under about 2 MB.

``--only SCENARIO...`` records those scenarios of ``CHOSEN`` alone and keeps the other
recordings: ``recording.json`` then gives each re-recorded scenario the digest of the diagnosis
that recorded it (``digests``), and the exact replay compares each recording with its own.
"""

from __future__ import annotations

import argparse
import gzip
import json
import linecache
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "corpus"
DATA = HERE / "data"
VIEWS_DATA = HERE / "recorded_views"
#: ``--view NAME``: real hangs kept for the views and the grouping of the text report, as
#: ``recorded_views/NAME.json.gz``: (module of tests/ with the scenario, its constant, the test).
VIEWS = {
    "dataloader_one_stuck_of_four": (
        "test_dataloader_hangs",
        "ONE_STUCK_OF_FOUR",
        "test_one_worker_of_four_hangs",
    ),
    "dataloader_three_stuck_one_idle": (
        "test_dataloader_hangs",
        "THREE_STUCK_ONE_IDLE",
        "test_three_workers_of_four_deadlock",
    ),
}

#: The scenarios kept, one or more per rule family (labels: tests/test_diagnosis_corpus.py).
CHOSEN = (
    # DataLoader workers
    "test_loading_worker_stopped",
    "test_loading_iterable_worker_spins",
    "test_loading_lock_held_at_fork",
    "test_loading_lock_taken_twice",
    "test_loading_worker_reads_a_silent_pipe",
    "test_loading_worker_sleeps",
    "test_loading_workers_wait_for_a_file_lock_the_parent_holds",
    "test_loading_openmp_after_the_parent_ran_ops",
    "test_loading_future_result_after_fork",
    "test_loading_openmp_in_a_library_op_after_worker_init_raises_threads",
    "test_loading_openmp_in_tensor_methods_after_worker_init_raises_threads",
    "test_loading_slow_rate_limited_worker",
    "test_loading_worker_opens_a_fifo_nobody_writes",
    "test_loading_batch_that_cannot_be_pickled",
    "test_loading_workers_leak_the_slots_of_a_shared_semaphore",
    # processes, pipes and queues
    "test_sharing_join_before_draining_a_queue",
    "test_sharing_manager_lock_leaked",
    "test_sharing_pool_map_worker_killed",
    "test_sharing_child_waits_for_an_event_the_parent_sets_after_join",
    "test_sharing_popen_child_stopped",
    "test_sharing_child_died_before_sending",
    "test_sharing_popen_communicate_with_a_sleeping_child",
    "test_sharing_the_test_itself_sleeps",
    "test_sharing_a_service_that_never_answers",
    "test_sharing_thread_join_while_holding_its_lock",
    "test_sharing_join_chain_back_to_the_test",
    "test_sharing_slow_supervisor_polling_healthy_children",
    "test_sharing_popen_wait_with_a_full_stdout_pipe",
    "test_sharing_output_read_to_its_end_while_a_background_grandchild_holds_it",
    # classes of wait named in the user's words
    "test_waits_semaphore_slots_leak_on_an_early_return",
    "test_waits_threading_semaphore_slots_leak_on_an_early_return",
    "test_waits_one_end_marker_for_two_consumers",
    "test_waits_popen_wait_with_a_full_stderr_pipe",
    "test_waits_spins_for_a_file_a_failed_producer_never_writes",
    "test_waits_spins_on_a_shared_value_a_failed_producer_never_sets",
    "test_waits_recv_from_a_server_that_accepted_and_never_answers",
    "test_waits_fork_child_imports_a_module_a_parent_thread_was_importing",
    "test_waits_join_chain_to_a_sentinel_sent_after_the_join",
    "test_waits_two_consumers_iterate_to_a_sentinel_put_once",
    "test_waits_recv_from_a_server_thread_of_the_test_that_never_answers",
    "test_waits_polls_with_a_sleep_for_a_file_a_failed_producer_never_writes",
    "test_waits_fork_child_imports_by_name_a_module_a_parent_thread_was_importing",
    "test_waits_semaphore_held_by_the_test_while_it_joins",
    "test_waits_fork_child_imports_a_module_named_by_a_variable_a_parent_thread_imported",
    "test_waits_semaphore_slot_held_by_a_retry_while_the_test_reads_results",
    "test_waits_one_end_marker_for_two_consumers_whose_counts_the_test_reads",
    # inside multiprocessing's start-up: spawn re-imports the test module, a Pool replaces a worker
    "test_startup_spawned_loader_worker_imports_a_module_that_waits_for_the_tests_lock",
    "test_startup_pool_forks_a_replacement_while_the_test_holds_a_lock",
    "test_startup_pool_replaces_a_worker_that_waits_for_the_tests_lock",
    "test_startup_spawned_child_of_a_script_runs_its_top_level_that_waits_for_its_lock",
    # waits a signal would still end, an idle server beside the hang, a child with no stack
    "test_signals_worker_ended_by_sigterm_joined_without_terminate",
    "test_signals_test_under_its_own_alarm_hangs_on_a_lock",
    "test_signals_idle_http_server_beside_a_test_deadlocked_on_its_lock",
    "test_signals_idle_http_server_thread_beside_a_test_deadlocked_on_its_lock",
    "test_signals_idle_process_pool_beside_a_test_deadlocked_on_its_lock",
    "test_signals_idle_thread_pool_beside_a_test_deadlocked_on_its_lock",
    "test_signals_setsid_daemon_child_with_closed_descriptors_reads_forever",
    # a stall: no progress for the stall time (tests/test_stall.py)
    "test_freezes_in_its_third_epoch",
    # gloo ranks
    "test_distributed_different_collectives",
    "test_distributed_rank_never_reaches_the_collective",
    "test_distributed_both_ranks_receive",
    "test_distributed_rank_died_before_init",
    "test_distributed_torchrun_ranks_diverge",
    "test_distributed_slow_rank_computes",
    "test_distributed_send_and_recv_never_match",
    # ranks started as MultiProcessTestCase does: known by their process group
    "test_distributed_plain_process_ranks_one_skips_an_all_reduce",
    "test_distributed_plain_process_ranks_in_different_collectives",
    "test_distributed_plain_process_ranks_wait_for_a_store_key_nobody_sets",
    "test_distributed_plain_process_rank_waits_for_its_dataloader_worker",
    "test_distributed_plain_process_rank_waits_for_a_key_a_computing_rank_sets_later",
    "test_distributed_plain_process_rank_waits_for_a_key_named_from_its_own_value",
    "test_distributed_plain_process_ranks_build_a_group_on_one_rank_only",
)


def _pytest(workdir: Path, *args: str) -> None:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly"]
    # a basetemp of its own: the shared one keeps only the last 3 sessions' (anyone's), and the
    # sources of the tests' own files under tmp_path (torchrun's script) are read after the run
    command += ["-q", f"--basetemp={workdir / 'basetemp'}"]
    command += [f"--torch-hang-report-dir={workdir / 'reports'}", *args]
    subprocess.run(command, cwd=workdir, timeout=1800, check=False)


def _node_ids(names: list[str]) -> list[str]:
    """The node ids of the corpus scenarios ``names``, as copied by :func:`run_sessions`."""
    out = []
    for source in sorted(CORPUS.glob("corpus_*.py")):
        text = source.read_text()
        out += [f"test_{source.stem}.py::{n}" for n in names if f"\ndef {n}(" in text]
    return out


def run_sessions(workdir: Path, timeout: float, only: list[str] | None = None) -> Path:
    """Run the corpus and the stall in a fresh directory (``only``: those corpus scenarios, and
    no stall); the folder of the plugin's reports."""
    (workdir / "pytest.ini").write_text("[pytest]\n")  # keep the repository's ini out of it
    corpus = []
    for source in sorted(CORPUS.glob("corpus_*.py")):
        corpus.append(f"test_{source.stem}.py")
        shutil.copy(source, workdir / corpus[-1])
    _pytest(workdir, f"--torch-hang-timeout={timeout}", *(_node_ids(only) if only else corpus))
    if only:
        return workdir / "reports"
    sys.path.insert(0, str(HERE.parent))  # the end-to-end stall test's scenario
    from test_stall import TRAINING

    (workdir / "test_stall_training.py").write_text(TRAINING)
    _pytest(
        workdir,
        "--torch-hang-stall=6",  # as tests/test_stall.py: torch's first ops import for seconds
        "--torch-hang-timeout=120",
        "test_stall_training.py::test_freezes_in_its_third_epoch",
    )
    return workdir / "reports"


def first_reports(reports: Path) -> dict[str, Path]:
    """The file of the first hang report of each test, by test name (as the corpus test
    chooses)."""
    out: dict[str, tuple[float, Path]] = {}
    for path in sorted(reports.glob("*.json")):
        doc: dict[str, Any] = json.loads(path.read_text())
        name = doc["test_id"].split("::")[-1]
        if name not in out or doc["created"] < out[name][0]:
            out[name] = (doc["created"], path)
    return {name: path for name, (_, path) in out.items()}


def read_by_diagnosis(docs: list[dict[str, Any]]) -> set[str]:
    """The source files the diagnosis reads (through linecache) when it runs on ``docs``."""
    from pytest_torchhang.diagnosis import engine, frames
    from pytest_torchhang.report.model import CONTEXT_ROLE, HangReport

    read: set[str] = set()
    real = linecache.updatecache

    def spy(filename: str, module_globals: Any = None) -> list[str]:
        read.add(filename)
        return real(filename, module_globals)

    linecache.clearcache()
    frames.enclosing_class.cache_clear()
    linecache.updatecache = spy
    try:
        for doc in docs:
            processes = HangReport.from_json(doc).processes
            engine.hints([p for p in processes if not p.role.startswith(CONTEXT_ROLE)])
    finally:
        linecache.updatecache = real
    return read


def sources(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The source the diagnosis may read of each file the reports' frames point into, up to the
    deepest line named: those it reads today, and every one outside installed packages (rules
    to come may read them; all of torch's would make the data set large)."""
    deepest: dict[str, int] = {}
    for doc in docs:
        for proc in doc["processes"]:
            for thread in proc["threads"]:
                for frame in thread["frames"]:
                    deepest[frame["filename"]] = max(
                        deepest.get(frame["filename"], 0), frame["lineno"]
                    )
    read = read_by_diagnosis(docs)
    out = {}
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    for name, lineno in sorted(deepest.items()):
        wanted = name in read or not (name.startswith("<") or "-packages" in name)
        if wanted and os.path.isfile(name):
            with open(name, encoding="utf-8", errors="replace") as source:
                lines = source.readlines()
            # the test's own files whole: rules read the lines after a frame's (what the test
            # does after its join); library files up to the deepest line a frame names
            own = not os.path.realpath(name).startswith(stdlib)
            out[name] = "".join(lines if own else lines[:lineno])
    return out


def record_view(name: str, timeout: float) -> int:
    """Run one scenario of ``VIEWS`` in a real session and keep its report, gzipped, unedited."""
    module, constant, test = VIEWS[name]
    sys.path.insert(0, str(HERE.parent))
    source = getattr(__import__(module), constant)
    workdir = Path(tempfile.mkdtemp(prefix="torchhang-record-"))
    try:
        (workdir / "pytest.ini").write_text("[pytest]\n")
        (workdir / "test_view.py").write_text(source)
        _pytest(workdir, f"--torch-hang-timeout={timeout}", f"test_view.py::{test}")
        found = first_reports(workdir / "reports")
        if test not in found:
            print(f"no hang report for {test}: nothing written", file=sys.stderr)
            return 1
        path = VIEWS_DATA / f"{name}.json.gz"
        path.write_bytes(gzip.compress(found[test].read_bytes(), mtime=0))
        print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB)")
        return 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=3.0, help="The corpus test's timeout")
    parser.add_argument("--keep", action="store_true", help="Keep the session's directory")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="SCENARIO",
        help="Record only these scenarios of CHOSEN (corpus scenarios), keeping the other "
        "recordings; each recording keeps the digest of the diagnosis that recorded it",
    )
    parser.add_argument(
        "--session",
        type=Path,
        help="Curate from the directory a --keep run left (its reports and test files), "
        "without running the corpus again",
    )
    parser.add_argument(
        "--view",
        choices=sorted(VIEWS),
        help="Record only this scenario, into recorded_views/ (the corpus is left alone)",
    )
    args = parser.parse_args()
    if args.view:
        return record_view(args.view, args.timeout)
    workdir = args.session or Path(tempfile.mkdtemp(prefix="torchhang-record-"))
    try:
        chosen = list(args.only or CHOSEN)
        unknown = [name for name in chosen if name not in CHOSEN]
        if unknown:
            print(f"--only: {unknown} are not in CHOSEN (record.py)", file=sys.stderr)
            return 2
        reports = (
            workdir / "reports" if args.session else run_sessions(workdir, args.timeout, args.only)
        )
        found = first_reports(reports)
        missing = [name for name in chosen if name not in found]
        if missing:
            print(f"no hang report for {missing}: nothing written", file=sys.stderr)
            return 1
        if not args.only:
            for old in DATA.glob("*.json"):
                old.unlink()
        DATA.mkdir(exist_ok=True)
        total = 0
        for name in chosen:
            path = DATA / f"{name}.json"
            shutil.copyfile(found[name], path)  # as the plugin wrote it, byte for byte
            total += path.stat().st_size
        # the unit tier's conftest, not tests/conftest.py (put first on the path for test_stall)
        sys.modules.pop("conftest", None)
        sys.path.insert(0, str(HERE))
        from conftest import diagnosis_digest

        new_sources = sources([json.loads(found[name].read_text()) for name in chosen])
        if args.only:  # the others keep their digest and the sources they were recorded with
            machine = json.loads((DATA / "recording.json").read_text())
            machine.setdefault("digests", {}).update(dict.fromkeys(chosen, diagnosis_digest()))
            old_sources = machine["sources"]
            for name, text in new_sources.items():  # a library file: the longer of the two
                if len(text) > len(old_sources.get(name, "")):
                    old_sources[name] = text
        else:
            machine = {
                # the replay checks for an exact match only while this is the diagnosis code
                "diagnose_sha256": diagnosis_digest(),
                "python": sys.version.split()[0],
                "stdlib": os.path.realpath(sysconfig.get_paths()["stdlib"]),
                "sources": new_sources,
            }
        path = DATA / "recording.json"
        path.write_text(json.dumps(machine, indent=1) + "\n")
        total += path.stat().st_size
        print(f"wrote {len(chosen)} reports, {total / 1e6:.2f} MB, to {DATA}")
        return 0
    finally:
        if args.keep or args.session:
            print(f"session directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
