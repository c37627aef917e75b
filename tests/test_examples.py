"""The example suite runs as the README says: its deliberate hangs are caught, everything else passes."""

from __future__ import annotations

import fnmatch
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import GuardedRunner, assert_hang
from matrix_scenarios import LATE_S, SILENCE
from outcomes import assert_outcomes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: The README's main command uses this timeout; each deliberate hang sets a shorter one itself.
TIMEOUT_S = 20
#: The stall time test_freezes_after_a_while.py sets (a loaded machine may notice it LATE_S late).
STALL_S = 5.0
#: Everything (pytest and torch start-up, training, four hangs) takes about 50 s on 2 cores, and
#: 150 s with the rest of the suite and two CPU hogs beside it: the bound only catches a run that
#: sat out its deadlines.
WALL_BOUND_S = 420

#: examples/hangs/: each hangs on purpose and must be reported as a HANG, with these lines.
HANGS = {
    "test_workers_forked_while_a_thread_holds_the_cache_lock": [
        "HANG after 3.* 2 stuck in DataLoader worker __getitem__",
        "hint: 2 DataLoader worker(s) wait for a lock. A lock held by another thread when the "
        "workers were forked*multiprocessing_context='spawn'*",
        "*[[]DataLoader worker 0/2 (dataset CachedFakeData)[]]*",
        "*with _CACHE_LOCK:",
        "cleanup: killed 2 process(es)*",
    ],
    "test_parent_joins_producers_before_draining_their_queue": [
        "HANG after 3.* in hangs/test_queue_join.py::*",
        "hint: pid * joins a process that cannot exit until its multiprocessing Queue is flushed*",
        "*[[]queue feeder thread[]]*",
        "*in _finalize_join",
        "*producer.join()  # BUG*",
    ],
    "test_only_rank_zero_reduces_the_validation_metric": [
        "HANG after 3.* in torch_hang.distributed(epoch_end_with_a_rank_dependent_branch, "
        "world_size=2)*",
        "hint: ranks wait in different collectives (rank 0/2 in all_reduce, rank 1/2 in barrier)*",
        "*dist.all_reduce(metric)",
        "*dist.barrier()*",
    ],
}
#: examples/hangs/: stalls on purpose (no progress for its stall time, long before the timeout).
#: The silence a report names is measured: at least the stall time, and a little more when the
#: watchdog's check comes late on a loaded machine (CI saw 5.1 s for 5.0).
STALLS = {
    "test_the_third_epoch_never_starts": [
        "STALL after * no progress for *s (last: optimizer step *; before that *batches/s*",
        "hint: 2 DataLoader worker(s) wait for a lock*",
        "*with _LABELS_LOCK:",
    ],
}
#: Skipped by the main run: the hunt example runs only when hunting.
HUNT_EXAMPLES = {
    "test_a_child_forked_while_a_thread_holds_a_lock": "a rare hang: run it with --torch-hang-hunt=100",
    "test_two_children_count_on_a_shared_value": "a rare hang: run it with --torch-hang-hunt=100",
}
#: gpu(n) examples: skipped on a machine without GPUs, with the plugin's reason.
GPU_EXAMPLES = {
    "test_the_classic_loop_trains_on_one_gpu": "needs 1 CUDA GPU, found 0 *",
    "test_the_classic_loop_uses_data_parallel_on_two_gpus": "needs 2 CUDA GPUs, found 0 *",
    "test_two_ranks_take_the_same_ddp_step_on_two_gpus_with_nccl": "needs 2 CUDA GPUs, found 0 *",
}
PASSING = [
    "test_the_classic_loop_trains_in_the_test_process",
    "test_the_loader_of_the_classic_loop_yields_batches_from_four_workers",
    "test_the_classic_loop_trains_in_a_child_process",
    "test_the_model_overfits_one_batch",
    "test_two_ranks_take_the_same_ddp_step_on_their_own_shards",
    "test_workers_count_each_label_once_through_a_manager",
    "test_a_plain_dict_filled_by_workers_stays_empty_in_the_test",
    "test_the_census_of_a_child_process_counts_every_sample",
    "test_a_manager_lock_leaked_by_an_early_return_is_caught_as_a_hang",
]


def _outcomes(junit_xml: Path) -> dict[str, tuple[str, str, dict[str, str]]]:
    """test name -> (outcome, message, properties), read from the run's JUnit XML."""
    outcomes = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        properties = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome, message = tag, element.get("message", "")
                break
        outcomes[case.get("name", "")] = (outcome, message, properties)
    return outcomes


def test_the_examples_pass_and_their_deliberate_hangs_are_caught_with_hints(
    guarded: GuardedRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No GPU anywhere, even on a GPU runner: the gpu examples skip with a known reason here
    # (the GPU job of docs/ci.md runs them for real).
    monkeypatch.setenv("PYTEST_TORCH_HANG_FAKE_GPUS", "0")
    # The inner run is a plain pytest session, as in the README, even when this test runs on a
    # pytest-xdist worker: the worker's variables must not make it look like one.
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)
    junit_xml = guarded.pytester.path / "examples.xml"

    session = guarded.run(
        str(EXAMPLES), f"--junitxml={junit_xml}", timeout=TIMEOUT_S, wait_s=2 * WALL_BOUND_S
    )

    outcomes = _outcomes(junit_xml)
    assert sorted(outcomes) == sorted([*HANGS, *STALLS, *HUNT_EXAMPLES, *GPU_EXAMPLES, *PASSING]), (
        session.text[-3000:]
    )
    for name, expected in HANGS.items():
        outcome, message, properties = outcomes[name]
        assert (outcome, properties.get("torch_hang")) == ("failure", "true"), name
        assert message.startswith("HANG after 3."), message
        assert_hang(session, name, *expected)
        session.result.stdout.fnmatch_lines([f"HANG *{name}*"])  # the short test summary
    for name, expected in STALLS.items():
        outcome, message, properties = outcomes[name]
        assert (outcome, properties.get("torch_hang")) == ("failure", "true"), name
        assert message.startswith("STALL after "), message
        report = session.report_of(name)
        missing = [p for p in expected if not fnmatch.filter(report.splitlines(), p)]
        assert not missing, f"missing {missing} in:\n{report[:4000]}"
        silence = SILENCE.search(report)
        assert silence, report[:4000]
        assert STALL_S <= float(silence.group(1)) <= STALL_S + LATE_S, silence.group(0)
    for name, reason in {**GPU_EXAMPLES, **HUNT_EXAMPLES}.items():
        outcome, message, _ = outcomes[name]
        assert outcome == "skipped", (name, outcome, message[:2000])
        assert fnmatch.fnmatch(message, reason), (name, message)
    failed = {n: outcomes[n][:2] for n in PASSING if outcomes[n][0] != "passed"}
    assert not failed, f"examples that should pass did not: {failed}\n{session.text[-6000:]}"
    assert_outcomes(
        session.result,
        passed=len(PASSING),
        hang=len(HANGS),
        stall=len(STALLS),
        skipped=len(GPU_EXAMPLES) + len(HUNT_EXAMPLES),
    )
    session.result.stdout.fnmatch_lines(["*= torch-hang summary =*"])
    assert session.wall_s < WALL_BOUND_S, f"the example run took {session.wall_s:.0f}s"
    session.assert_clean()
