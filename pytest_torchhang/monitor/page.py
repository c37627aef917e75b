"""The current test's deadline on a shared page: the pytest process writes it, the monitor reads it.

Two small areas at the page's end go the other way or carry evidence: the watchdog thread's
heartbeat (its native thread id and the last time it ran, written by that thread), and the
monitor's log of the times it saw pytest stopped by job control (Ctrl-Z, SIGSTOP), which the
watchdog reads when a deadline comes due (a stopped process's clocks stand still).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable

from .. import clock

INF = float("inf")


class DeadlineBoard:
    """The current test's deadline, on a page the monitor reads: no system call per test.

    The pytest process writes it (a seqlock: the sequence number is odd while it writes); the
    monitor reads it whenever it wakes (at least twice a second) and retries a torn read. Only
    the rare events (a deadline fired, the session's end) go through the pipe.
    """

    SIZE = 1 << 16
    _HEAD = struct.Struct("<QQddQQQ")  # seq, generation, deadline, timeout, armed, id len, pairs
    _ID_AT, _ID_MAX = 64, 1024
    _PAIRS_AT = _ID_AT + _ID_MAX
    _PAIR = struct.Struct("<QQ")
    #: The last 4 KiB: the watchdog's heartbeat, then the monitor's stop log (a ring).
    _TAIL_AT = SIZE - 4096
    MAX_PAIRS = (_TAIL_AT - _PAIRS_AT) // _PAIR.size
    _BEAT_AT = _TAIL_AT
    _BEAT = struct.Struct("<QQdd")  # seq, native thread id, last beat, busy since (0: idle)
    _STOPS_AT = _TAIL_AT + 64
    _STOPS_HEAD = struct.Struct("<QQ")  # seq, stops begun so far
    _STOP = struct.Struct("<dd")  # began, ended (inf while it lasts)
    _STOP_RING = 128

    def __init__(self, path: str, create: bool = False) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.SIZE)
            self._page = mmap.mmap(fd, self.SIZE, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.path = path
        self._seq = 0
        self._generation = 0
        self._beat_seq = 0  # the heartbeat's own writer: the watchdog thread
        #: the ``before`` last written, and its pairs as written (still on the page)
        self._before: Iterable[tuple[int, int]] | None = None
        self._pairs: list[tuple[int, int]] | None = None
        self._stops_seq = struct.unpack_from("<Q", self._page, self._STOPS_AT)[0]  # a monitor
        self._stops_seq += self._stops_seq % 2  # restarted after one that died mid-write

    def arm(
        self, deadline: float, timeout: float, before: Iterable[tuple[int, int]], test_id: str
    ) -> None:
        """A new deadline (a new test, a grace, a pause): the monitor forgets any earlier fire.
        ``before`` is written only when it is not the very object written last (the context of
        a run of guarded tests is one object, from test to test)."""
        name = test_id.encode("utf-8", "replace")[: self._ID_MAX]
        self._generation += 1
        if before is self._before and self._pairs is not None:
            self._write(deadline, timeout, 1, name, self._pairs, write_pairs=False)
            return
        pairs = list(before)[: self.MAX_PAIRS]
        self._before, self._pairs = before, pairs
        self._write(deadline, timeout, 1, name, pairs)

    def disarm(self) -> None:
        self._before = self._pairs = None
        self._write(0.0, 0.0, 0, b"", [])

    def _write(
        self,
        deadline: float,
        timeout: float,
        armed: int,
        name: bytes,
        pairs: list[tuple[int, int]],
        write_pairs: bool = True,
    ) -> None:
        page = self._page
        self._seq += 1  # odd: a write is under way
        struct.pack_into("<Q", page, 0, self._seq)
        page[self._ID_AT : self._ID_AT + len(name)] = name
        for index, pair in enumerate(pairs if write_pairs else ()):
            self._PAIR.pack_into(page, self._PAIRS_AT + index * self._PAIR.size, *pair)
        self._seq += 1
        self._HEAD.pack_into(
            page, 0, self._seq, self._generation, deadline, timeout, armed, len(name), len(pairs)
        )

    def read(self) -> tuple[int, float, float, frozenset[tuple[int, int]], str] | None:
        """(generation, deadline, timeout, before, test id) while armed, else None."""
        for _ in range(1000):
            seq, generation, deadline, timeout, armed, length, count = self._HEAD.unpack_from(
                self._page, 0
            )
            if seq % 2:
                clock.sleep(0.0001)
                continue
            name = bytes(self._page[self._ID_AT : self._ID_AT + length])
            pairs = frozenset(
                self._PAIR.unpack_from(self._page, self._PAIRS_AT + i * self._PAIR.size)
                for i in range(count)
            )
            if struct.unpack_from("<Q", self._page, 0)[0] != seq:
                continue  # torn: written meanwhile
            if not armed:
                return None
            return generation, deadline, timeout, pairs, name.decode("utf-8", "replace")
        return None

    # --- the watchdog's heartbeat: written by the watchdog thread, read by the monitor ----------

    def beat(self, now: float, tid: int, busy: bool = False) -> None:
        """The watchdog thread ran at ``now``: evidence that the GIL was not held for good.
        ``busy``: it goes on to act (load its cold path, check for a debugger, fire), which
        may take seconds of a loaded machine before it can say FIRED."""
        self._beat_seq += 2
        since = now if busy else 0.0
        self._BEAT.pack_into(self._page, self._BEAT_AT, self._beat_seq - 1, tid, now, since)
        self._BEAT.pack_into(self._page, self._BEAT_AT, self._beat_seq, tid, now, since)

    def _beat(self) -> tuple[int, float, float] | None:
        for _ in range(1000):
            seq, tid, at, busy = self._BEAT.unpack_from(self._page, self._BEAT_AT)
            if seq % 2 == 0 and self._BEAT.unpack_from(self._page, self._BEAT_AT)[0] == seq:
                return (tid, at, busy) if seq else None
            clock.sleep(0.0001)
        return None

    def last_beat(self) -> tuple[int, float] | None:
        """(the watchdog's native thread id, when it last ran), or None before its first beat."""
        beat = self._beat()
        return beat[:2] if beat is not None else None

    def busy_since(self) -> float:
        """Since when the watchdog thread has been acting without beating again (0: it is not)."""
        beat = self._beat()
        return beat[2] if beat is not None else 0.0

    # --- the stop log: written by the monitor, read by the watchdog -----------------------------

    def stop_began(self, at: float) -> None:
        """The monitor saw pytest stopped; it last saw it running at ``at``."""
        count = self._stops()[0]
        self._write_stop(count, count + 1, at, INF)

    def stop_ended(self, at: float) -> None:
        """The monitor saw the stopped pytest running again at ``at``."""
        count, stops = self._stops()
        if count and stops[-1][1] == INF:
            self._write_stop(count - 1, count, stops[-1][0], at)

    def _write_stop(self, index: int, count: int, began: float, ended: float) -> None:
        page, at = self._page, self._STOPS_AT
        self._stops_seq += 1
        struct.pack_into("<Q", page, at, self._stops_seq)
        slot = at + self._STOPS_HEAD.size + (index % self._STOP_RING) * self._STOP.size
        self._STOP.pack_into(page, slot, began, ended)
        self._stops_seq += 1
        self._STOPS_HEAD.pack_into(page, at, self._stops_seq, count)

    def _stops(self) -> tuple[int, list[tuple[float, float]]]:
        """(stops begun so far, the ones the ring still holds, oldest first)."""
        page, at = self._page, self._STOPS_AT
        for _ in range(1000):
            seq, count = self._STOPS_HEAD.unpack_from(page, at)
            if seq % 2:
                clock.sleep(0.0001)
                continue
            first = max(0, count - self._STOP_RING)
            stops = [
                self._STOP.unpack_from(
                    page, at + self._STOPS_HEAD.size + (i % self._STOP_RING) * self._STOP.size
                )
                for i in range(first, count)
            ]
            if struct.unpack_from("<Q", page, at)[0] == seq:
                return count, stops
        return 0, []

    def stopped_between(self, since: float, now: float) -> float:
        """How long pytest was seen stopped between ``since`` and ``now`` (a stop the monitor
        has not yet seen end counts until ``now``: whoever asks runs, so it has ended)."""
        return stopped_within(self._stops()[1], since, now)


def stopped_within(stops: Iterable[tuple[float, float]], since: float, now: float) -> float:
    """The time the intervals ``stops`` (began, ended; inf: not seen ending yet) cover between
    ``since`` and ``now``."""
    total = 0.0
    for began, ended in stops:
        total += max(0.0, min(ended, now) - max(began, since))
    return total
