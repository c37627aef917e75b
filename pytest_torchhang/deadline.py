"""The deadline model: every source of one test's deadline in, one decision out.

Pure, in the manner of a sans-I/O protocol: no thread, no I/O and no clock of its own. The
watchdog thread (``watchdog.py``) feeds it events with the time they happened and executes what
it decides; the unit tests drive it through tables of event sequences.

Sources of a deadline, all in one place, so that whichever is due first fires whatever the pair:

- wall-clock limits: the plugin's timeout (option, ini, env, marker) and pytest-timeout's
  (``--timeout``, ``@pytest.mark.timeout``), each a ``Limit``; the earliest due one decides;
- the stall time: no progress for ``stall_s`` (progress is an event the shell feeds);
- a fixture call's own timeout: the call acts on it itself (it captures and kills its children),
  so the model only keeps the test's own fire from overlapping that capture;
- the teardown grace: once the test has its ``HangError``, the rest of it gets ``grace_s`` of
  its own code's time (setup, call, teardown); pytest's own code between phases (its reports,
  other plugins' hooks) does not count, up to ``OWN_CODE_S``;
- pauses (a debugger, the zygote importing torch): every clock stops meanwhile; and stops by
  job control (Ctrl-Z), which the shell learns of afterwards: every clock moves on by the stop.

States, and what moves them::

    ARMED --a limit, the stall time or nothing-- FIRING --CaptureDone--> FIRED
    FIRED --Delivered (the test has its HangError)--> DELIVERED
    FIRED: INTERRUPT every INTERRUPT_EVERY_S while the test's own code runs, REKILL now and then
    DELIVERED --the grace runs out--> FIRING (a second hang: in a later phase, or a note)
    ARMED --CallEnded(hung=True): a fixture call raised its HangError--> DELIVERED
    any state --Disarm--> DISARMED

Only FIRED, while the test's own code runs (setup, call or teardown), allows an interrupt.
Invariant: a decision without an action always has ``wake > now``: the shell never spins.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple, TypeAlias

#: While a fired test has not taken its HangError: interrupt it again this often ...
INTERRUPT_EVERY_S = 1.0
#: ... and kill its tree again every this many interrupts (it may have started new processes).
REKILL_EVERY = 5
#: At most this many kills of one tree per hang.
MAX_KILLS = 3
#: The test's own fire waits at most this long for a fixture call's capture in progress.
CALL_CAPTURE_BOUND_S = 30.0
#: After a delivered hang, pytest's own code between two phases of the test (the failure's
#: report, other plugins' hooks) may take this long on top of the grace: on a loaded machine
#: reporting a hang takes seconds, which are not the teardown's to lose.
OWN_CODE_S = 30.0

INF = math.inf


class Source(enum.Enum):
    """Where a deadline comes from (its value is how messages name it)."""

    TIMEOUT = "timeout"  # --torch-hang-timeout, its ini key and env variable, the marker
    PYTEST_TIMEOUT = "pytest-timeout"  # --timeout, PYTEST_TIMEOUT, @pytest.mark.timeout
    STALL = "stall"
    FIXTURE_CALL = "fixture call"
    GRACE = "teardown grace"


class Phase(enum.Enum):
    """Where one test's deadline stands."""

    ARMED = "armed"
    FIRING = "firing"
    FIRED = "fired"
    DELIVERED = "delivered"
    DISARMED = "disarmed"


class Action(enum.Enum):
    """What the shell must do now."""

    FIRE = "fire"  # capture the tree, kill it, then feed CaptureDone
    INTERRUPT = "interrupt"  # make the test's thread raise its HangError
    REKILL = "rekill"  # kill the tree again (it may have started new processes), then interrupt


class Kind(enum.Enum):
    """What a fire declares."""

    HANG = "hang"
    STALL = "stall"


class Limit(NamedTuple):
    """A wall-clock limit: ``seconds`` long, due at ``due``."""

    source: Source
    seconds: float
    due: float


class Call(NamedTuple):
    """A fixture call in flight: it handles its own ``due`` itself."""

    due: float
    capturing_since: float = INF  # the call is capturing and killing its children


# --- events ---------------------------------------------------------------------------------


class Tick(NamedTuple):
    """The shell woke up (at the time it was told, or earlier): is anything due?"""


class SetLimit(NamedTuple):
    """A wall-clock limit ``seconds`` from now; replaces an earlier one of the same source."""

    source: Source
    seconds: float


