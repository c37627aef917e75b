"""The labelled corpus of real hangs: every hint rule scored right / wrong / silent; no wrong firing."""

from __future__ import annotations

import ast
import importlib.util
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import Session, batch_runner
from outcomes import assert_outcomes

pytestmark = [
    pytest.mark.needs_torch,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None, reason="needs torch, which is not installed"
    ),
]

CORPUS = Path(__file__).parent / "corpus"


@dataclass(frozen=True)
class Label:
    """What a scenario's report must say: the rules that may explain it (the first is the one
    expected; the others tell the same story from other evidence), facts the text of those
    hints must name, and a role among the processes they name (the stuck one, in user terms)."""

    rules: tuple[str, ...]
    facts: tuple[str, ...] = ()
    role: str = ""
    #: Rules that may fire without being expected, because they state what a process does and
    #: name no cause (a slow test that passes in the end: its processes compute, say).
    facts_only: tuple[str, ...] = ()


def _label(rules: str, *facts: str, role: str = "") -> Label:
    return Label(tuple(rules.split()), tuple(f.lower() for f in facts), role)


def _no_cause(facts_only: str = "") -> Label:
    """A test that is slow but would pass: no rule may claim a cause (a rule that fires counts
    as wrong), except those named here, which only say what a process does."""
    return Label((), facts_only=tuple(facts_only.split()))


