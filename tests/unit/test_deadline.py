"""The deadline model, driven by tables of events: every transition, and every pair of sources
in both orders (whichever is due first fires)."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from pytest_torchhang import deadline as dl
from pytest_torchhang.deadline import Action, Kind, Phase, Source

INF = dl.INF


@dataclass
class Fired:
    at: float
    kind: Kind
    source: Source


def simulate(
    state: dl.State,
    schedule: list[tuple[float, dl.Event]],
    until: float,
    running: bool = True,
) -> tuple[dl.State, list[Fired], list[tuple[float, Action]]]:
    """Run the model as the watchdog does: wake at each decision's wake time and at each
    scheduled event; a FIRE's capture completes at once. Returns the fires and every action."""
    if running:
        state, _ = dl.decide(state, dl.PhaseStarted("call"), state.started)
    events = sorted(schedule, key=lambda pair: pair[0])
    now = state.started
    state, decision = dl.decide(state, dl.Tick(), now)
    fires: list[Fired] = []
    actions: list[tuple[float, Action]] = []
    for _ in range(100_000):
        if decision.action is not None:
            actions.append((now, decision.action))
            if decision.action is Action.FIRE:
                assert decision.kind is not None and decision.source is not None
                fires.append(Fired(now, decision.kind, decision.source))
                state, decision = dl.decide(state, dl.CaptureDone(), now)
                continue
        else:
            assert decision.wake > now, f"no action, yet look again at {decision.wake} <= {now}"
        next_event = events[0][0] if events else INF
        wake = decision.wake if decision.action is None else now
        at = min(wake, next_event, until)
        if at >= until and next_event >= until and wake >= until:
            return state, fires, actions
        now = max(at, now)
        if events and events[0][0] <= now:
            _, event = events.pop(0)
            state, decision = dl.decide(state, event, now)
        else:
            state, decision = dl.decide(state, dl.Tick(), now)
    raise AssertionError("the model spun: 100000 decisions without time moving on")


def beats(start: float, end: float, every: float) -> list[tuple[float, dl.Event]]:
    count = int((end - start) / every)
    return [(start + i * every, dl.Progress(start + i * every)) for i in range(count)]


# --- one source at a time -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("limits", "stall", "fires_at", "kind", "source"),
    [
        ({Source.TIMEOUT: 6.0}, 0.0, 6.0, Kind.HANG, Source.TIMEOUT),
        ({Source.PYTEST_TIMEOUT: 4.0}, 0.0, 4.0, Kind.HANG, Source.PYTEST_TIMEOUT),
        ({}, 3.0, 3.0, Kind.STALL, Source.STALL),
        ({Source.TIMEOUT: 0.0}, 0.0, None, None, None),  # 0 is off
    ],
)
def test_a_single_source_fires_at_its_due_time(
    limits: dict[Source, float],
    stall: float,
    fires_at: float | None,
    kind: Kind | None,
    source: Source | None,
) -> None:
    state = dl.start(100.0, limits, stall)
    _, fires, _ = simulate(state, [], until=200.0)
    if fires_at is None:
        assert fires == []
    else:
        assert fires[0] == Fired(100.0 + fires_at, kind, source)  # type: ignore[arg-type]


def test_nothing_is_due_before_the_earliest_source() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 5.0}, stall_s=2.0)
    state, decision = dl.decide(state, dl.Tick(), 1.0)
    assert decision == dl.Decision(None, 2.0)  # the stall time comes first
    state, decision = dl.decide(state, dl.Progress(1.5), 1.9)
    assert decision == dl.Decision(None, 3.5)  # progress moved the stall time
    assert state.phase is Phase.ARMED


# --- every pair of sources, both orders ----------------------------------------------------


def _sources_pair(
    first: str, second: str, t_first: float, t_second: float
) -> tuple[dl.State, list[tuple[float, dl.Event]]]:
    """A test whose ``first`` source is due at ``t_first`` and ``second`` at ``t_second``."""
    limits: dict[Source, float] = {}
    stall = 0.0
    schedule: list[tuple[float, dl.Event]] = []
    for name, at in ((first, t_first), (second, t_second)):
        if name == "timeout":
            limits[Source.TIMEOUT] = at
        elif name == "pytest-timeout":
            schedule.append((0.0, dl.SetLimit(Source.PYTEST_TIMEOUT, at)))  # its hook, later
        elif name == "stall":
            stall = at
    state = dl.start(0.0, limits, stall)
    return state, schedule


