"""``--torch-hang-rerun``: run only the tests that hung last time, as ``--lf`` does for failures.

Every session records the tests that hung or stalled in pytest's cache (``torchhang/hung``);
a test that ran again without hanging leaves the record, one that did not run keeps its place.
Under pytest-xdist the controller records (it sees every worker's reports) and each worker
selects from the same cache.
"""

from __future__ import annotations

import pytest

OPTION = "--torch-hang-rerun"
#: The cache key of the record: {node id: the headline of its last hang}.
CACHE_KEY = "torchhang/hung"


def register(config: pytest.Config, active: bool) -> None:
    """Record this session's hangs, and select last time's with ``active``; without pytest's
    cache there is nothing to record, and ``active`` is a usage error."""
    cache = getattr(config, "cache", None)
    if cache is None:
        if active:
            raise pytest.UsageError(
                f"{OPTION} reads the tests that hung last time from pytest's cache, and the "
                "cacheprovider plugin is disabled: drop -p no:cacheprovider"
            )
        return
    config.pluginmanager.register(RerunPlugin(config, cache, active), "torchhang-rerun")


class RerunPlugin:
    """Records the session's hangs; with ``--torch-hang-rerun``, deselects every other test."""

    def __init__(self, config: pytest.Config, cache: pytest.Cache, active: bool) -> None:
        self.cache = cache
        self.active = active
        self.controller = not hasattr(config, "workerinput")
        recorded = self.cache.get(CACHE_KEY, {})
        self.before: dict[str, str] = recorded if isinstance(recorded, dict) else {}
        self.hung: dict[str, str] = {}
        self.ran: set[str] = set()
        self.message = ""

    def pytest_report_header(self) -> str | None:
        if not self.active:
            return None
        count = len(self.before)
        if not count:
            return "torch-hang rerun: no test hung last time: running every selected test"
        return f"torch-hang rerun: {count} test(s) hung last time (pytest's cache {CACHE_KEY})"

    @pytest.hookimpl(trylast=True)  # after other plugins have chosen, as --lf runs
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        if not self.active or not self.before:
            return
        selected = [item for item in items if item.nodeid in self.before]
        if not selected:
            self.message = (
                f"torch-hang rerun: none of the {len(self.before)} test(s) that hung last time "
                f"was collected: running all {len(items)}"
            )
            return
        deselected = [item for item in items if item.nodeid not in self.before]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
        items[:] = selected
        self.message = (
            f"torch-hang rerun: {len(selected)} test(s) that hung last time selected, "
            f"{len(deselected)} deselected"
        )

    def pytest_report_collectionfinish(self) -> str | None:
        return self.message or None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not self.controller:
            return
        if self.before:  # only a test of the record can leave it
            self.ran.add(report.nodeid)
        if report.failed:
            from .report import handoff

            if handoff.is_hang(report):
                self.hung.setdefault(report.nodeid, handoff.headline(report))

    def pytest_sessionfinish(self) -> None:
        if not self.controller:
            return
        record = {k: v for k, v in self.before.items() if k not in self.ran}
        record.update(self.hung)
        if record != self.before:
            self.cache.set(CACHE_KEY, record)
