"""Ranks' listeners: ask each for its flight recorder's collectives, its role and its store waits,
and read its answer (and the keys of the FileStores waited on)."""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .. import clock
from ..inject.protocol import collectives_path, collectives_request_path
from ..report.model import Collective, FrameArgs, ProcessReport, Role, StoreWait

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


@dataclass
class RankAnswer:
    """What a rank's listener wrote: its flight recorder's entries (or why not), its role as its
    process group states it, and the store keys its threads wait for."""

    collectives: list[Collective] = field(default_factory=list)
    error: str = ""  # the flight recorder's: the rest may still be there
    role: Role | None = None
    store_waits: list[StoreWait] = field(default_factory=list)
    frame_args: list[FrameArgs] = field(default_factory=list)  # its threads' stuck calls
    notes: list[str] = field(default_factory=list)  # what the listener could not read


def collect_answers(
    pids: list[int], dump_dir: str | None, timeout_s: float
) -> dict[int, RankAnswer | str]:
    """What each asked process wrote (or why nothing), waiting at most ``timeout_s``."""
    out: dict[int, RankAnswer | str] = {}
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
            out[pid] = _answer(doc)
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


def flight_records(answers: dict[int, RankAnswer | str]) -> dict[int, list[Collective] | str]:
    """Each answer's flight-recorder entries, or why there are none."""
    out: dict[int, list[Collective] | str] = {}
    for pid, answer in answers.items():
        if isinstance(answer, str):
            out[pid] = answer
        elif answer.error:
            out[pid] = f"flight recorder: {answer.error}"
        else:
            out[pid] = answer.collectives
    return out


def add_rank_facts(reports: list[ProcessReport], answers: dict[int, RankAnswer | str]) -> list[str]:
    """Each answering rank's role and store waits into its report, with the keys each waited-on
    FileStore holds (read here, from its file); returns notes."""
    notes: list[str] = []
    by_pid = {r.pid: r for r in reports}
    files: dict[str, list[str] | str] = {}
    for pid, answer in answers.items():
        report = by_pid.get(pid)
        if report is None or isinstance(answer, str):
            continue
        report.group_role = answer.role
        notes += [f"pid {pid}: {note}" for note in answer.notes]
        for wait in answer.store_waits:
            if wait.path:
                if wait.path not in files:
                    files[wait.path] = filestore_keys(wait.path)
                found = files[wait.path]
                if isinstance(found, str):
                    wait.keys_note = found
                else:
                    wait.keys_set = found
            elif wait.address:
                wait.keys_note = (
                    "a TCPStore's keys are not read: its client is busy with this very wait"
                )
            else:
                wait.keys_note = f"the keys of a {wait.store} are not read from outside"
        report.store_waits = answer.store_waits
        report.frame_args = answer.frame_args
    return notes


def _answer(doc: dict[str, Any]) -> RankAnswer:
    answer = RankAnswer(notes=[f"its listener could not read {e}" for e in doc.get("errors", [])])
    if "error" in doc:
        answer.error = str(doc["error"])
    else:
        entries = doc.get("entries", [])
        answer.collectives = [c for c in map(_collective, entries) if c is not None]
    role = doc.get("role")
    if isinstance(role, dict) and role.get("kind") == "rank":
        answer.role = Role(
            "rank",
            rank=_int(role.get("rank")),
            world=_int(role.get("world")),
            backend=str(role["backend"]) if role.get("backend") else None,
        )
    for row in doc.get("store_waits", []):
        with contextlib.suppress(TypeError, ValueError):
            answer.store_waits.append(
                StoreWait(
                    thread=str(row.get("thread", "")),
                    method=str(row.get("method", "")),
                    keys=[str(k) for k in row.get("keys", [])],
                    store=str(row.get("store", "")),
                    under=str(row.get("under", "")),
                    prefixed=bool(row.get("prefixed", False)),
                    path=str(row.get("path", "")),
                    address=str(row.get("address", "")),
                    waited_s=float(row.get("waited_s", 0.0)),
                )
            )
    answer.frame_args = [a for a in map(_frame_args, doc.get("frame_args", [])) if a]
    return answer


def _frame_args(row: object) -> FrameArgs | None:
    """One row of the listener's ``frame_args``, or None for one that is not what it wrote."""
    if not isinstance(row, dict) or not isinstance(row.get("args"), dict):
        return None
    line = _int(row.get("line"))
    return FrameArgs(
        thread=str(row.get("thread", "")),
        function=str(row.get("function", "")),
        file=str(row.get("file", "")),
        line=line if line is not None else 0,
        args={str(k): str(v) for k, v in row["args"].items()},
        call=bool(row.get("call", False)),
    )


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


#: How much of a FileStore's file is read, and how many of its keys are kept.
MAX_STORE_BYTES = 4 << 20
MAX_STORE_KEYS = 200


def filestore_keys(path: str) -> list[str] | str:
    """The keys a torch FileStore holds, read from its file (why not, as text, when it cannot be).

    torch appends each ``set`` as two records, the key then the value, each a 32-bit length in
    the machine's byte order and its bytes; a user's key is stored as ``/key``, a deleted one as
    ``-/key``, and the store's own bookkeeping (``refcount/``) under no ``/``. The order is that of
    the first ``set``.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_STORE_BYTES)
    except OSError as exc:
        return f"its file could not be read: {exc.strerror or exc}"
    keys: dict[str, None] = {}
    offset = 0
    while offset + 4 <= len(data):
        (size,) = struct.unpack_from("=I", data, offset)
        key = data[offset + 4 : offset + 4 + size]
        offset += 4 + size
        if offset + 4 > len(data):
            break  # a record cut by the read's bound, or being written
        (size,) = struct.unpack_from("=I", data, offset)
        offset += 4 + size
        if offset > len(data):
            break
        text = key.decode(errors="replace")
        if text.startswith("/"):
            keys[text[1:]] = None
        elif text.startswith("-/"):
            keys.pop(text[2:], None)
    return list(keys)[:MAX_STORE_KEYS]


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