LABELS: dict[str, Label] = {
    # data loading
    "test_loading_worker_stopped": _label(
        "stopped", "is stopped", "DataLoader's _try_get_data", role="DataLoader worker 0/2"
    ),
    "test_loading_workers_wait_for_an_event_set_after_the_first_batch": _label(
        "deadlock", "multiprocessing Event.wait()", role="DataLoader worker"
    ),
    "test_loading_iterable_worker_spins": _label(
        "busy", "Waiting for DataLoader worker 0/1", role="DataLoader worker 0/1"
    ),
    "test_loading_lock_held_at_fork": _label(
        "worker_lock", "held by another thread when the workers were forked", role="DataLoader"
    ),
    "test_loading_lock_taken_twice": _label(
        "worker_lock", "nothing in the worker will release", role="DataLoader worker"
    ),
    "test_loading_future_result_after_fork": _label(
        "nobody", "Future.result()", "not copied by fork", role="DataLoader worker 0/1"
    ),
    "test_loading_worker_reads_a_silent_pipe": _label(
        "pipe", "block reading a pipe", "its own copy", role="DataLoader worker 0/1"
    ),
    "test_loading_workers_leak_the_slots_of_a_shared_semaphore": _label(
        "leaked_slots",
        "self.slots.acquire()",
        "waits in dataloader's _try_get_data",
        "slots leaked",
        role="DataLoader worker",
    ),
    "test_loading_worker_sleeps": _label("sleeper", "sleeps at", role="DataLoader worker 0/1"),
    "test_loading_workers_wait_for_a_multiprocessing_lock_the_parent_holds": _label(
        "deadlock", "multiprocessing Lock.acquire()", role="DataLoader worker"
    ),
    "test_loading_workers_wait_for_a_file_lock_the_parent_holds": _label(
        "deadlock", "fcntl.flock", role="DataLoader worker"
    ),
    "test_loading_openmp_after_the_parent_ran_ops": _label(
        "openmp_after_fork", "OpenMP after fork", role="DataLoader worker 0/1"
    ),
    "test_loading_openmp_in_a_library_op_after_worker_init_raises_threads": _label(
        "openmp_after_fork", "OpenMP after fork", "worker_init_fn", role="DataLoader worker 0/1"
    ),
    "test_loading_openmp_in_tensor_methods_after_worker_init_raises_threads": _label(
        "openmp_after_fork", "OpenMP after fork", "worker_init_fn", role="DataLoader worker 0/1"
    ),
    "test_loading_worker_opens_a_fifo_nobody_writes": _label(
        "fifo",
        "blocked opening the FIFO",
        "nobody in the tree will ever open",
        role="DataLoader worker",
    ),
    "test_loading_batch_that_cannot_be_pickled": _label(
        "unpicklable_batch",
        "could not pickle the batch",
        "cannot pickle '_thread.lock'",
        role="DataLoader worker",
    ),
    # slow but passing, in the end: no rule may claim a cause
    "test_loading_slow_rate_limited_worker": _no_cause(),
    # data sharing and resources between processes
    "test_sharing_thread_join_while_holding_its_lock": _label(
        "nobody", "Thread.join()", role="pytest"
    ),
    "test_sharing_join_before_draining_a_queue": _label(
        "queue_join", "Drain the queue", role="multiprocessing"
    ),
    "test_sharing_manager_lock_leaked": _label(
        "manager", "Manager server is blocked", role="multiprocessing.Process(target=_census)"
    ),
    "test_sharing_pool_map_worker_killed": _label(
        "pool_lost", "Pool.map()", "Pool workers are idle", role="Pool worker"
    ),
    "test_sharing_child_waits_for_an_event_the_parent_sets_after_join": _label(
        "join_cycle deadlock",
        "multiprocessing Event.wait()",
        "Process.join()",
        role="multiprocessing",
    ),
    "test_sharing_threading_event_in_a_forked_child": _label(
        "nobody", "Event.wait()", "only thread of its process", role="multiprocessing"
    ),
    "test_sharing_child_reads_a_pipe_it_never_closed": _label(
        "pipe", "itself (its own copy)", role="multiprocessing.Process(target=_read_all)"
    ),
    "test_sharing_popen_wait_while_the_child_reads_stdin": _label(
        "join_cycle pipe", "Popen.wait()", "Close child.stdin", role="Python child"
    ),
    "test_sharing_popen_child_stopped": _label(
        "stopped", "is stopped", "Popen.wait()", role="Python child"
    ),
    "test_sharing_child_died_before_sending": _label(
        "dead pipe nobody", "exited with code 3", role="exited child"
    ),
    "test_sharing_two_children_take_two_file_locks_in_opposite_order": _label(
        "deadlock", "fcntl.flock", role="multiprocessing.Process(target=_lock_both)"
    ),
    "test_sharing_file_lock_held_by_a_sleeping_child": _label(
        "sleeper", "the lock it holds", role="multiprocessing.Process(target=_hold)"
    ),
    "test_sharing_popen_communicate_with_a_sleeping_child": _label(
        "sleeper", "Popen.communicate()", role="Python child"
    ),
    "test_sharing_the_test_itself_sleeps": _label(""),  # nothing to explain: no hint may fire
    "test_sharing_output_read_to_its_end_while_a_background_grandchild_holds_it": Label(
        ("output_held",),
        ("popen.communicate()", "the pipe's eof", "inherits the child's output pipe"),
        role="Python child",
        facts_only=("dead",),
    ),
    "test_sharing_popen_wait_with_a_full_stdout_pipe": _label(
        "full_pipe",
        "Popen.wait()",
        "blocked writing to its stdout",
        "a pipe that is full",
        "communicate()",
        role="Python child",
    ),
    "test_sharing_join_a_child_blocked_on_a_full_bounded_queue": _label(
        "join_cycle deadlock",
        "multiprocessing Queue.put()",
        "Process.join()",
        role="target=_put_two",
    ),
    "test_sharing_a_service_that_never_answers": _label(
        "outside", "no process of this test", "conn.recv(1)", role="pytest"
    ),
    "test_sharing_barrier_for_more_parties_than_processes": _label(
        "deadlock", "Barrier.wait()", role="target=_meet"
    ),
    # the cycle is named through all three, with the write the test makes only after its join
    "test_sharing_join_chain_back_to_the_test": _label(
        "join_cycle",
        "a cycle of waits through 3 processes: pytest",
        "-> multiprocessing.process(target=_join_a_reader)",
        "-> multiprocessing.process(target=_read_from_the_test)",
        "only after its join",
        "os.write(write_fd",
        role="target=_read_from_the_test",
    ),
    "test_sharing_slow_supervisor_polling_healthy_children": _no_cause("busy"),
    # classes of wait, named in the user's words (corpus_waits.py): a worker that exits while
    # the others wait may stay a zombie, whose fact (dead) may be told beside
    "test_waits_semaphore_slots_leak_on_an_early_return": Label(
        ("leaked_slots",),
        (
            "slots.acquire()",
            "multiprocessing semaphore",
            "as a boundedsemaphore",
            "count is 0",
            "slots leaked",
            "with slots:",
        ),
        role="target=_work",
        facts_only=("dead",),
    ),
    "test_waits_threading_semaphore_slots_leak_on_an_early_return": _label(
        "leaked_slots",
        "slots.acquire()",
        "threading Semaphore",
        "as a BoundedSemaphore",
        "slots leaked",
        role="pytest",
    ),
    "test_waits_one_end_marker_for_two_consumers": Label(
        ("end_marker",),
        ("queue.get()", "end-of-stream marker", "if item is none", "one marker per consumer"),
        role="target=_consume",
        facts_only=("dead",),
    ),
    "test_waits_popen_wait_with_a_full_stderr_pipe": _label(
        "full_pipe", "Popen.wait()", "writing to its stderr", "communicate()", role="Python child"
    ),
    "test_waits_spins_for_a_file_a_failed_producer_never_writes": Label(
        ("poll_dead",),
        ("polls a file's existence", "os.path.exists(flag)", "exited with code 1", "valueerror"),
        role="pytest",
        facts_only=("dead",),
    ),
    "test_waits_spins_on_a_shared_value_a_failed_producer_never_sets": Label(
        ("poll_dead",),
        ("polls a shared value", "counter.value", "exited with code 1"),
        role="pytest",
        facts_only=("dead",),
    ),
    "test_waits_recv_from_a_server_that_accepted_and_never_answers": _label(
        "no_answer",
        "the server at 127.0.0.1:",
        "accepted the connection and never answered",
        "with no timeout",
        role="target=_service",
    ),
    "test_waits_fork_child_imports_a_module_a_parent_thread_was_importing": _label(
        "import_lock_at_fork",
        "import torchhang_corpus_slow_module",
        "for the import lock of torchhang_corpus_slow_module",
        "thread 'thread-",
        "spawn",
        role="target=_import_the_slow_module",
    ),
    "test_waits_join_chain_to_a_sentinel_sent_after_the_join": _label(
        "join_cycle",
        "a cycle of waits through 3 processes: pytest",
        "target=_start_and_join",
        "queue.put(none)",
        role="target=_wait_for_the_stop",
    ),
    # the same classes, written another way
    "test_waits_two_consumers_iterate_to_a_sentinel_put_once": Label(
        ("end_marker",),
        ("iter(queue.get, none)", "the queue is empty", "one marker per consumer"),
        role="target=_consume_until_the_sentinel",
        facts_only=("dead",),
    ),
    "test_waits_recv_from_a_server_thread_of_the_test_that_never_answers": _label(
        "no_answer", "served by thread 'stub-server' of pytest", "with no timeout", role="pytest"
    ),
    "test_waits_polls_with_a_sleep_for_a_file_a_failed_producer_never_writes": Label(
        ("poll_dead",),
        ("sleeps between looks", "polls a file's existence", "exited with code 1"),
        role="pytest",
        facts_only=("dead",),
    ),
    "test_waits_fork_child_imports_by_name_a_module_a_parent_thread_was_importing": _label(
        "import_lock_at_fork",
        "for the import lock of torchhang_corpus_slow_module_by_name",
        "thread 'late-importer'",
        role="target=_import_by_name",
    ),
    # the same classes, where what could end the wait waits for the waiter (issue 28)
    "test_waits_fork_child_imports_a_module_named_by_a_variable_a_parent_thread_imported": _label(
        "import_lock_at_fork",
        "importlib.import_module(name)",
        "for the import lock of the module that `name` names",
        "fork copies the lock held but not the thread",
        role="target=_import_named",
    ),
    "test_waits_semaphore_slot_held_by_a_retry_while_the_test_reads_results": Label(
        ("leaked_slots",),
        ("slots.acquire()", "holds a slot itself, lower in its own stack", "slots leaked"),
        role="target=_read_shards",
        facts_only=("dead",),
    ),
    "test_waits_one_end_marker_for_two_consumers_whose_counts_the_test_reads": Label(
        ("end_marker",),
        ("if item is none", "connection.recv()", "itself", "one marker per consumer"),
        role="target=_count_until_the_marker",
        facts_only=("dead",),
    ),
    # not a leak: the test holds the slot across its join (leaked_slots must stay silent)
    "test_waits_semaphore_held_by_the_test_while_it_joins": _label(
        "join_cycle deadlock",
        "holds it across its join",
        "with slots:",
        "release it before joining",
        role="target=_handle",
    ),
    # inside multiprocessing's start-up (corpus_startup.py): blocked, never "still starting"
    "test_startup_spawned_loader_worker_imports_a_module_that_waits_for_the_tests_lock": _label(
        "deadlock", "fcntl.flock", "DataLoader's _try_get_data", role="multiprocessing child"
    ),
    "test_startup_pool_forks_a_replacement_while_the_test_holds_a_lock": _label(
        "nobody", "with CACHE:", "threads are not copied by fork", role="Pool worker"
    ),
    "test_startup_executor_worker_initializer_waits_for_the_tests_lock": _label(
        "deadlock", "fcntl.flock", "Future.result()", role="target=_process_worker"
    ),
    "test_startup_pool_replaces_a_worker_that_waits_for_the_tests_lock": _label(
        "deadlock", "fcntl.flock", "AsyncResult.get()", role="multiprocessing child"
    ),
    "test_startup_spawned_child_of_a_script_runs_its_top_level_that_waits_for_its_lock": _label(
        "deadlock", "Process.join()", "fcntl.flock", role="multiprocessing child"
    ),
    # waits a signal or an alarm would still end (corpus_signals.py): the hint says which, and
    # what is missing, never "nothing can end that wait"
    "test_signals_worker_ended_by_sigterm_joined_without_terminate": _label(
        "nobody",
        "event.wait()",
        "a sigterm would run its python handler (a lambda in _serve_until_terminated)",
        "nobody sends one",
        "process.join()",
        "no terminate()",
        role="target=_serve_until_terminated",
    ),
    "test_signals_test_under_its_own_alarm_hangs_on_a_lock": _label(
        "nobody",
        "lock.acquire()",
        "its own alarm (signal.alarm or setitimer) is due in",
        "its python handler _expire()",
        role="pytest",
    ),
    # an idle, healthy HTTP server beside the test's own deadlock: the test is the story
    "test_signals_idle_http_server_beside_a_test_deadlocked_on_its_lock": _label(
        "nobody", "lock.acquire()", role="pytest"
    ),
    "test_signals_idle_http_server_thread_beside_a_test_deadlocked_on_its_lock": _label(
        "nobody",
        "lock.acquire()",
        "idle services that only wait for work",
        "thread 'http-server' in serve_forever, for a client of 127.0.0.1:",
        role="pytest",
    ),
    # an executor's idle workers (processes, threads) wait for work: not the story
    "test_signals_idle_process_pool_beside_a_test_deadlocked_on_its_lock": _label(
        "nobody",
        "lock.acquire()",
        "idle services that only wait for work",
        "in wait_result_broken_or_wakeup",
        role="pytest",
    ),
    "test_signals_idle_thread_pool_beside_a_test_deadlocked_on_its_lock": _label(
        "nobody",
        "lock.acquire()",
        "idle services that only wait for work",
        "thread 'threadpoolexecutor-",  # its number counts the session's executors
        "in _worker",
        role="pytest",
    ),
    # no stack (its descriptors closed, the dump handler's too): what the kernel shows, and why
    "test_signals_setsid_daemon_child_with_closed_descriptors_reads_forever": _label(
        "nobody",
        "the system call read(",
        "no python stack: the process closed or replaced its dump file",
        "the only write end of the pipe it reads is its own",
        "by its default action",
        role="child process",
    ),
    # distributed: gloo ranks
    "test_distributed_ddp_uneven_inputs": _label(
        "collectives", "rank 1/2 in barrier", "Flight recorder", "from DDP's forward", role="rank"
    ),
    "test_distributed_ddp_head_skipped_on_one_rank": _label(
        "collectives", "from DDP's backward", "rank 1/2 in barrier", role="rank"
    ),
    "test_distributed_different_collectives": _label(
        "collectives", "rank 0/2 in all_reduce, rank 1/2 in barrier", "is in #2", role="rank"
    ),
    "test_distributed_rank_never_reaches_the_collective": _label(
        "collectives", "rank 1/2 at _late", role="rank"
    ),
    "test_distributed_file_lock_cycle": _label(
        "collectives", "fcntl.flock", "a cycle", role="rank 0/2"
    ),
    "test_distributed_both_ranks_receive": _label(
        "collectives", "wait in recv and none sends", role="rank"
    ),
    # a send/recv pair is not a collective: its hint names each side's peer and tag
    "test_distributed_send_and_recv_never_match": _label(
        "collectives", "send and recv do not match", "dst=1, tag=1", "src=0, tag=2", role="rank"
    ),
    # the dead rank is a zombie until its parent joins it, if nothing reaps it first: then
    # only the rendezvous that waits for it remains to tell
    "test_distributed_rank_died_before_init": _label(
        "dead collectives", "init_process_group", role="_rank_main"
    ),
    # torchrun's agent polls ranks that are stuck: a link of the chain, not a sleeper to blame
    "test_distributed_torchrun_ranks_diverge": Label(
        ("collectives",),
        ("rank 0/2 in all_reduce, rank 1/2 in barrier",),
        role="(torchrun)",
        facts_only=("busy",),  # the agent may still be busy starting its monitor
    ),
    "test_distributed_slow_rank_computes": _no_cause("busy"),
    # ranks started as PyTorch's MultiProcessTestCase starts them: known by their process group
    "test_distributed_plain_process_ranks_one_skips_an_all_reduce": _label(
        "collectives",
        "rank 1/2 went past the all_reduce",
        "(under `if rank == 0:`)",
        "that rank 0/2 waits in as #2, and is at #2 barrier",
        role="rank 1/2 (gloo)",
    ),
    "test_distributed_plain_process_ranks_in_different_collectives": _label(
        "collectives",
        "rank 0/2 in all_reduce, rank 1/2 in broadcast",
        "is in #2 broadcast",
        role="rank 0/2 (gloo)",
    ),
    # the workers of two ranks say whose they are; the rank in no collective waits for its own
    "test_distributed_plain_process_rank_waits_for_its_dataloader_worker": _label(
        "collectives sleeper",
        "wait in all_reduce for a rank that is not in a collective",
        "waits in DataLoader's _try_get_data",
        "for rank 1's DataLoader worker 0/1 (dataset _Shards)",
        "which sleeps at",
        role="rank 1/2 (gloo)",
    ),
    # slow, not stuck: the rank that sets the key still computes
    "test_distributed_plain_process_rank_waits_for_a_key_a_computing_rank_sets_later": _no_cause(
        "busy"
    ),
    "test_distributed_plain_process_ranks_wait_for_a_store_key_nobody_sets": Label(
        ("store_key",),
        (
            "rank 0/2 waits in store.get('ready_2')",
            "no process set 'ready_2'",
            "rank 1/2 waits in store.get('ready_3')",
            "keys set: 'ready_0', 'ready_1'",
        ),
        role="rank 1/2 (gloo)",
    ),
    # what differs between the ranks: a key's part made on each rank, a group made on one
    "test_distributed_plain_process_rank_waits_for_a_key_named_from_its_own_value": Label(
        ("store_key", "collectives"),
        (
            "rank 1/2 waits in store.get('runs/",
            "the key is named from a value the ranks do not share",
            "differs from rank 0/2's `run_name`",
            "the closest names set: 'runs/",
        ),
        role="rank 1/2 (gloo)",
    ),
    "test_distributed_plain_process_ranks_build_a_group_on_one_rank_only": _label(
        "collectives",
        "new_group() must be called by every rank of the default group",
        "ranks match groups by how many each created before",
        role="rank 0/2 (gloo)",
    ),
}