class ClearLimit(NamedTuple):
    """Lift the limit of ``source`` (pytest-timeout's func_only timer, after the call)."""

    source: Source


class Progress(NamedTuple):
    """The tree made progress at ``at`` (the last beat on the board)."""

    at: float


class Pause(NamedTuple):
    """Stop every clock (a debugger, the zygote importing torch); pauses nest."""


class Resume(NamedTuple):
    """Undo one Pause; when none is left, the clocks go on where they stopped."""


class Stopped(NamedTuple):
    """The process was stopped (Ctrl-Z, SIGSTOP) for ``seconds`` before now: paused, not hung.

    The shell learns of a stop only once it runs again (from the monitor, which was not
    stopped), so unlike a Pause it comes after the fact: every running clock moves on by it.
    """

    seconds: float


class PhaseStarted(NamedTuple):
    """The test's own code (setup, call or teardown) runs: an interrupt may land in it."""

    name: str


class PhaseEnded(NamedTuple):
    """pytest's own code runs: no interrupt may land."""


class CallStarted(NamedTuple):
    """A fixture call ``call`` waits for its children, ``seconds`` at most."""

    call: int
    seconds: float


class CallCapturing(NamedTuple):
    """The fixture call's own deadline passed: it captures and kills its children."""

    call: int


class CallEnded(NamedTuple):
    """The fixture call is over; ``hung``: it raises its HangError in the test."""

    call: int
    hung: bool = False


class CaptureDone(NamedTuple):
    """The fire's capture and kill are over: from now on the test is interrupted."""


class Delivered(NamedTuple):
    """The test has its HangError (raised, or attached to a pytest report)."""


class Disarm(NamedTuple):
    """The test is over (or a debugger took over for good): nothing fires any more."""


Event: TypeAlias = (
    Tick
    | SetLimit
    | ClearLimit
    | Progress
    | Pause
    | Resume
    | Stopped
    | PhaseStarted
    | PhaseEnded
    | CallStarted
    | CallCapturing
    | CallEnded
    | CaptureDone
    | Delivered
    | Disarm
)


# --- state and decision ---------------------------------------------------------------------


class Decision(NamedTuple):
    """What to do now (``action``, with the ``kind`` and ``source`` of a fire) and when to look
    again (``wake``; always later than now when there is no action)."""

    action: Action | None
    wake: float
    kind: Kind | None = None
    source: Source | None = None


class State(NamedTuple):
    """One test's deadline: every source, and where the test stands."""

    started: float
    limits: tuple[Limit, ...] = ()
    stall_s: float = 0.0
    progress_at: float = 0.0  # the stall clock counts from here (start, resume, last beat)
    grace_s: float = 0.0
    phase: Phase = Phase.ARMED
    running: bool = False  # the test's own code runs now
    paused: int = 0  # depth of nested pauses
    paused_at: float = INF
    calls: tuple[tuple[int, Call], ...] = ()
    grace_due: float = INF
    #: what is left of the grace while pytest's own code runs (INF: the test's code runs, or
    #: no grace): ``grace_due`` is then that plus ``OWN_CODE_S``, the bound on pytest's code
    grace_left: float = INF
    fire_kind: Kind | None = None  # of the fire in progress or last made
    fire_source: Source | None = None
    fires: int = 0
    interrupts: int = 0
    kills: int = 0
    next_interrupt: float = INF
    history: tuple[str, ...] = ()  # transitions, for messages

    @property
    def timeout_s(self) -> float:
        """The test's bound as users set it: its tightest limit, or its stall time."""
        return min((limit.seconds for limit in self.limits), default=self.stall_s)

    @property
    def stall_due(self) -> float:
        return self.progress_at + self.stall_s if self.stall_s > 0 else INF


def start(
    now: float, limits: dict[Source, float], stall_s: float = 0.0, grace_s: float | None = None
) -> State:
    """A test armed at ``now`` with ``limits`` (seconds per source; 0 or less: none) and stall
    detection after ``stall_s`` without progress. The grace defaults to the test's bound."""
    chosen = tuple(
        Limit(source, seconds, now + seconds) for source, seconds in limits.items() if seconds > 0
    )
    state = State(started=now, limits=chosen, stall_s=max(stall_s, 0.0), progress_at=now)
    return state._replace(grace_s=state.timeout_s if grace_s is None else grace_s)


