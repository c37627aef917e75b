"""Fixtures wider than one test: a hang in their setup, and the worker pools their values own.

pytest caches a module-, class- or session-scoped fixture's value, or the exception its setup
raised, and hands it to every later test of its scope. Three things follow for a hang:

- A hang in such a fixture's setup is one hang: it is reported (and counted, and written as
  JSON) in the test whose setup ran it. pytest re-raises the cached ``HangError`` in every later
  test that uses the fixture: those are setup errors, as for any fixture whose setup raised,
  with a note that points at the first.
- A fixture whose wait the kill ended (a server's "ready" line read to EOF once the server was
  killed) must not hand its value on: its setup fails as the hang it was, and pytest caches
  that failure, not the value.
- The workers of a pool that a wider fixture's value owns (a DataLoader's
  ``persistent_workers``, started at the first epoch, inside whichever test iterated first)
  belong to that value, not to the test during which they started: at a hang they are captured
  but not killed, and the next test iterates the same workers.
"""

from __future__ import annotations

import itertools
import os
import sys
import weakref
from collections.abc import Generator, Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import pytest

from . import deadline
from .exceptions import HangError, add_note

if TYPE_CHECKING:
    from .capture.target import Births, CaptureTarget
    from .report.model import HangReport
    from .session import SessionState
    from .watchdog import TestDeadline

#: How deep a fixture's value is searched for pools (the value, its attributes or items, and
#: theirs), and how many objects at most: a bound, whatever the value holds.
SEARCH_DEPTH = 3
SEARCH_OBJECTS = 2000
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: How long a fixture whose setup returned after a fire waits for that fire's capture and kill.
CAPTURE_WAIT_S = 30.0


