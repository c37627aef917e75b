"""Hunting the corpus's rare races: each hangs often under stress and stays rare without it.

Each race is one hunted inner session of 40 runs (20 stressed, 20 plain) whose hung runs wait
out their deadline: the sessions mostly wait, so they run two at a time in one batch
(``races``), and each race's test reads its own session. Stress delays its own processes with
sleeps, not work, so a session beside it sees no more load than a neighbour xdist worker gives.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import Session, batch_runner

RARE = (Path(__file__).parent / "corpus" / "corpus_rare.py").read_text()
RACES = (
    "rare_lost_update_on_a_shared_value",
    "rare_lost_notify_between_threads",
    "rare_child_says_ready_before_it_is",
    "rare_child_exits_before_its_queue_is_flushed",
    "rare_check_then_act_on_a_shared_queue",
    "rare_lost_wakeup_of_a_flag_checked_outside_its_lock",
)
#: Runs of each kind per rare race (the odd runs of the hunt are stressed, the even ones plain).
RUNS_EACH = 20
#: Hunted sessions at the same time. Three at a time at load average 8 saw 3 plain hangs of 20
#: for the check-then-act race (the bound is 4): two keep the margin.
AT_ONCE = 2
_RATE = re.compile(r"^\s+(plain|stressed): hung (\d+) of (\d+) runs", re.M)


def _summary(session_text: str) -> str:
    return session_text.split("= torch-hang hunt =")[1].split("torch-hang summary")[0]


@pytest.fixture(scope="module")
def races(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Session]:
    """Each race's hunted session, by race."""
    with batch_runner(request, tmp_path_factory) as guarded:
        guarded.pytester.makepyfile(test_corpus_rare=RARE)
        hunt = (
            "-p",
            "no:randomly",
            "-o",
            "python_functions=rare_*",
            f"--torch-hang-hunt={2 * RUNS_EACH}",
            "--torch-hang-hunt-stress",
            "--torch-hang-hunt-all",
        )
        sessions = {race: (f"test_corpus_rare.py::{race}", *hunt) for race in RACES}
        return guarded.run_many(sessions, at_once=AT_ONCE, timeout=1.5, wait_s=300)


@pytest.mark.parametrize("race", RACES)
def test_a_rare_race_hangs_often_under_stress_and_stays_rare_without_it(
    races: dict[str, Session], race: str
) -> None:
    session = races[race]
    out = session.result.stdout.str()
    assert "INTERNALERROR" not in out, out[-3000:]
    rates = {kind: (int(hung), int(runs)) for kind, hung, runs in _RATE.findall(_summary(out))}
    assert rates["plain"][1] == rates["stressed"][1] == RUNS_EACH, rates
    plain, stressed = rates["plain"][0], rates["stressed"][0]
    # bounds loose enough for a loaded machine: the bench measures the rates themselves
    assert stressed >= RUNS_EACH // 4 and stressed >= plain + 3, rates
    assert plain <= RUNS_EACH // 5, rates
    # each hang says its run, and a stressed one its seed and how to replay it
    assert out.count("stressed with seed ") >= stressed, out[-3000:]
    # the user's stacks, without stress's wrappers around their calls (cut as pytest's are)
    assert "pytest_torchhang/inject/stress.py" not in out, out[-3000:]
    session.assert_clean()
