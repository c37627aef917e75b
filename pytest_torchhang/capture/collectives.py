"""Ranks' flight recorders: ask each rank's listener for its collectives, and read its answer."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable

from .. import clock
from ..inject.protocol import collectives_path, collectives_request_path
from ..report.model import Collective

#: Flight-recorder entries kept per rank (the newest).
MAX_COLLECTIVES = 8


def request_collectives(pids: Iterable[int], dump_dir: str | None) -> list[int]:
    """Ask every process with a flight-recorder listener for its entries; returns who was asked.

    Opening the FIFO without blocking fails at once where nobody listens, so this never waits.
    """
    asked: list[int] = []
    if dump_dir is None:
        return asked
    for pid in pids:
        fifo = collectives_request_path(dump_dir, pid)
        if not os.path.exists(fifo):
            continue
        with contextlib.suppress(OSError):
            os.unlink(collectives_path(dump_dir, pid))
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue  # no listener (ENXIO): not a rank, or its listener is gone
        try:
            os.write(fd, b"1")
            asked.append(pid)
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def collect_collectives(
    pids: list[int], dump_dir: str | None, timeout_s: float
) -> dict[int, list[Collective] | str]:
    """The entries each asked process wrote (or why not), waiting at most ``timeout_s``."""
    out: dict[int, list[Collective] | str] = {}
    if dump_dir is None:
        return out
    deadline = clock.monotonic() + timeout_s
    waiting = list(pids)
    while True:
        for pid in list(waiting):
            path = collectives_path(dump_dir, pid)
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue
            waiting.remove(pid)
            if "error" in doc:
                out[pid] = f"flight recorder: {doc['error']}"
            else:
                out[pid] = [c for c in map(_collective, doc.get("entries", [])) if c is not None]
        if not waiting or clock.monotonic() > deadline:
            break
        clock.sleep(0.01)
    for pid in waiting:
        if not os.path.exists(collectives_request_path(dump_dir, pid)):
            # the listener removes its FIFO when it dies, and leaves a note saying why
            out[pid] = "flight recorder: its listener died before answering"
            continue
        out[pid] = "flight recorder: no answer in time (the process may hold the GIL in C)"
    return out


def _collective(entry: dict[str, object]) -> Collective | None:
    try:
        seq = int(entry.get("collective_seq_id") or 0)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None
    name = str(entry.get("profiling_name") or "?").split(":", 1)[-1]
    group = entry.get("process_group")
    sizes = entry.get("input_sizes")
    shapes = (
        [list(s) for s in sizes if isinstance(s, (list, tuple))] if isinstance(sizes, list) else []
    )
    return Collective(
        seq=seq,
        name=name,
        group=str(group[1] if isinstance(group, (list, tuple)) and len(group) > 1 else group or ""),
        sizes=shapes,
        completed=bool(entry.get("retired")) or entry.get("state") == "completed",
    )