def _due(state: State) -> tuple[float, Kind, Source] | None:
    """The earliest due event of an armed test: a limit (a hang) or the stall time. On a tie the
    limit wins: the user's hard bound is the plainer explanation."""
    best: tuple[float, Kind, Source] | None = None
    for limit in state.limits:
        if best is None or limit.due < best[0]:
            best = (limit.due, Kind.HANG, limit.source)
    if state.stall_s > 0 and (best is None or state.stall_due < best[0]):
        best = (state.stall_due, Kind.STALL, Source.STALL)
    return best


def _call_capture_ends(state: State) -> float:
    """While a fixture call captures its children, the test's own fire waits until then."""
    since = min((call.capturing_since for _, call in state.calls), default=INF)
    return since + CALL_CAPTURE_BOUND_S if since < INF else -INF


def _note(state: State, now: float, text: str) -> tuple[str, ...]:
    return (*state.history[-15:], f"{now - state.started:.3f}s {text}")


def _fire(state: State, now: float, kind: Kind, source: Source) -> tuple[State, Decision]:
    fired = state._replace(
        phase=Phase.FIRING,
        fire_kind=kind,
        fire_source=source,
        fires=state.fires + 1,
        history=_note(state, now, f"fire {kind.value} ({source.value})"),
    )
    return fired, Decision(Action.FIRE, INF, kind, source)


def _tick(state: State, now: float) -> tuple[State, Decision]:
    phase = state.phase
    if phase in (Phase.DISARMED, Phase.FIRING):
        return state, Decision(None, INF)  # over; or the shell is at work on a fire
    if phase is Phase.FIRED:
        if now < state.next_interrupt:
            return state, Decision(None, state.next_interrupt)
        interrupts = state.interrupts + 1
        state = state._replace(interrupts=interrupts, next_interrupt=now + INTERRUPT_EVERY_S)
        if interrupts % REKILL_EVERY == 0 and state.kills < MAX_KILLS:
            state = state._replace(kills=state.kills + 1)
            return state, Decision(Action.REKILL, state.next_interrupt)
        action = Action.INTERRUPT if state.running else None
        return state, Decision(action, state.next_interrupt)
    if state.paused:
        return state, Decision(None, INF)
    if phase is Phase.DELIVERED:
        if now >= state.grace_due:
            return _fire(state, now, Kind.HANG, Source.GRACE)
        return state, Decision(None, state.grace_due)
    due = _due(state)  # ARMED
    if due is None:
        return state, Decision(None, INF)
    at, kind, source = due
    if now < at:
        return state, Decision(None, at)
    held_until = _call_capture_ends(state)
    if now < held_until:  # a fixture call is capturing its children: never overlap it
        return state, Decision(None, held_until)
    return _fire(state, now, kind, source)


def decide(state: State, event: Event, now: float) -> tuple[State, Decision]:
    """Apply ``event`` (which happened at ``now``) and say what is due now, and when to look
    again. The only function that changes a deadline."""
    state = _apply(state, event, now)
    return _tick(state, now)


def _clock(state: State, now: float) -> float:
    """The time on the test's clocks: while paused they stand where the pause stopped them, so
    that a limit set (or a call started) during a pause counts from its end, as if set then."""
    return state.paused_at if state.paused else now


