"""The one place a ``HangReport`` is built: from the diagnosis, or from what is known when the
capture failed; and the words the hang's path adds to one (a stall's headline, a follow-up note)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import clock
from ..diagnosis import engine
from ..report.model import HangReport, ProcessReport

if TYPE_CHECKING:
    from ..capture.target import CaptureTarget
    from ..inject import beats

#: A second capture of the same phase is kept as a note of the first: this many frames a thread.
NOTE_FRAMES = 6


def explain(
    target: CaptureTarget, elapsed: float, reports: list[ProcessReport], notes: list[str]
) -> HangReport:
    """The report: the headline and the hints the diagnosis reads from the processes."""
    hints = engine.hints(reports)
    return HangReport(
        test_id=target.test_id,
        timeout_s=target.timeout_s,
        elapsed_s=elapsed,
        phase=target.phase,
        headline=engine.headline(
            target.test_id + (f" (during {target.phase})" if target.phase != "call" else ""),
            elapsed,
            reports,
            target.root_pid,
            hints,
        ),
        hints=hints,
        processes=reports,
        notes=notes,
        cause=engine.cause(hints, reports, target.root_pid),
        culprits=engine.culprits(reports, target.root_pid, hints),
    )


def failed_report(target: CaptureTarget, exc: BaseException) -> HangReport:
    """The watchdog's report when its capture failed: what is known; the tree is killed all the same."""
    elapsed = clock.monotonic() - target.started
    return HangReport(
        test_id=target.test_id,
        timeout_s=target.timeout_s,
        elapsed_s=elapsed,
        phase=target.phase,
        headline=f"HANG after {elapsed:.1f}s in {target.test_id}: the stacks could not be taken",
        notes=[f"pytest-torchhang's capture failed: {exc!r}; the tree was killed all the same"],
    )


def last_resort_failed(target: CaptureTarget, exc: BaseException) -> HangReport:
    """The monitor's report when its capture from outside failed (or ran out of its bound)."""
    return HangReport(
        test_id=target.test_id,
        timeout_s=target.timeout_s,
        elapsed_s=clock.monotonic() - target.started,
        phase=target.phase,
        headline=f"HANG in {target.test_id}: the stacks could not be taken",
        notes=[f"pytest-torchhang's last-resort capture failed: {exc}"],
    )


def follow_up_note(first: HangReport, later: HangReport) -> str:
    """A later capture of the same hang, as a note of the first: when, and where each thread was."""
    lines = [
        f"after the interrupt at {first.elapsed_s:.1f}s the test did not end: at "
        f"{later.elapsed_s:.1f}s (during {later.phase}) it was blocked again, and was "
        "interrupted again; the second capture saw:"
    ]
    for proc in later.processes:
        for thread in proc.threads:
            if not thread.frames:
                continue
            frames = " <- ".join(
                f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}"
                for f in thread.frames[:NOTE_FRAMES]
            )
            name = thread.name or thread.ident
            lines.append(f"      {proc.role} (pid {proc.pid}), {name}: {frames}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Stall:
    """What a stall's headline reads of the test's progress, handed over by the watchdog."""

    board: beats.Reader | None  # the test's progress board (read after the capture)
    stall_s: float
    progress_at: float  # clock time of the last progress the model saw
    samples: list[tuple[float, list[int]]]  # (seconds since the test began, beats per kind)


def _duration(seconds: float) -> str:
    """``12.0s``, or ``3m12s`` from a minute on."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest:02d}s"


_RATE_UNITS = ("batches/s", "optimizer steps/s", "collectives/s", "progress() calls/s")


def as_stall(report: HangReport, target: CaptureTarget, stall: Stall) -> None:
    """Make the report a stall's: its headline says what progress looked like and when it stopped.

    ``STALL after 3m12s in test_x: no progress for 30.0s (last: DataLoader batch 812 of epoch
    3 at 2m42s; before that 6.1 batches/s and 3.0 optimizer steps/s)``
    """
    snapshot = stall.board.snapshot() if stall.board is not None else None
    if snapshot is None or snapshot.kind < 0:
        progress = "no progress at all since the test began"
    else:
        at = max(0.0, snapshot.last - target.started)
        progress = f"last: {snapshot.describe_last()} at {_duration(at)}"
        rates = [
            f"{rate:.1f} {unit}"
            for kind, unit in enumerate(_RATE_UNITS)
            if (rate := snapshot.rate(kind)) is not None
        ]
        if rates:
            progress += "; before that " + " and ".join(rates)
    where = target.test_id + (f" (during {target.phase})" if target.phase != "call" else "")
    silent = report.elapsed_s - (stall.progress_at - target.started)
    report.headline = (
        f"STALL after {_duration(report.elapsed_s)} in {where}: no progress for "
        f"{min(silent, report.elapsed_s):.1f}s ({progress})"
    )
    from ..inject import beats

    report.kind = "stall"
    report.progress = {
        "stall_s": stall.stall_s,
        "kinds": list(beats.KINDS),
        "counts": snapshot.counts if snapshot is not None else [],
        "last": progress,
        "history": [{"t": round(t, 3), "counts": counts} for t, counts in stall.samples],
    }