SOURCES = ("timeout", "pytest-timeout", "stall")
EXPECTED_SOURCE = {
    "timeout": (Kind.HANG, Source.TIMEOUT),
    "pytest-timeout": (Kind.HANG, Source.PYTEST_TIMEOUT),
    "stall": (Kind.STALL, Source.STALL),
}


@pytest.mark.parametrize(("first", "second"), list(itertools.permutations(SOURCES, 2)))
def test_whichever_source_is_due_first_fires(first: str, second: str) -> None:
    state, schedule = _sources_pair(first, second, 3.0, 6.0)
    _, fires, _ = simulate(state, schedule, until=60.0)
    assert fires[0] == Fired(3.0, *EXPECTED_SOURCE[first])
    assert len(fires) == 1  # the later source never fires a second report


def test_a_tie_between_a_limit_and_the_stall_time_is_a_hang() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 5.0}, stall_s=5.0)
    _, fires, _ = simulate(state, [], until=60.0)
    assert fires[0] == Fired(5.0, Kind.HANG, Source.TIMEOUT)


def test_progress_that_goes_on_leaves_the_timeout_to_fire() -> None:
    """Issue 15, 2: timeout 6 s and stall 3 s with a beat every 50 ms: the timeout fires at 6 s,
    and the model never asks to be looked at in the past (the watchdog spun)."""
    state = dl.start(0.0, {Source.TIMEOUT: 6.0}, stall_s=3.0)
    _, fires, _ = simulate(state, beats(0.05, 30.0, 0.05), until=30.0)
    assert fires == [Fired(6.0, Kind.HANG, Source.TIMEOUT)]


def test_progress_that_stops_fires_the_stall_before_the_timeout() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 20.0}, stall_s=3.0)
    _, fires, _ = simulate(state, beats(0.05, 5.0, 0.05), until=30.0)
    assert len(fires) == 1
    assert fires[0].kind is Kind.STALL
    assert fires[0].at == pytest.approx(4.95 + 3.0)


def test_a_later_limit_of_the_same_source_replaces_the_earlier() -> None:
    state = dl.start(0.0, {Source.PYTEST_TIMEOUT: 3.0})
    state, _ = dl.decide(state, dl.SetLimit(Source.PYTEST_TIMEOUT, 10.0), 1.0)
    _, fires, _ = simulate(state, [], until=60.0)
    assert fires[0].at == 11.0


def test_clearing_a_limit_leaves_the_others() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 9.0, Source.PYTEST_TIMEOUT: 3.0})
    state, decision = dl.decide(state, dl.ClearLimit(Source.PYTEST_TIMEOUT), 1.0)
    assert decision.wake == 9.0


# --- pauses -------------------------------------------------------------------------------


def test_a_pause_stops_every_clock_and_resume_moves_them_on() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 5.0}, stall_s=4.0)
    schedule: list[tuple[float, dl.Event]] = [(2.0, dl.Pause()), (12.0, dl.Resume())]
    _, fires, _ = simulate(state, schedule, until=60.0)
    # the timeout had 3 s left at the pause; the stall clock starts again at the resume
    assert fires == [Fired(15.0, Kind.HANG, Source.TIMEOUT)]


def test_pauses_nest_and_only_the_last_resume_restarts_the_clocks() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 5.0})
    schedule: list[tuple[float, dl.Event]] = [
        (1.0, dl.Pause()),  # the zygote starts
        (2.0, dl.Pause()),  # a debugger meanwhile
        (3.0, dl.Resume()),
        (20.0, dl.Resume()),
    ]
    _, fires, _ = simulate(state, schedule, until=60.0)
    assert fires == [Fired(24.0, Kind.HANG, Source.TIMEOUT)]