def _apply(state: State, event: Event, now: float) -> State:
    armed = state.phase is Phase.ARMED
    if isinstance(event, Tick):
        return state
    if isinstance(event, Disarm):  # early: every passing test ends with it
        return state._replace(phase=Phase.DISARMED, history=_note(state, now, "disarmed"))
    if isinstance(event, SetLimit):
        if not armed or event.seconds <= 0:
            return state
        kept = tuple(limit for limit in state.limits if limit.source is not event.source)
        limit = Limit(event.source, event.seconds, _clock(state, now) + event.seconds)
        state = state._replace(limits=(*kept, limit))
        if state.grace_s <= 0 or event.seconds < state.grace_s:
            state = state._replace(grace_s=event.seconds)
        return state
    if isinstance(event, ClearLimit):
        if not armed:
            return state
        return state._replace(limits=tuple(x for x in state.limits if x.source is not event.source))
    if isinstance(event, Progress):
        return state._replace(progress_at=max(state.progress_at, event.at))
    if isinstance(event, Pause):
        if state.paused:
            return state._replace(paused=state.paused + 1)
        return state._replace(paused=1, paused_at=now)
    if isinstance(event, Resume):
        if state.paused == 0:
            return state
        if state.paused > 1:
            return state._replace(paused=state.paused - 1)
        return _resumed(state, now)
    if isinstance(event, Stopped):
        if state.paused or event.seconds <= 0 or state.phase is Phase.DISARMED:
            return state  # paused, the clocks stood still anyway
        return _moved(state, event.seconds, now)._replace(
            history=_note(state, now, f"stopped {event.seconds:.1f}s")
        )
    if isinstance(event, PhaseStarted):
        return _running(state, True, now)
    if isinstance(event, PhaseEnded):
        return _running(state, False, now)
    if isinstance(event, CallStarted):
        calls = (*state.calls, (event.call, Call(_clock(state, now) + event.seconds)))
        return state._replace(calls=calls)
    if isinstance(event, CallCapturing):
        calls = tuple(
            (key, call._replace(capturing_since=now) if key == event.call else call)
            for key, call in state.calls
        )
        return state._replace(calls=calls)
    if isinstance(event, CallEnded):
        state = state._replace(calls=tuple(c for c in state.calls if c[0] != event.call))
        if event.hung and armed:
            # The call raises its HangError in the test: the test has its report, and the rest
            # of it runs under the grace, exactly as after a fire of its own.
            return _delivered(state, now, "a fixture call hung")
        return state
    if isinstance(event, CaptureDone):
        if state.phase is not Phase.FIRING:
            return state
        return state._replace(
            phase=Phase.FIRED,
            interrupts=0,
            kills=state.kills + 1,
            next_interrupt=now,  # interrupt at once
            history=_note(state, now, "captured"),
        )
    if isinstance(event, Delivered):
        if state.phase is not Phase.FIRED:
            return state
        return _delivered(state, now, "delivered")
    raise TypeError(f"not a deadline event: {event!r}")


def _resumed(state: State, now: float) -> State:
    """Every clock moves on by the time it stood still; the stall clock starts again."""
    stood = max(now - state.paused_at, 0.0)
    moved = _moved(state, stood, now)
    return moved._replace(paused=0, paused_at=INF, progress_at=max(state.progress_at, now))


def _moved(state: State, stood: float, now: float) -> State:
    """Every clock moved on by ``stood`` seconds (the stall clock too, up to ``now``)."""
    limits = tuple(limit._replace(due=limit.due + stood) for limit in state.limits)
    calls = tuple((key, call._replace(due=call.due + stood)) for key, call in state.calls)
    grace_due = state.grace_due + stood if state.grace_due < INF else INF
    return state._replace(
        limits=limits,
        calls=calls,
        grace_due=grace_due,
        progress_at=min(state.progress_at + stood, max(state.progress_at, now)),
    )


def _delivered(state: State, now: float, why: str) -> State:
    delivered = state._replace(
        phase=Phase.DELIVERED,
        grace_due=_clock(state, now) + state.grace_s,
        grace_left=INF,
        history=_note(state, now, why),
    )
    return delivered if state.running else _grace_held(delivered, now)


def _grace_held(state: State, now: float) -> State:
    """The grace stands still while pytest's own code runs, for at most ``OWN_CODE_S``."""
    left = max(state.grace_due - _clock(state, now), 0.0)
    return state._replace(grace_left=left, grace_due=_clock(state, now) + left + OWN_CODE_S)


def _running(state: State, running: bool, now: float) -> State:
    """The test's own code starts or stops running: after a delivered hang, only its own code's
    time counts against the grace (see ``OWN_CODE_S``)."""
    if state.phase is Phase.DELIVERED and running != state.running:
        if running and state.grace_left < INF:
            state = state._replace(grace_due=_clock(state, now) + state.grace_left, grace_left=INF)
        elif not running and state.grace_left == INF:
            state = _grace_held(state, now)
    return state._replace(running=running)


def with_running(state: State, running: bool, now: float) -> State:
    """``state`` with the test's own code running or not, as the shell recorded it without an
    event (``PhaseStarted`` and ``PhaseEnded`` do the same, and tick). While armed only an
    interrupt depends on it, once a fire has begun: no clock moves and no wake changes; after a
    delivered hang the grace counts only the test's own code."""
    return _running(state, running, now)


def monitor_due(state: State, wake: float) -> float | None:
    """The time by which the watchdog must have acted, for the monitor (the GIL backstop):
    ``wake`` while armed or in the grace, INF while paused, None while firing or fired (the
    monitor then counts from the fire), -1 once disarmed."""
    if state.phase is Phase.DISARMED:
        return -1.0
    if state.phase in (Phase.FIRING, Phase.FIRED):
        return None
    return INF if state.paused else wake
