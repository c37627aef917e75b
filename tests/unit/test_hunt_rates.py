"""A hunt's figures: the plain and the stressed rate with their intervals, what stress costs,
and the seeded schedules behind a stressed run (pure: no process is stressed here)."""

from __future__ import annotations

import pytest

from pytest_torchhang.hunt import Hunted, Tally, run_seed
from pytest_torchhang.inject import stress
from pytest_torchhang.report.hunts import pressure_lines, rate


def test_a_rate_says_its_count_share_and_wilson_interval() -> None:
    assert rate(0, 20) == "hung 0 of 20 runs (0.0%, 95% CI 0.0%-16.1%)"
    assert rate(13, 20) == "hung 13 of 20 runs (65.0%, 95% CI 43.3%-81.9%)"


def test_both_rates_and_the_cost_of_stress_are_given_when_both_ran() -> None:
    lines = pressure_lines((0, 20, 0.021), (13, 20, 0.092))
    assert lines == [
        "plain: hung 0 of 20 runs (0.0%, 95% CI 0.0%-16.1%)",
        "stressed: hung 13 of 20 runs (65.0%, 95% CI 43.3%-81.9%)",
        "a passing stressed run took 0.092s, a plain one 0.021s: 4.4x as long",
    ]


def test_the_cost_is_not_guessed_without_a_passing_run_of_each_kind() -> None:
    lines = pressure_lines((0, 2, 0.02), (2, 2, None))
    assert lines[-1] == "no passing run of each kind to say how much slower stress is"


def test_a_kind_that_did_not_run_is_left_out() -> None:
    assert pressure_lines((0, 0, None), (1, 4, 0.1)) == [
        "stressed: hung 1 of 4 runs (25.0%, 95% CI 4.6%-69.9%)"
    ]


def test_a_plain_hunt_says_nothing_of_stress() -> None:
    hunted = Hunted("t.py::test_x", planned=4, runs=4, plain=Tally(runs=4, passed=4))
    assert hunted.pressure() == []
    assert hunted.to_json()["stressed"]["runs"] == 0


def test_a_run_seed_is_the_same_for_every_worker_and_differs_by_run_and_test() -> None:
    assert run_seed(7, "t.py::test_x", 3) == run_seed(7, "t.py::test_x", 3)
    seeds = {run_seed(7, "t.py::test_x", n) for n in range(1, 50)}
    assert len(seeds) == 49
    assert run_seed(7, "t.py::test_y", 3) != run_seed(7, "t.py::test_x", 3)


def _decisions(
    monkeypatch: pytest.MonkeyPatch, seed: int, process: str, thread: str
) -> list[float]:
    monkeypatch.setattr(stress._State, "seed", seed)
    monkeypatch.setattr(stress._State, "identity", process)
    schedule = stress._Schedule(thread)
    return [schedule.decide(weight) for weight in (stress.LIGHT, stress.HEAVY) * 50]


def test_a_thread_schedule_is_a_function_of_seed_process_and_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = _decisions(monkeypatch, 4242, "0.1", "main")
    assert first == _decisions(monkeypatch, 4242, "0.1", "main")
    assert first != _decisions(monkeypatch, 4243, "0.1", "main")
    assert first != _decisions(monkeypatch, 4242, "0.2", "main")
    assert first != _decisions(monkeypatch, 4242, "0.1", "t1")


def test_every_wait_of_a_schedule_is_bounded_and_some_points_only_yield(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits = [w for seed in range(20) for w in _decisions(monkeypatch, seed, "0", "main")]
    assert max(waits) <= stress.MAX_DELAY_S
    assert any(w > 0 for w in waits) and 0.0 in waits and -1.0 in waits


@pytest.mark.parametrize(
    ("argv", "place"),
    [
        (["-c", "--multiprocessing-fork"], ""),  # multiprocessing's spawn: named by its parent
        (["-c"], ".xc1"),  # resource_tracker
        (["/tmp/abc/run_me.py", "--out", "/tmp/x"], ".xrunmepy3"),  # no path in the place
    ],
)
def test_an_interpreter_its_parent_did_not_name_takes_its_command_lines_shape(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], place: str
) -> None:
    monkeypatch.setattr("sys.argv", argv)
    assert stress._exec_place() == place