def test_a_limit_set_during_a_pause_counts_from_the_pause_s_end() -> None:
    # set at 5 (10 s) in a pause from 0 to 6: its clock stood still until 6, so it is due at 16
    state = dl.start(0.0, {})
    schedule: list[tuple[float, dl.Event]] = [
        (0.0, dl.Pause()),
        (5.0, dl.SetLimit(Source.PYTEST_TIMEOUT, 10.0)),
        (6.0, dl.Resume()),
    ]
    _, fires, _ = simulate(state, schedule, until=60.0)
    assert fires == [Fired(16.0, Kind.HANG, Source.PYTEST_TIMEOUT)]


def test_a_limit_set_during_a_pause_races_an_earlier_one_on_equal_terms() -> None:
    # the timeout (5 s from 0) had 4 s left at the pause (1 to 9); pytest-timeout's 3 s, set
    # at 2 in that pause, counts from 9 too: due at 12, before the timeout's 13
    state = dl.start(0.0, {Source.TIMEOUT: 5.0})
    schedule: list[tuple[float, dl.Event]] = [
        (1.0, dl.Pause()),
        (2.0, dl.SetLimit(Source.PYTEST_TIMEOUT, 3.0)),
        (9.0, dl.Resume()),
    ]
    _, fires, _ = simulate(state, schedule, until=60.0)
    assert fires == [Fired(12.0, Kind.HANG, Source.PYTEST_TIMEOUT)]


def test_a_grace_that_starts_during_a_pause_runs_from_the_pause_s_end() -> None:
    # a fixture call hangs at 3, during a pause from 2 to 10: the grace (5 s) is due at 15
    state = dl.start(0.0, {Source.TIMEOUT: 5.0})
    state, _ = dl.decide(state, dl.PhaseStarted("call"), 0.0)  # the test's code runs
    state, _ = dl.decide(state, dl.CallStarted(1, 1.0), 0.5)
    state, _ = dl.decide(state, dl.Pause(), 2.0)
    state, _ = dl.decide(state, dl.CallEnded(1, hung=True), 3.0)
    state, decision = dl.decide(state, dl.Resume(), 10.0)
    assert state.phase is Phase.DELIVERED
    assert decision == dl.Decision(None, 15.0)


def test_a_resume_without_a_pause_changes_nothing() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 5.0})
    after, decision = dl.decide(state, dl.Resume(), 1.0)
    assert after == state and decision.wake == 5.0


def test_while_paused_the_model_sleeps() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 5.0}, stall_s=1.0)
    state, decision = dl.decide(state, dl.Pause(), 0.5)
    assert decision == dl.Decision(None, INF)
    assert dl.monitor_due(state, decision.wake) == INF


# --- stops by job control (Ctrl-Z), learnt after the fact ----------------------------------


@pytest.mark.parametrize(
    ("schedule", "fires_at"),
    [
        # learnt as the limit came due (the shell asks then): due 3 s later
        ([(8.0, dl.Stopped(3.0))], 11.0),
        # two stops, each learnt as the limit came due, or one earlier
        ([(8.0, dl.Stopped(3.0)), (11.0, dl.Stopped(5.0))], 16.0),
        ([(8.0, dl.Stopped(3.0)), (10.0, dl.Stopped(5.0))], 16.0),
        # a stop during a pause (a debugger's) moves nothing: the clocks stood still already
        ([(2.0, dl.Pause()), (9.0, dl.Stopped(4.0)), (10.0, dl.Resume())], 16.0),
        # nothing, or a stop of no length: the limit fires as ever
        ([], 8.0),
        ([(5.0, dl.Stopped(0.0))], 8.0),
    ],
    ids=["one-stop", "two-stops-each-at-its-due", "two-stops", "during-a-pause", "none", "zero"],
)
def test_a_stop_moves_every_clock_on_by_its_length(
    schedule: list[tuple[float, dl.Event]], fires_at: float
) -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 8.0})
    _, fires, _ = simulate(state, schedule, until=60.0)
    assert fires == [Fired(fires_at, Kind.HANG, Source.TIMEOUT)]


def test_a_stop_learnt_long_after_the_deadline_fires_nothing() -> None:
    # 4 s into an 8 s limit, stopped 15 s: the shell runs again, and learns of it, at 19
    state = dl.start(0.0, {Source.TIMEOUT: 8.0})
    state, decision = dl.decide(state, dl.Stopped(15.0), 19.0)
    assert decision == dl.Decision(None, 23.0)
    assert dl.monitor_due(state, decision.wake) == 23.0