class WideFixtures:
    """The session's module-, class- and session-scoped fixtures, as far as hangs concern them."""

    def __init__(self, state: SessionState) -> None:
        self.state = state
        #: every wider fixture set up so far (its cached value is read at a fire)
        self._defs: dict[int, pytest.FixtureDef[Any]] = {}
        #: hangs already reported, by id: (the report, weakly; the test it was reported in)
        self._counted: dict[int, tuple[weakref.ref[HangReport], str]] = {}
        #: hangs raised by a wider fixture's setup, by id of the report: (fixture, scope)
        self._origins: dict[int, tuple[weakref.ref[HangReport], str, str]] = {}

    # --- a hang during a wider fixture's setup --------------------------------------------------

    def setup(
        self, fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
    ) -> Generator[None, object, object]:
        """The body of the ``pytest_fixture_setup`` wrapper for a wider-scoped fixture."""
        __tracebackhide__ = True  # the error a later test re-raises shows the fixture's frames
        self._defs.setdefault(id(fixturedef), fixturedef)
        held = self.state.current
        if held is None:
            return (yield)
        fired = held.fired
        with self.state.fixture_processes():
            try:
                value = yield
                try:
                    error = _hang_since(held, fired)
                except HangError as late:  # the interrupt landed while the capture ended
                    error = HangError(str(late.msg), late.report)
                if error is not None:
                    # the fixture returned, after the kill ended its wait: no frame of it is
                    # left to show, only the hang (as pytest.fail(..., pytrace=False) shows)
                    error.pytrace = False
            except BaseException as exc:
                if isinstance(exc, HangError):
                    self._fail_setup(fixturedef, request, exc)
                    raise
                try:
                    error = _hang_since(held, fired)
                except HangError as late:  # the interrupt landed while the capture ended
                    error = HangError(str(late.msg), late.report)  # without its landing place
                if error is None:
                    raise
                # the setup failed because the kill ended its wait (the server it waited for
                # is dead): it failed as the hang it was, where it failed, for this test and
                # the later ones
                add_note(
                    error, f"(the fixture's setup then raised {exc!r}: the kill ended its wait)"
                )
                error = error.with_traceback(exc.__traceback__)
                self._fail_setup(fixturedef, request, error, replace=True)
                raise error from None
            if error is not None:
                self._fail_setup(fixturedef, request, error)
                raise error
            return value

    def _fail_setup(
        self,
        fixturedef: pytest.FixtureDef[Any],
        request: pytest.FixtureRequest,
        exc: BaseException,
        replace: bool = False,
    ) -> None:
        """Make pytest cache ``exc`` as the fixture's setup failure, not a value that the
        setup returned after the kill ended its wait (pytest caches before this wrapper sees
        the result, and an interrupt may have landed after that); with ``replace``, not the
        failure the kill caused either."""
        if isinstance(exc, HangError) and exc.report is not None:
            known = self._origins.get(id(exc.report))
            if known is None or known[0]() is not exc.report:  # the innermost fixture's, first
                origin = (weakref.ref(exc.report), fixturedef.argname, fixturedef.scope)
                self._origins[id(exc.report)] = origin
        cached = fixturedef.cached_result
        if cached is not None and cached[2] is not None and not replace:
            return  # pytest cached the setup's own failure
        # FixtureDef.cached_result: (value, cache key, (exception, traceback) or None), as
        # pytest's own pytest_fixture_setup writes it since pytest 8.3 (pytest#12264), the
        # oldest this plugin supports
        key = fixturedef.cache_key(request)  # type: ignore[arg-type]
        fixturedef.cached_result = (None, key, (exc, exc.__traceback__))

    # --- one hang, counted once ------------------------------------------------------------------

    def count(self, hang: HangReport, nodeid: str) -> None:
        """``hang`` is reported, in ``nodeid``."""
        self._counted[id(hang)] = (weakref.ref(hang), nodeid)

    def reraised(
        self, raised: BaseException | None, excinfo: pytest.ExceptionInfo[BaseException] | None
    ) -> tuple[str, str] | None:
        """When ``raised`` is a hang reported already (pytest re-raises a wider fixture's
        failed setup in every later test that uses it): the section that says where it was
        reported, for a plain setup error; its traceback then shows the fixture's frames, not
        the plugin's hooks it passed through. Else None."""
        if not isinstance(raised, HangError) or raised.report is None:
            return None
        hang = raised.report
        known = self._counted.get(id(hang))
        if known is None or known[0]() is not hang:
            return None
        if excinfo is not None:
            theirs = excinfo.traceback.filter(
                lambda entry: not str(entry.path).startswith(_PACKAGE_DIR)
            )
            if theirs:
                excinfo.traceback = theirs
        origin = self._origins.get(id(hang))
        if origin is not None and origin[0]() is hang:
            what = f"the {origin[2]}-scoped fixture '{origin[1]}'"
        else:
            what = "a fixture"
        return "torch-hang", (
            f"{what} hung in the setup of {known[1]}: that hang is reported there, once. pytest "
            "re-raises the failure of a fixture's setup in every later test that uses it: "
            "this test did not run, and did not hang"
        )

    # --- the pools their values own --------------------------------------------------------------

    def pool_births(self) -> Births:
        """The workers of pools that wider fixtures' values own now, and their descendants."""
        owners = pool_workers(self._values())
        if not owners:
            return frozenset()
        from .capture import tree

        return tree.births_below(owners)

    def spare_pools(self, target: CaptureTarget) -> CaptureTarget:
        """At a fire: the capture's target with the workers of pools that wider fixtures'
        values own marked as ``spare`` (captured, not killed), and the note that says whose
        they are."""
        owners = pool_workers(self._values())
        if not owners:
            return target
        from .capture import tree

        # those that started before the test are context already: the note is of the others
        spare = tree.births_below(owners) - (target.before or frozenset())
        spared = {pid for pid, _ in spare}
        owners = {pid: owner for pid, owner in owners.items() if pid in spared}
        if not owners:
            return target
        names = sorted(set(owners.values()))
        note = (
            f"spared {len(owners)} worker process(es) {sorted(owners)} and what they started: "
            f"the workers of {', '.join(names)}, which outlive this test (the next test uses "
            "them); they are shown for context, with their stacks, as fixture-owned workers"
        )
        return replace(target, spare=target.spare | spare, spare_note=note)

    def _values(self) -> Iterator[tuple[pytest.FixtureDef[Any], object]]:
        for fixturedef in list(self._defs.values()):  # a copy: pytest's thread may add one
            cached = fixturedef.cached_result
            if cached is not None and cached[2] is None:
                yield fixturedef, cached[0]


def _hang_since(held: TestDeadline, fired: bool) -> HangError | None:
    """The hang declared since the fixture's setup began (its wait ended by the kill), as the
    error its setup raises now; None if there was none."""
    if fired or not held.fired:
        return None
    held.wait_for_capture(CAPTURE_WAIT_S)
    if not held.reports:
        return None  # no capture finished: the pytest report says what is known
    report = held.reports[-1]
    # The test has its HangError now: the watchdog sends no interrupt after this (one already
    # sent finds the hang delivered and raises nothing).
    held.feed(deadline.Delivered())
    return HangError(report.headline, report)


# --- pools: whose workers a fixture's value owns -----------------------------------------------


