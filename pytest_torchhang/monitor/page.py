"""The current test's deadline on a shared page: the pytest process writes it, the monitor reads it."""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable

from .. import clock


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
    MAX_PAIRS = (SIZE - _PAIRS_AT) // _PAIR.size

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

    def arm(
        self, deadline: float, timeout: float, before: Iterable[tuple[int, int]], test_id: str
    ) -> None:
        """A new deadline (a new test, a grace, a pause): the monitor forgets any earlier fire."""
        name = test_id.encode("utf-8", "replace")[: self._ID_MAX]
        pairs = list(before)[: self.MAX_PAIRS]
        self._generation += 1
        self._write(deadline, timeout, 1, name, pairs)

    def disarm(self) -> None:
        self._write(0.0, 0.0, 0, b"", [])

    def _write(
        self, deadline: float, timeout: float, armed: int, name: bytes, pairs: list[tuple[int, int]]
    ) -> None:
        page = self._page
        self._seq += 1  # odd: a write is under way
        struct.pack_into("<Q", page, 0, self._seq)
        page[self._ID_AT : self._ID_AT + len(name)] = name
        for index, pair in enumerate(pairs):
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