def test_a_stop_moves_the_stall_clock_and_the_grace_too() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 30.0}, stall_s=4.0, grace_s=5.0)
    state, _ = dl.decide(state, dl.PhaseStarted("call"), 0.0)  # the test's code runs
    state, _ = dl.decide(state, dl.Progress(2.0), 2.0)
    state, decision = dl.decide(state, dl.Stopped(10.0), 13.0)  # stopped from 3 to 13
    assert decision == dl.Decision(None, 16.0)  # 2 + 4, moved on by 10
    state, _ = dl.decide(state, dl.CallStarted(1, 1.0), 13.0)
    state, _ = dl.decide(state, dl.CallEnded(1, hung=True), 14.0)  # its grace: due at 19
    state, decision = dl.decide(state, dl.Stopped(3.0), 18.0)
    assert state.phase is Phase.DELIVERED and decision == dl.Decision(None, 22.0)


def test_a_stop_never_moves_a_stall_clock_past_now() -> None:
    # the last beat came at 1; learnt at 3, a stop of 10 s (longer than the time since: an
    # over-long log) leaves the stall clock counting from now, not from the future
    state = dl.start(0.0, {}, stall_s=4.0)
    state, _ = dl.decide(state, dl.Progress(1.0), 1.0)
    state, decision = dl.decide(state, dl.Stopped(10.0), 3.0)
    assert state.progress_at == 3.0 and decision.wake == 7.0


def test_a_stop_after_disarm_changes_nothing() -> None:
    state, _ = dl.decide(dl.start(0.0, {Source.TIMEOUT: 5.0}), dl.Disarm(), 1.0)
    after, decision = dl.decide(state, dl.Stopped(3.0), 2.0)
    assert after == state and decision.action is None


# --- fixture calls --------------------------------------------------------------------------


def test_the_test_does_not_fire_while_a_fixture_call_captures_its_children() -> None:
    """Issue 15, 6: a call ends 0.5 s before the test's deadline, and its capture takes 2 s:
    the test's fire waits for it (never overlapping the call's kill)."""
    state = dl.start(0.0, {Source.TIMEOUT: 10.0})
    schedule: list[tuple[float, dl.Event]] = [
        (1.0, dl.CallStarted(1, 8.5)),
        (9.5, dl.CallCapturing(1)),
        (11.5, dl.CallEnded(1, hung=False)),
    ]
    _, fires, _ = simulate(state, schedule, until=60.0)
    assert fires == [Fired(11.5, Kind.HANG, Source.TIMEOUT)]


def test_a_fixture_call_that_never_ends_its_capture_holds_the_test_only_so_long() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 10.0})
    schedule: list[tuple[float, dl.Event]] = [
        (1.0, dl.CallStarted(1, 8.5)),
        (9.5, dl.CallCapturing(1)),
    ]
    _, fires, _ = simulate(state, schedule, until=100.0)
    assert fires == [Fired(9.5 + dl.CALL_CAPTURE_BOUND_S, Kind.HANG, Source.TIMEOUT)]


def test_a_fixture_call_that_hung_gives_the_rest_of_the_test_its_grace() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 10.0})
    schedule: list[tuple[float, dl.Event]] = [
        (1.0, dl.CallStarted(1, 3.0)),
        (4.0, dl.CallCapturing(1)),
        (4.5, dl.CallEnded(1, hung=True)),
    ]
    state, fires, _ = simulate(state, schedule, until=14.0)
    assert fires == []  # one report: the call's (its HangError is raised in the test)
    assert state.phase is Phase.DELIVERED
    assert state.grace_due == 14.5
    _, fires, _ = simulate(state, [], until=60.0, running=False)
    assert fires == [Fired(14.5, Kind.HANG, Source.GRACE)]


def test_a_fixture_call_that_ends_well_changes_nothing() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 10.0})
    schedule: list[tuple[float, dl.Event]] = [(1.0, dl.CallStarted(1, 5.0)), (2.0, dl.CallEnded(1))]
    _, fires, _ = simulate(state, schedule, until=60.0)
    assert fires == [Fired(10.0, Kind.HANG, Source.TIMEOUT)]


# --- after a fire ---------------------------------------------------------------------------