def pool_workers(values: Iterable[tuple[pytest.FixtureDef[Any], object]]) -> dict[int, str]:
    """pid -> owner, for every worker of a pool that one of ``values`` (fixtures' values) holds.

    A pool here is an object that starts worker processes when it is first used and keeps
    them, in fields of its own, for later uses: a DataLoader with ``persistent_workers``
    (``loader._iterator._workers``), a ``multiprocessing.Pool`` (``_pool``), a
    ``concurrent.futures.ProcessPoolExecutor`` (``_processes``). Only the pool's own code puts
    processes there, so the pool started them, whichever test was running then; and the pool
    is the fixture's. A process that a test started itself and stored in a fixture's list is
    not a pool's worker, and stays the test's.

    The search reads instance dictionaries and builtin containers only (no attribute lookup
    that could run the user's code), to a bounded depth and number of objects.
    """
    out: dict[int, str] = {}
    for fixturedef, value in values:
        owner = f"the {fixturedef.scope}-scoped fixture '{fixturedef.argname}'"
        for kind, processes in _pools(value):
            for proc in processes:
                pid = _live_pid(proc)
                if pid is not None:
                    out.setdefault(pid, f"{kind} of {owner}")
    return out


def _live_pid(proc: object) -> int | None:
    """The pid of a started, unreaped ``multiprocessing`` process: not a recycled one (until
    its owner reaps it and sets its return code, the exited process holds its pid)."""
    # never imported here (it would cost every guarded session): without it, no such process
    process = sys.modules.get("multiprocessing.process")
    if process is None or not issubclass(type(proc), process.BaseProcess):
        return None
    popen = _fields(proc).get("_popen")
    fields = _fields(popen) if popen is not None else {}
    pid = fields.get("pid")
    return pid if type(pid) is int and fields.get("returncode") is None else None


def _pools(value: object) -> Iterator[tuple[str, list[object]]]:
    """(kind, worker process objects) of every pool reachable from ``value``."""
    loader_type = _loader_type()
    seen: set[int] = set()
    level = [value]
    for _ in range(SEARCH_DEPTH + 1):
        below: list[object] = []
        for obj in level:
            if id(obj) in seen or len(seen) >= SEARCH_OBJECTS:
                continue
            seen.add(id(obj))
            found = _workers_of(obj, loader_type)
            if found is not None:
                yield found
                continue
            below.extend(_children(obj))
        level = below


def _loader_type() -> type | None:
    """torch's DataLoader class when torch's data loading is imported (never imported here)."""
    module = sys.modules.get("torch.utils.data.dataloader")
    loader = getattr(module, "DataLoader", None) if module is not None else None
    return loader if isinstance(loader, type) else None


def _fields(obj: object) -> dict[str, object]:
    """``obj``'s instance dictionary, read without running its class's attribute hooks."""
    try:
        fields = object.__getattribute__(obj, "__dict__")
    except Exception:  # no __dict__ (slots, builtins)
        return {}
    return fields if type(fields) is dict else {}


def _workers_of(obj: object, loader_type: type | None) -> tuple[str, list[object]] | None:
    """(kind, worker processes) when ``obj`` is a pool, else None."""
    fields = _fields(obj)
    if loader_type is not None and issubclass(type(obj), loader_type):  # no __class__ lookup
        iterator = fields.get("_iterator")
        if not fields.get("persistent_workers") or iterator is None:
            return "a DataLoader without persistent workers", []  # no pool: not searched below
        return "the persistent DataLoader", _items(_fields(iterator).get("_workers"))
    module = type(obj).__module__
    if module == "multiprocessing.pool" and type(fields.get("_pool")) is list:
        return "the multiprocessing.Pool", _items(fields["_pool"])
    if module == "concurrent.futures.process" and type(fields.get("_processes")) is dict:
        return "the ProcessPoolExecutor", _items(fields["_processes"])
    return None


def _items(obj: object) -> list[object]:
    """The first ``SEARCH_OBJECTS`` items of a builtin container (a dict's values), read as the
    builtin type reads them (a subclass's own methods are not called); [] for anything else."""
    kind = type(obj)
    if kind in (list, tuple, set, frozenset):
        return list(itertools.islice(cast("list[object]", obj), SEARCH_OBJECTS))
    if kind is dict:
        values = dict.values(cast("dict[object, object]", obj))
        return list(itertools.islice(values, SEARCH_OBJECTS))
    return []


def _children(obj: object) -> list[object]:
    """What the search looks at below ``obj``: builtin containers' items, instances' fields."""
    kind = type(obj)
    if kind in (list, tuple, set, frozenset, dict):
        return _items(obj)
    if kind.__module__ == "builtins" or issubclass(kind, type):  # no __class__ lookup
        return []
    return list(_fields(obj).values())
