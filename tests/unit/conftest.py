"""The fast tier's shared pieces: recorded hang reports, replayed as the capture diagnosed them.

Everything under ``tests/unit`` runs without torch and without a subprocess pytest session. This
file imports nothing heavy: the plugin's modules are imported by the tests that need them.
"""

from __future__ import annotations

import hashlib
import json
import linecache
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_torchhang.report.model import HangReport, Hint, ProcessReport

DATA = Path(__file__).parent / "data"
#: Real hang reports written by the plugin (``record.py`` says how and when to re-record).
RECORDED = sorted(DATA.glob("test_*.json"))
#: What the diagnosis read from the recording machine's disk rather than from the report.
RECORDING = DATA / "recording.json"


def recorded_ids(paths: list[Path]) -> list[str]:
    """Parametrize ids: the corpus scenario each report is from."""
    return [path.stem.removeprefix("test_") for path in paths]


def diagnosis_digest() -> str:
    """A digest of the diagnosis code (every module of the package, by path), to tell whether
    the recordings were diagnosed by it."""
    from pytest_torchhang import diagnosis

    root = Path(diagnosis.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclass
class Replay:
    """Runs the diagnosis on a recorded report as the capture ran it on the recording machine."""

    machine: dict[str, Any]

    @staticmethod
    def load(path: Path) -> HangReport:
        from pytest_torchhang.report.model import HangReport

        return HangReport.from_json(json.loads(path.read_text()))

    @staticmethod
    def diagnosed(report: HangReport) -> list[ProcessReport]:
        """The processes the capture diagnosed: the test's own, not the context facts of
        processes that existed before the test (added to the report after the diagnosis)."""
        from pytest_torchhang.report.model import CONTEXT_ROLE

        return [p for p in report.processes if not p.role.startswith(CONTEXT_ROLE)]

    def hints(self, report: HangReport) -> list[Hint]:
        from pytest_torchhang.diagnosis import engine

        return engine.hints(self.diagnosed(report))

    def headline(self, report: HangReport) -> str:
        from pytest_torchhang.diagnosis import engine

        (root,) = [p for p in report.processes if p.role_facts and p.role_facts.kind == "pytest"]
        phase = f" (during {report.phase})" if report.phase != "call" else ""
        processes = self.diagnosed(report)
        return engine.headline(
            report.test_id + phase,
            report.elapsed_s,
            processes,
            root.pid,
            engine.hints(processes),
        )


@pytest.fixture
def replay(monkeypatch: pytest.MonkeyPatch) -> Iterator[Replay]:
    """The diagnosis, made to read the recording machine instead of this one.

    Two things the rules read at diagnosis time are not in the report: which directory is the
    stdlib (``is_library``), and source lines through ``linecache`` (``enclosing_class``,
    ``_taken_twice``: the recorded session's test files are gone, and the stdlib here may be
    another version's). Both come from ``data/recording.json``. (Whether a fork parent had
    libcuda loaded is a fact of the report, ``ProcessReport.libcuda``; the recordings predate
    it and read False, true of them: the corpus never touches a GPU.)
    """
    from pytest_torchhang.diagnosis import frames

    machine = json.loads(RECORDING.read_text())
    monkeypatch.setattr(frames, "STDLIB", machine["stdlib"])
    for filename, text in machine["sources"].items():
        lines = text.splitlines(keepends=True)
        # mtime None: linecache.checkcache leaves the entry alone
        monkeypatch.setitem(linecache.cache, filename, (len(text), None, lines, filename))
    frames.enclosing_class.cache_clear()
    yield Replay(machine)
    frames.enclosing_class.cache_clear()
