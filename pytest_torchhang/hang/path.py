"""One hang's path, in named steps: capture -> diagnose -> report -> kill.

Used in the pytest process by the watchdog (``fire``), by the monitor process when the pytest
process itself cannot move, and by the subprocess runner for its children
(``capture_and_kill``). The capture (``capture/pipeline.py``) reads the world, the diagnosis reads
the facts it read, and ``reports.py`` builds the report; only the order of the steps lives here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from .. import clock
from ..capture import pipeline
from ..capture.kill import KillResult, kill_tree, remove_leftovers
from ..capture.native import native_stacks
from ..capture.target import CaptureTarget
from ..diagnosis import engine
from ..report.groups import helper_role
from ..report.model import KEPT_ROLE, HangReport, ProcessReport, Role
from .reports import Stall, as_stall, explain, failed_report

__all__ = [
    "CaptureTarget",
    "HangReport",
    "Stall",
    "at_fire",
    "capture",
    "capture_and_kill",
    "fire",
    "kill",
]


def at_fire(
    armed: CaptureTarget,
    timeout_s: float,
    phase: str,
    exclude: Iterable[int],
    extra_roots: Iterable[int],
) -> CaptureTarget:
    """The capture's target, made once as a test's deadline fires: the armed test's, with what
    only the fire knows (the model's timeout, the phase, the plugin's processes now, the fixture
    calls' children in flight)."""
    return dataclasses.replace(
        armed,
        timeout_s=timeout_s,
        phase=phase,
        exclude=armed.exclude | frozenset(exclude),
        extra_roots=tuple(extra_roots),
    )


def capture(target: CaptureTarget, skip_threads: set[int] | None = None) -> HangReport:
    """Snapshot the tree, take every process's stacks and explain them; kills nothing."""
    seen = pipeline.gather(target, skip_threads)
    reports = seen.reports
    engine.label_roles(reports, target.root_pid, seen.env, target.root_role)
    notes = seen.notes
    if target.native:
        notes += _add_native(reports)
    else:
        pipeline.read_from_outside(reports)
    began = clock.wall() - (clock.monotonic() - target.started)
    # Before the diagnosis, which may read them: a traceback there often says the cause.
    pipeline.fill_stderr_tails(target.dump_dir, reports, began)
    gone = pipeline.gone_stderr_tails(target.dump_dir, {r.pid for r in reports}, began)
    reports, kept = _set_apart(target, reports)
    report = explain(target, seen.elapsed, reports, notes)
    report.processes += kept
    report.gone_stderr = gone
    context_facts = pipeline.context_facts(seen.context, seen.now, seen.reader)
    pipeline.fill_stderr_tails(target.dump_dir, context_facts, began)
    report.processes += context_facts
    report.notes += seen.reader.notes()
    report.notes += pipeline.child_notes(target.dump_dir, report.processes, began)
    report.capture_s = clock.monotonic() - seen.t0
    return report


def kill(target: CaptureTarget, report: HangReport | None = None) -> KillResult:
    """Kill the tree (identity-checked), reap, remove its /dev/shm leftovers; note it in ``report``."""
    started = clock.monotonic()
    if target.roots is None:
        kept = target.before or frozenset()
        result = kill_tree(
            target.root_pid,
            exclude=target.exclude,
            include_root=target.kill_root,
            before=kept | target.spare if target.spare else target.before,
        )
        if target.spare and report is not None:
            report.notes.append(target.spare_note)
    else:
        result = KillResult()
        for root in target.roots:
            _add_kill(result, target, root)
    for root in target.extra_roots:
        _add_kill(result, target, root)
    result.shm_removed = _remove_leftovers(target, result)
    if report is not None:
        report.killed = [p.pid for p in result.killed]
        report.spared = [p.pid for p in result.spared]
        report.survivors = [p.pid for p in result.survivors]
        report.shm_removed = result.shm_removed
        report.kill_s = clock.monotonic() - started
    return result


def _remove_leftovers(target: CaptureTarget, result: KillResult) -> list[str]:
    """/dev/shm segments and temp-dir listeners that the killed processes made or held."""
    root_lives = target.roots is not None or not target.kill_root
    # shm_since 0: a fixture call's children, whose leftovers count from the oldest one's start
    return remove_leftovers(
        result, target.shm_since or None, [target.root_pid] if root_lives else []
    )


def _add_kill(result: KillResult, target: CaptureTarget, root: int) -> None:
    """Kill ``root`` and its tree (runner children: the root too, and its helpers) into ``result``."""
    part = kill_tree(root, exclude=target.exclude, include_root=True, spare_root_helpers=False)
    result.killed += part.killed
    result.spared += part.spared
    result.survivors += part.survivors
    result.reaped.update(part.reaped)
    result.held += part.held


def capture_and_kill(target: CaptureTarget) -> HangReport:
    """A fixture call's hang (the runner's): its children's trees captured, then killed."""
    report = capture(target)
    kill(target, report)
    return report


def fire(
    target: CaptureTarget,
    skip_threads: set[int],
    stall: Stall | None = None,
    from_pytest_timeout: bool = False,
) -> HangReport:
    """A test's deadline fired (the watchdog's): capture, explain, kill. Never raises: what
    fails becomes a note, and the tree is killed whatever the capture did."""
    try:
        report = capture(target, skip_threads=skip_threads)
    except Exception as exc:  # report what is known, and still kill the tree
        report = failed_report(target, exc)
    if stall is not None:
        as_stall(report, target, stall)
    elif from_pytest_timeout:
        report.notes.append("the deadline came from pytest-timeout (--timeout or its marker)")
    try:
        kill(target, report)
    except Exception as exc:
        report.notes.append(f"pytest-torchhang could not kill the tree: {exc!r}")
    return report


def _set_apart(
    target: CaptureTarget, reports: list[ProcessReport]
) -> tuple[list[ProcessReport], list[ProcessReport]]:
    """(the test's, the kept): the workers of a wider fixture's pool (``target.spare``) are
    shown with their stacks for context, as what the test did not start is, and left out of
    the diagnosis, which judges the test's own processes."""
    if not target.spare:
        return reports, []
    pids = {pid for pid, _ in target.spare}
    kept = [r for r in reports if r.pid in pids]
    for report in kept:
        report.role = f"{KEPT_ROLE} ({report.role})" if report.role else KEPT_ROLE
        report.role_facts = Role.parse(report.role)
    return [r for r in reports if r.pid not in pids], kept


def _add_native(reports: list[ProcessReport]) -> list[str]:
    # A process cannot ptrace itself: the pytest process's own stacks stay Python-only.
    me = os.getpid()
    candidates = [r for r in reports if r.pid != me and r.state not in ("zombie", "gone")]
    candidates.sort(key=lambda r: (helper_role(r.role), r.pid))
    result = native_stacks(
        [r.pid for r in candidates], {r.pid for r in candidates if r.role.startswith("rank ")}
    )
    for report in reports:
        report.native = result.stacks.get(report.pid, "")
    return [result.note] if result.note else []
