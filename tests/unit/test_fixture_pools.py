"""The pools a wider fixture's value owns: found through its fields and builtin containers, to a
bounded depth, without running any of the value's own code; a process merely stored there is
not a pool's worker."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import multiprocessing.pool
import subprocess
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from pytest_torchhang import fixtures


class _Def:
    """What ``pool_workers`` reads of a pytest FixtureDef: its name and scope."""

    def __init__(self, argname: str, scope: str = "session") -> None:
        self.argname = argname
        self.scope = scope


class Hostile:
    """A value whose attribute hooks must never run during the search."""

    calls: ClassVar[list[str]] = []

    def __init__(self, **fields: object) -> None:
        self.__dict__.update(fields)

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("__"):
            Hostile.calls.append(name)
        return super().__getattribute__(name)

    def __getattr__(self, name: str) -> Any:
        Hostile.calls.append(name)
        raise AssertionError(f"the search looked up {name!r}")

    @property
    def lazy(self) -> object:
        Hostile.calls.append("lazy")
        raise AssertionError("the search ran a property")


class LoudDict(dict[str, object]):
    def values(self) -> Any:
        raise AssertionError("the search called a dict subclass's values()")


@pytest.fixture(scope="module")
def executor() -> Iterator[concurrent.futures.ProcessPoolExecutor]:
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        assert pool.submit(abs, -1).result(timeout=30) == 1  # its worker starts at first use
        yield pool


def _found(value: object) -> dict[int, str]:
    return fixtures.pool_workers([(_Def("svc"), value)])  # type: ignore[list-item]


def test_a_pool_is_found_through_fields_and_containers_without_running_their_code(
    executor: concurrent.futures.ProcessPoolExecutor,
) -> None:
    worker_pids = set(executor._processes)  # what the search must find
    Hostile.calls.clear()
    value = Hostile(services=LoudDict(pool=executor), wrapped=[{"pool": executor}])
    found = _found(value)
    assert set(found) == worker_pids
    assert found[next(iter(worker_pids))] == (
        "the ProcessPoolExecutor of the session-scoped fixture 'svc'"
    )
    assert Hostile.calls == [], Hostile.calls


def test_the_search_stops_at_its_depth(executor: concurrent.futures.ProcessPoolExecutor) -> None:
    nested: object = executor
    for _ in range(fixtures.SEARCH_DEPTH):
        nested = [nested]
    assert _found(nested)  # the value, then SEARCH_DEPTH levels below it
    assert _found([nested]) == {}


def test_a_process_stored_in_a_fixtures_value_is_not_a_pools_worker() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    process = multiprocessing.get_context("fork").Process(target=abs, args=(-1,))
    threads = multiprocessing.pool.ThreadPool(1)  # a pool of threads: no process to spare
    try:
        assert _found({"filed": [child, process], "threads": threads}) == {}
    finally:
        threads.terminate()
        child.kill()
        child.wait()


def test_only_a_started_unreaped_worker_has_a_pid_to_spare() -> None:
    process = multiprocessing.get_context("fork").Process(target=abs, args=(-1,))
    assert fixtures._live_pid(process) is None  # not started
    process.start()
    pid = fixtures._live_pid(process)
    process.join(timeout=30)  # reaped: its pid may be another process's now
    assert pid == process.pid
    assert fixtures._live_pid(process) is None