def test_a_fired_test_is_interrupted_every_second_only_while_its_own_code_runs() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 2.0})
    state, _ = dl.decide(state, dl.PhaseStarted("call"), 0.0)
    state, decision = dl.decide(state, dl.Tick(), 2.0)
    assert decision.action is Action.FIRE and state.phase is Phase.FIRING
    state, decision = dl.decide(state, dl.Tick(), 2.1)
    assert decision == dl.Decision(None, INF)  # the watchdog is at work
    state, decision = dl.decide(state, dl.CaptureDone(), 2.2)
    assert (decision.action, decision.wake) == (Action.INTERRUPT, 3.2)
    state, decision = dl.decide(state, dl.PhaseEnded(), 2.3)
    state, decision = dl.decide(state, dl.Tick(), 3.2)
    assert decision == dl.Decision(None, 4.2)  # pytest's own code runs: no interrupt
    state, decision = dl.decide(state, dl.PhaseStarted("teardown"), 3.5)
    state, decision = dl.decide(state, dl.Tick(), 4.2)
    assert decision.action is Action.INTERRUPT


def test_a_fired_test_that_never_raises_has_its_tree_killed_again_a_bounded_number_of_times() -> (
    None
):
    state = dl.start(0.0, {Source.TIMEOUT: 1.0})
    _, _, actions = simulate(state, [], until=60.0)
    kinds = [action for _, action in actions]
    assert kinds.count(Action.FIRE) == 1
    assert kinds.count(Action.REKILL) == dl.MAX_KILLS - 1  # the fire's own kill counts
    assert kinds.count(Action.INTERRUPT) > 40


def test_delivery_starts_the_grace_and_a_teardown_past_it_fires_again() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 4.0})
    state, _ = dl.decide(state, dl.PhaseStarted("call"), 0.0)
    state, _ = dl.decide(state, dl.Tick(), 4.0)
    state, _ = dl.decide(state, dl.CaptureDone(), 4.1)
    state, decision = dl.decide(state, dl.Delivered(), 4.2)
    assert state.phase is Phase.DELIVERED and decision == dl.Decision(None, 8.2)
    assert dl.monitor_due(state, decision.wake) == 8.2
    state, decision = dl.decide(state, dl.Tick(), 8.2)
    assert (decision.action, decision.kind, decision.source) == (
        Action.FIRE,
        Kind.HANG,
        Source.GRACE,
    )


def _delivered_in_call(at: float = 4.2) -> dl.State:
    """A 4 s test that hung in its call and took its HangError at ``at`` (grace due at +4)."""
    state = dl.start(0.0, {Source.TIMEOUT: 4.0})
    state, _ = dl.decide(state, dl.PhaseStarted("call"), 0.0)
    state, _ = dl.decide(state, dl.Tick(), 4.0)
    state, _ = dl.decide(state, dl.CaptureDone(), 4.1)
    state, _ = dl.decide(state, dl.Delivered(), at)
    return state


def test_the_grace_counts_only_the_tests_own_code_not_pytests_reporting_between_phases() -> None:
    # the call raises at 4.2 (grace due 8.2); pytest reports the hang from 5.0 to 9.0 (a loaded
    # machine); the teardown starts at 9.0 with the 3.2 s it had left: due at 12.2, not at 8.2
    state = _delivered_in_call()
    state, decision = dl.decide(state, dl.PhaseEnded(), 5.0)
    assert decision == dl.Decision(None, 5.0 + 3.2 + dl.OWN_CODE_S)
    state, decision = dl.decide(state, dl.Tick(), 8.2)
    assert decision.action is None
    state, decision = dl.decide(state, dl.PhaseStarted("teardown"), 9.0)
    assert decision == dl.Decision(None, pytest.approx(12.2))
    state, decision = dl.decide(state, dl.Tick(), 12.2)
    assert (decision.action, decision.source) == (Action.FIRE, Source.GRACE)


def test_pytests_own_code_after_a_delivered_hang_is_bounded_too() -> None:
    state = _delivered_in_call()
    state, decision = dl.decide(state, dl.PhaseEnded(), 5.0)
    due = 5.0 + 3.2 + dl.OWN_CODE_S
    assert dl.monitor_due(state, decision.wake) == due  # the monitor is told the bound
    state, decision = dl.decide(state, dl.Tick(), due)
    assert (decision.action, decision.source) == (Action.FIRE, Source.GRACE)