def _reports(folder: Path) -> dict[str, dict[str, Any]]:
    """The first hang report of each test, by test name."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        doc = json.loads(path.read_text())
        name = doc["test_id"].split("::")[-1]
        if name not in out or doc["created"] < out[name]["created"]:
            out[name] = doc
    return out


def _score(label: Label, doc: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """(rule, verdict, why): right or wrong for every rule that fired, silent when none of the
    label's rules did (counted under its first rule)."""
    fired = [h for h in (doc or {}).get("hints", []) if h["rule"] != "none"]
    fired = [h for h in fired if h["rule"] not in label.facts_only]
    out = [(h["rule"], "wrong", h["text"][:300]) for h in fired if h["rule"] not in label.rules]
    good = [h for h in fired if h["rule"] in label.rules]
    if label.rules and not good:
        return [*out, (label.rules[0], "silent", "no hang report" if doc is None else "")]
    text = " ".join(h["text"] for h in good).lower()
    roles = {p["pid"]: p["role"] for p in (doc or {}).get("processes", [])}
    named = {roles.get(pid, "") for h in good for pid in h["pids"]}
    missing = [fact for fact in label.facts if fact not in text]
    for rule in dict.fromkeys(h["rule"] for h in good):
        if missing:
            out.append((rule, "wrong", f"the hint does not say {missing}: {text[:300]}"))
        elif label.role and not any(label.role in role for role in named):
            out.append((rule, "wrong", f"it names {sorted(named)}, no {label.role!r}"))
        else:
            out.append((rule, "right", ""))
    return out


