"""Each process's signal facts: masks from /proc, and its own handlers and pending alarm.

The masks (``SigCgt``, ``SigBlk``, ``SigIgn``) are read from outside, for every process. Which
signals run a Python handler, and the ``ITIMER_REAL`` alarm still pending, only the process can
tell: this process reads its own; a child's dump handler writes them (``PID.signals.json``,
``inject.snapshot.signal_snapshot``) once its main thread runs Python code again after the dump
signal, as it writes its asyncio tasks.
"""

from __future__ import annotations

import os
from typing import Any

from .. import clock
from ..inject.protocol import signals_path
from ..inject.snapshot import signal_snapshot
from ..report.model import ProcessReport
from ..report.signals import TOLD, SignalFacts, names
from . import aio, procfs

#: How long the capture waits, at most, for the answers of children that catch a signal.
SIGNALS_WAIT_S = 0.3
_MASKS = {"SigCgt": "caught", "SigBlk": "blocked", "SigIgn": "ignored"}


def masks(reader: procfs.ProcReader, pid: int) -> SignalFacts | None:
    """The process's signal masks from ``/proc/PID/status``; None when it could not be read."""
    raw = reader.file(pid, "status")
    if raw is None:
        return None
    facts = SignalFacts()
    for line in raw.decode("ascii", "replace").splitlines():
        key, _, value = line.partition(":")
        if key in _MASKS:
            try:
                setattr(facts, _MASKS[key], names(int(value.strip(), 16)))
            except ValueError:
                continue
    return facts


def _apply(facts: SignalFacts, doc: dict[str, Any]) -> None:
    handlers = doc.get("handlers")
    if isinstance(handlers, dict):
        facts.handlers = {str(k): str(v) for k, v in handlers.items()}
    alarm = doc.get("alarm_s")
    if isinstance(alarm, int | float):
        facts.alarm_s = float(alarm)


def _asks(report: ProcessReport) -> bool:
    """Whether a child's own answer is worth waiting for: it has a dump handler that answered,
    and catches a signal that could end a wait (a Python process catches SIGINT by default; a
    pending alarm with no handler kills it, and is read only when it answers in time)."""
    caught = report.signals.caught if report.signals else []
    return report.dump_status == "ok" and any(s in caught for s in TOLD if s != "SIGINT")


def add_signals(
    reports: list[ProcessReport],
    reader: procfs.ProcReader,
    dump_dir: str | None,
    since: float,
    budget_s: float,
) -> None:
    """Each live process's signal facts into its report: the masks, and its own answer (this
    process's read here; a child's written since ``since``, wall time, awaited for at most
    ``budget_s`` from those that catch a signal worth telling, taken if there from the rest)."""
    me = os.getpid()
    waiting: dict[int, ProcessReport] = {}
    for report in reports:
        if report.exit_status:
            continue
        report.signals = masks(reader, report.pid)
        if report.signals is None:
            continue
        if report.pid == me:
            _apply(report.signals, signal_snapshot())
        elif dump_dir is not None:
            waiting[report.pid] = report
    deadline = clock.monotonic() + budget_s
    while waiting and dump_dir is not None:
        for pid, report in list(waiting.items()):
            doc = aio.read_answer(signals_path(dump_dir, pid), since, 1 << 16)
            if doc is not None and report.signals is not None:
                _apply(report.signals, doc)
                del waiting[pid]
        if not any(_asks(r) for r in waiting.values()) or clock.monotonic() >= deadline:
            break
        clock.sleep(0.01)