def test_a_hang_delivered_while_pytests_code_runs_keeps_its_whole_grace_for_the_teardown() -> None:
    # the report reached the test through pytest's report hook (no interrupt landed in time)
    state = dl.start(0.0, {Source.TIMEOUT: 4.0})
    state, _ = dl.decide(state, dl.Tick(), 4.0)
    state, _ = dl.decide(state, dl.CaptureDone(), 4.1)
    state, decision = dl.decide(state, dl.Delivered(), 7.0)
    assert decision.wake == 7.0 + 4.0 + dl.OWN_CODE_S
    state, decision = dl.decide(state, dl.PhaseStarted("teardown"), 20.0)
    assert decision == dl.Decision(None, 24.0)


def test_a_pause_while_the_grace_is_held_moves_its_bound() -> None:
    state = _delivered_in_call()
    state, _ = dl.decide(state, dl.PhaseEnded(), 5.0)
    state, _ = dl.decide(state, dl.Pause(), 6.0)
    state, decision = dl.decide(state, dl.Resume(), 16.0)
    assert decision.wake == pytest.approx(5.0 + 3.2 + dl.OWN_CODE_S + 10.0)
    state, decision = dl.decide(state, dl.PhaseStarted("teardown"), 17.0)
    assert decision.wake == pytest.approx(20.2)


def test_the_grace_after_a_stall_is_the_stall_time() -> None:
    state = dl.start(0.0, {}, stall_s=3.0)
    state, _ = dl.decide(state, dl.PhaseStarted("call"), 0.0)  # the test's code runs
    state, _ = dl.decide(state, dl.Tick(), 3.0)
    state, _ = dl.decide(state, dl.CaptureDone(), 3.0)
    state, decision = dl.decide(state, dl.Delivered(), 3.5)
    assert decision.wake == 6.5


def test_no_limit_or_progress_moves_a_test_that_fired() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 4.0}, stall_s=2.0)
    state, _ = dl.decide(state, dl.Tick(), 2.0)  # the stall fires
    before = state
    for event in (dl.SetLimit(Source.PYTEST_TIMEOUT, 1.0), dl.ClearLimit(Source.TIMEOUT)):
        state, decision = dl.decide(state, event, 2.5)
        assert state.limits == before.limits
        assert decision.action is None


def test_events_out_of_place_are_ignored() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 4.0})
    for event in (dl.CaptureDone(), dl.Delivered(), dl.CallEnded(99, hung=False)):
        after, decision = dl.decide(state, event, 1.0)
        assert after.phase is Phase.ARMED and decision == dl.Decision(None, 4.0)


def test_after_disarm_nothing_fires_and_the_monitor_is_told() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 4.0}, stall_s=1.0)
    state, decision = dl.decide(state, dl.Disarm(), 0.5)
    assert decision == dl.Decision(None, INF)
    _, fires, _ = simulate(state, [], until=60.0)
    assert fires == []
    assert dl.monitor_due(state, INF) == -1.0


def test_the_monitor_counts_from_the_fire_while_a_capture_runs() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 1.0})
    state, decision = dl.decide(state, dl.Tick(), 1.0)
    assert dl.monitor_due(state, decision.wake) is None


def test_the_grace_defaults_to_the_tightest_limit() -> None:
    state = dl.start(0.0, {Source.TIMEOUT: 9.0})
    state, _ = dl.decide(state, dl.SetLimit(Source.PYTEST_TIMEOUT, 4.0), 0.0)
    assert state.grace_s == 4.0 and state.timeout_s == 4.0


def test_an_unknown_event_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="not a deadline event"):
        dl.decide(dl.start(0.0, {}), object(), 0.0)  # type: ignore[arg-type]


# --- every pair of events, both orders ------------------------------------------------------

EVENTS: list[dl.Event] = [
    dl.Tick(),
    dl.SetLimit(Source.PYTEST_TIMEOUT, 2.0),
    dl.ClearLimit(Source.TIMEOUT),
    dl.Progress(1.0),
    dl.Pause(),
    dl.Resume(),
    dl.Stopped(2.0),
    dl.PhaseStarted("call"),
    dl.PhaseEnded(),
    dl.CallStarted(1, 1.0),
    dl.CallCapturing(1),
    dl.CallEnded(1, hung=True),
    dl.CaptureDone(),
    dl.Delivered(),
    dl.Disarm(),
]