def _scenarios() -> dict[str, str]:
    """Every scenario of the corpus files, by test name: the node id of its inner test."""
    out: dict[str, str] = {}
    for path in sorted(CORPUS.glob("corpus_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                out[node.name] = f"test_{path.stem}.py::{node.name}"
    return out


#: Each scenario's deadline, by corpus file: data loading and sharing are stuck within a few
#: tenths of a second on an idle machine (forks of a parent that imported torch, Python children
#: without torch), but beside the rest of the suite a worker forked at 2 s could still be
#: starting (seen: a worker using CPU at the capture, told "busy"): 3 s leaves the margin;
#: gloo ranks first meet through their store and build DDP models.
#: The start-up scenarios set their own (a spawned DataLoader worker imports torch first).
DEADLINE_S = {
    "loading": 3.0,
    "sharing": 3.0,
    "distributed": 3.0,
    "waits": 3.0,
    "startup": 3.0,
    "signals": 3.0,
}

#: Scenarios run per inner session: each hangs until its deadline, so a chunk takes about
#: half a minute, while each session's start (pytest, the plugin, torch: 2-3 s) is paid only a
#: few times.
CHUNK = 9
#: Chunks' sessions run at the same time (``chunk_sessions``): each mostly waits for its
#: deadlines (torch is imported at collection, before a scenario's clock starts). Not more: a
#: rank that computes must get the CPU to be seen busy (seen, at load 8 with six at once: a
#: computing rank taken for one stuck before its collective).
AT_ONCE = 2


def _chunks() -> dict[str, list[str]]:
    """The scenarios split into chunks of at most CHUNK, each of one corpus file, in file order."""
    by_file: dict[str, list[str]] = {}
    for name, node_id in _scenarios().items():
        by_file.setdefault(node_id.split("::")[0], []).append(name)
    out: dict[str, list[str]] = {}
    for file, names in by_file.items():
        count = -(-len(names) // CHUNK)
        for k in range(count):
            kind = file.removeprefix("test_corpus_").removesuffix(".py")
            out[f"{kind}-{k + 1}of{count}"] = names[
                k * len(names) // count : (k + 1) * len(names) // count
            ]
    return out


def test_every_scenario_of_the_corpus_is_labelled_and_every_label_has_its_scenario() -> None:
    scenarios = set(_scenarios())
    assert scenarios == set(LABELS), (
        f"scenarios without a label: {sorted(scenarios - set(LABELS))}; "
        f"labels without a scenario: {sorted(set(LABELS) - scenarios)}"
    )
    assert len(scenarios) >= 30  # the corpus the rules are scored on stays broad
    chunks = _chunks().values()
    assert sorted(n for chunk in chunks for n in chunk) == sorted(scenarios)
    assert all(0 < len(chunk) <= CHUNK for chunk in chunks)


@pytest.fixture(scope="module")
def chunk_sessions(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Session, Path]]:
    """Every chunk's session and its report directory; the sessions share the corpus files."""
    scenarios = _scenarios()
    with batch_runner(request, tmp_path_factory) as guarded:
        files = {f"test_{p.stem}": p.read_text() for p in sorted(CORPUS.glob("corpus_*.py"))}
        guarded.pytester.makepyfile(**files)
        reports = {chunk: guarded.pytester.path / f"reports-{chunk}" for chunk in _chunks()}
        args = {
            chunk: (
                f"--torch-hang-timeout={DEADLINE_S[chunk.split('-')[0]]}",
                f"--torch-hang-report-dir={reports[chunk]}",
                *(scenarios[n] for n in names),
            )
            for chunk, names in _chunks().items()
        }
        sessions = guarded.run_many(args, at_once=AT_ONCE, timeout=None, wait_s=600)
    return {chunk: (sessions[chunk], reports[chunk]) for chunk in _chunks()}


@pytest.mark.parametrize("chunk", list(_chunks()))
def test_every_rule_is_right_or_silent_on_the_corpus_of_real_hangs(
    chunk_sessions: dict[str, tuple[Session, Path]], chunk: str
) -> None:
    names = _chunks()[chunk]
    session, reports = chunk_sessions[chunk]
    docs = _reports(reports)
    # every scenario hangs, and is reported once as the hang of its own test
    assert_outcomes(session.result, hang=len(names))
    assert sorted(docs) == sorted(names)

    table: dict[str, Counter[str]] = {}
    wrong: list[str] = []
    silent: list[str] = []
    for name in names:
        label = LABELS[name]
        fired = [h["rule"] for h in docs[name].get("hints", [])]
        print(f"{name:<72} expected {' or '.join(label.rules) or 'nothing'}; fired {fired}")
        for rule, verdict, why in _score(label, docs[name]):
            table.setdefault(rule, Counter())[verdict] += 1
            if verdict == "wrong":
                wrong.append(f"{name}: {rule}: {why}")
            elif verdict == "silent":
                silent.append(name)
    lines = [f"{'rule':<20} {'right':>5} {'wrong':>5} {'silent':>6}"]
    for rule, counts in sorted(table.items()):
        lines.append(f"{rule:<20} {counts['right']:>5} {counts['wrong']:>5} {counts['silent']:>6}")
    print("\n".join(lines))
    print(f"{len(names)} scenarios, {len(docs)} hang reports, wall {session.wall_s:.0f}s")
    if "test_loading_worker_stopped" in names:
        # a stopped worker's facts are read before the capture continues it (and the kill)
        (stopped,) = [
            p
            for p in docs["test_loading_worker_stopped"]["processes"]
            if p["state"].startswith("stop")
        ]
        assert stopped["ppid"] > 0 and stopped["rss_bytes"] > 0 and stopped["num_threads"] >= 1
    assert not wrong, "\n".join(wrong)
    assert not silent, f"no rule explained {silent}:\n" + "\n".join(lines)
    session.assert_clean()