@pytest.mark.parametrize(
    ("a", "b"),
    list(itertools.permutations(EVENTS, 2)),
    ids=lambda e: type(e).__name__,
)
def test_every_pair_of_events_in_either_order_leaves_a_sound_model(
    a: dl.Event, b: dl.Event
) -> None:
    """From each phase, ``a`` then ``b``: the model never asks to be looked at in the past,
    never fires more than once per fire-able state, and a disarmed test stays disarmed."""
    for phase_setup in _phases():
        state = phase_setup
        for at, event in ((1.0, a), (1.5, b)):
            before = state
            state, decision = dl.decide(state, event, at)
            if decision.action is None:
                assert decision.wake > at
            if before.phase is Phase.DISARMED:
                assert state.phase is Phase.DISARMED and decision.action is None
            if decision.action is Action.FIRE:
                assert state.phase is Phase.FIRING and state.fires == before.fires + 1


def _phases() -> list[dl.State]:
    """One model in each phase (and paused), a moment before 1.0."""
    armed = dl.start(0.5, {Source.TIMEOUT: 3.0}, stall_s=2.0)
    firing, _ = dl.decide(armed, dl.Tick(), 3.5)
    fired, _ = dl.decide(firing, dl.CaptureDone(), 0.9)
    delivered, _ = dl.decide(fired, dl.Delivered(), 0.9)
    disarmed, _ = dl.decide(armed, dl.Disarm(), 0.9)
    paused, _ = dl.decide(armed, dl.Pause(), 0.9)
    return [armed, firing, fired, delivered, disarmed, paused]


def test_random_walks_never_spin_and_fire_the_earliest_source() -> None:
    """A seeded random walk over events and times: whenever the model has no action it looks
    again later than now, and the first fire of an armed test is never later than its earliest
    source (pauses and fixture captures aside)."""
    rng = random.Random(15)
    for _ in range(300):
        timeout = rng.choice([0.0, rng.uniform(1, 10)])
        stall = rng.choice([0.0, rng.uniform(1, 10)])
        state = dl.start(0.0, {Source.TIMEOUT: timeout}, stall)
        schedule: list[tuple[float, dl.Event]] = sorted(
            (
                rng.uniform(0, 20),
                rng.choice([dl.Progress(0.0), dl.PhaseEnded(), dl.PhaseStarted("call")]),
            )
            for _ in range(rng.randint(0, 30))
        )
        schedule = [
            (at, dl.Progress(at) if isinstance(e, dl.Progress) else e) for at, e in schedule
        ]
        _, fires, _ = simulate(state, schedule, until=40.0)
        if timeout:
            assert fires and fires[0].at <= timeout + 1e-9
        elif stall:
            assert fires and fires[0].kind is Kind.STALL
        else:
            assert fires == []


# --- the running flag the shell records without an event -----------------------------------


def _states() -> list[dl.State]:
    armed = dl.start(0.0, {Source.TIMEOUT: 2.0})
    firing, _ = dl.decide(armed, dl.Tick(), 2.0)
    fired, _ = dl.decide(firing, dl.CaptureDone(), 2.1)
    delivered, _ = dl.decide(fired, dl.Delivered(), 2.2)
    paused, _ = dl.decide(armed, dl.Pause(), 1.0)
    return [armed, firing, fired, delivered, paused]


@pytest.mark.parametrize("index", range(5), ids=["armed", "firing", "fired", "delivered", "paused"])
@pytest.mark.parametrize("running", [True, False])
def test_the_running_flag_recorded_without_an_event_decides_as_the_phase_events_do(
    index: int, running: bool
) -> None:
    """``with_running`` then a tick decides exactly as ``PhaseStarted``/``PhaseEnded`` would."""
    state = _states()[index]
    event: dl.Event = dl.PhaseStarted("call") if running else dl.PhaseEnded()
    for now in (2.3, 3.1, 3.2, 10.0):
        assert dl.decide(dl.with_running(state, running, now), dl.Tick(), now) == dl.decide(
            state, event, now
        )
