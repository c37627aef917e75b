"""Hang hunting: rerun each selected test N times, group its hangs by signature, summarise.

Each run is an item of its own (``test_x[hunt7]``), so pytest-xdist spreads the runs over its
workers and fixtures (the warm zygote above all) are reused. A hang's signature is the set of
(role, stuck frame) pairs of its processes: the same deadlock in other pids, at other times,
counts once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import pytest

from . import clock
from .report.handoff import HEADLINE_PROPERTY
from .report.model import HangReport

RUN_FIXTURE = "_torch_hang_hunt_run"
RUN_PROPERTY = "torch_hang_hunt_run"
SIGNATURE_PROPERTY = "torch_hang_signature"
REPORT_PROPERTY = "torch_hang_report"
#: Roles that wait by design, and processes the test did not start: never part of a signature.
_NOT_STUCK = (
    "started before this test",
    "resource_tracker",
    "forkserver",
    "torch_shm_manager",
    "Manager server",
)
#: The key of pytest-xdist's workerinput that hands the workers the shared "found" directory.
FOUND_DIR_KEY = "torchhang_hunt_found_dir"
#: The terminal hears how the hunt goes at most this often.
PROGRESS_EVERY_S = 5.0


#: What differs between machines and runs of one hang: addresses, absolute paths, pids.
_UNSTABLE = [
    (re.compile(r"0x[0-9a-fA-F]+"), "0x?"),
    (re.compile(r"(?<![\w.])/(?:[^/\s:()]+/)+([^/\s:()]+)"), r"\1"),
    (re.compile(r"\bpid \d+"), "pid ?"),
]


def _stable(text: str) -> str:
    for pattern, replacement in _UNSTABLE:
        text = pattern.sub(replacement, text)
    return text


def signature(hang: HangReport) -> str:
    """The set of (role, stuck frame) pairs of the hang's processes, as one stable string.

    Equal for the same hang on any machine: no pid, address or absolute path stays in it, so
    ``merge-hunts`` can count one hang across the jobs of a CI matrix.
    """
    pairs = {
        _stable(f"{p.role_data().general()} in {p.stuck_at}")
        for p in hang.processes
        if p.stuck_at and not p.role.startswith(_NOT_STUCK) and p.state not in ("zombie", "gone")
    }
    return "; ".join(sorted(pairs)) or "no stuck frame"


def wilson(hits: int, runs: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of ``hits / runs`` (95% by default): good at 0 and at 1 of N."""
    if runs <= 0:
        return 0.0, 1.0
    p = hits / runs
    centre = p + z * z / (2 * runs)
    spread = z * math.sqrt(p * (1 - p) / runs + z * z / (4 * runs * runs))
    scale = 1 + z * z / runs
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


def hunt_line(test_id: str, hangs: int, runs: int, distinct: int) -> str:
    """``test_x: hung 3 of 200 runs (1.5%, 95% CI 0.5%-4.3%), 2 distinct signatures``.

    The one wording of a hunt's result: the hunt section and ``merge-hunts`` both say it so.
    """
    low, high = wilson(hangs, runs)
    rate = 100 * hangs / runs if runs else 0.0
    return (
        f"{test_id}: hung {hangs} of {runs} runs ({rate:.1f}%, 95% CI "
        f"{100 * low:.1f}%-{100 * high:.1f}%), {distinct} distinct signature"
        f"{'s' if distinct != 1 else ''}"
    )


_PARAMS = re.compile(r"^(.*)\[(.*)\]$")
_RUN_ID = re.compile(r"hunt(\d+)")


def _split(nodeid: str) -> tuple[str, list[str]]:
    match = _PARAMS.match(nodeid)
    return (match.group(1), match.group(2).split("-")) if match else (nodeid, [])


def base_id(nodeid: str) -> str:
    """``test_x.py::test_y[a-hunt7]`` -> ``test_x.py::test_y[a]``; ``test_z[hunt7]`` -> ``test_z``."""
    name, ids = _split(nodeid)
    kept = [part for part in ids if not _RUN_ID.fullmatch(part)]
    return name + (f"[{'-'.join(kept)}]" if kept else "")


def run_number(nodeid: str) -> int:
    """The hunt's run number in ``nodeid``, 0 when it is not a hunted run."""
    for part in _split(nodeid)[1]:
        match = _RUN_ID.fullmatch(part)
        if match:
            return int(match.group(1))
    return 0


@dataclass
class Signature:
    """One distinct way a test hung."""

    text: str
    runs: list[int] = field(default_factory=list)
    headline: str = ""
    first_report: str = ""  # the first report's text, in full
    json_path: str = ""


@dataclass
class Hunted:
    """What the hunt found for one test."""

    test_id: str
    planned: int
    runs: int = 0
    skipped: int = 0
    seconds: float = 0.0
    signatures: dict[str, Signature] = field(default_factory=dict)

    @property
    def hangs(self) -> int:
        return sum(len(s.runs) for s in self.signatures.values())

    def line(self) -> str:
        """``test_x: hung 3 of 200 runs (1.5%, 95% CI 0.5%-4.3%), 2 distinct signatures``."""
        text = hunt_line(self.test_id, self.hangs, self.runs, len(self.signatures))
        if self.skipped:
            text += f"; {self.skipped} more run(s) not needed after its first hang"
        return text

    def to_json(self) -> dict[str, Any]:
        low, high = wilson(self.hangs, self.runs)
        return {
            "schema": "pytest-torchhang/hunt-summary",
            "schema_version": 1,
            "test_id": self.test_id,
            "planned_runs": self.planned,
            "runs": self.runs,
            "hangs": self.hangs,
            "rate": self.hangs / self.runs if self.runs else 0.0,
            "ci95": [low, high],
            "seconds": self.seconds,
            "host": platform.node(),
            "signatures": [
                {
                    "signature": s.text,
                    "count": len(s.runs),
                    "runs": s.runs,
                    "headline": s.headline,
                    "report": s.json_path or None,
                    # the report's name in the same directory: the upload of that directory
                    # still finds it on another machine (merge-hunts)
                    "report_file": os.path.basename(s.json_path) if s.json_path else None,
                }
                for s in self.signatures.values()
            ],
        }


class HuntPlugin:
    """The hooks of ``--torch-hang-hunt``: make the runs, stop at a first hang, summarise."""

    def __init__(self, config: pytest.Config, runs: int, run_all: bool, stress: bool) -> None:
        self.config = config
        self.runs = runs
        self.run_all = run_all
        self.stress = stress
        self.tests: dict[str, Hunted] = {}
        self.started = clock.monotonic()
        self._told = 0.0
        # Where a worker tells the others that a test hung (stop at the first hang, under
        # xdist): made by the controller (or a plain session), handed to the workers, removed
        # at the end by whoever made it.
        workerinput = getattr(config, "workerinput", None)
        given = workerinput.get(FOUND_DIR_KEY) if workerinput else None
        self._owns_found_dir = given is None
        self.found_dir = given or tempfile.mkdtemp(prefix="torchhang-hunt-")
        self._affinity: set[int] | None = None
        self._not_run: set[str] = set()  # runs skipped after their test's first hang
        self._switch = sys.getswitchinterval()

    # --- the runs ---------------------------------------------------------------------------

    @pytest.fixture(name=RUN_FIXTURE)
    def run_fixture(self, request: pytest.FixtureRequest) -> int:
        """The number of this run of a hunted test (1..N)."""
        return int(request.param)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        metafunc.fixturenames.append(RUN_FIXTURE)
        metafunc.parametrize(
            RUN_FIXTURE, range(1, self.runs + 1), indirect=True, ids=lambda n: f"hunt{n}"
        )

    @pytest.hookimpl(optionalhook=True)  # pytest-xdist's: absent without it
    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[FOUND_DIR_KEY] = self.found_dir

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self._owns_found_dir:
            shutil.rmtree(self.found_dir, ignore_errors=True)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if self.run_all or not os.path.exists(self._found_path(base_id(item.nodeid))):
            return
        pytest.skip(
            f"torch-hang hunt: {base_id(item.nodeid)} already hung; "
            "--torch-hang-hunt-all runs every run"
        )

    def _found_path(self, test_id: str) -> str:
        return os.path.join(self.found_dir, re.sub(r"[^A-Za-z0-9_.-]+", "_", test_id)[-150:])

    def found(self, nodeid: str, hang: HangReport) -> list[tuple[str, str]]:
        """A run hung: tell the other runs (and workers), and label the report."""
        os.makedirs(self.found_dir, exist_ok=True)
        with open(self._found_path(base_id(nodeid)), "a") as marker:
            marker.write(f"{run_number(nodeid)}\n")
        return [(SIGNATURE_PROPERTY, signature(hang)), (RUN_PROPERTY, str(run_number(nodeid)))]

    # --- pressure ---------------------------------------------------------------------------

    def begin_run(self) -> None:
        """--torch-hang-hunt-stress, in the pytest process: one CPU, frequent thread switches."""
        if not self.stress:
            return
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            allowed = sorted(os.sched_getaffinity(0))
            self._affinity = set(allowed)
            worker = getattr(self.config, "workerinput", {}).get("workerid", "gw0")
            index = int(re.sub(r"\D", "", worker) or 0)
            os.sched_setaffinity(0, {allowed[index % len(allowed)]})  # children inherit it
        except (AttributeError, OSError):
            self._affinity = None
        clock.sleep(random.random() * 0.005)

    def end_run(self) -> None:
        if not self.stress:
            return
        sys.setswitchinterval(self._switch)
        if self._affinity:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self._affinity)

    # --- what the runs said (on the xdist controller too) -------------------------------------

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if run_number(report.nodeid) == 0:
            return
        test_id = base_id(report.nodeid)
        hunted = self.tests.setdefault(test_id, Hunted(test_id, self.runs))
        if report.when == "setup" and report.skipped:
            hunted.skipped += 1
            self._not_run.add(report.nodeid)
            return
        properties = dict(report.user_properties)
        text = properties.get(SIGNATURE_PROPERTY)
        if report.failed and text is not None and report.when in ("setup", "call", "teardown"):
            sig = hunted.signatures.get(str(text))
            if sig is None:
                sig = hunted.signatures[str(text)] = Signature(
                    str(text),
                    headline=str(properties.get(HEADLINE_PROPERTY, "")),
                    first_report=str(report.longrepr),
                    json_path=str(properties.get(REPORT_PROPERTY, "")),
                )
            run = run_number(report.nodeid)
            if run not in sig.runs:
                sig.runs.append(run)
        if report.when == "teardown" and report.nodeid not in self._not_run:
            hunted.runs += 1
            hunted.seconds += report.duration
            self._tell_progress()

    def _tell_progress(self) -> None:
        now = clock.monotonic()
        if now - self._told < PROGRESS_EVERY_S or hasattr(self.config, "workerinput"):
            return
        self._told = now
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        if getattr(getattr(reporter, "_tw", None), "width_of_current_line", 0):
            reporter.write("\n")  # not on the line of pytest's progress dots
        for hunted in self.tests.values():
            done = hunted.runs + hunted.skipped
            elapsed = now - self.started
            per_run = elapsed / max(1, sum(h.runs for h in self.tests.values()))
            left = per_run * sum(h.planned - h.runs - h.skipped for h in self.tests.values())
            reporter.write_line(
                f"torch-hang hunt: {hunted.test_id}: {done}/{hunted.planned} runs, "
                f"{hunted.hangs} hang(s), {per_run:.2f}s per run, about {left:.0f}s left"
            )

    def summary_lines(self) -> list[str]:
        lines: list[str] = []
        for hunted in self.tests.values():
            lines.append(hunted.line())
            for number, sig in enumerate(hunted.signatures.values(), 1):
                lines.append("")
                lines.append(
                    f"signature {number} of {hunted.test_id}, {len(sig.runs)} run(s) "
                    f"(runs {', '.join(map(str, sorted(sig.runs)))}): {sig.text}"
                )
                lines.append("first report in full:")
                lines.extend("    " + line for line in sig.first_report.splitlines())
            lines.append("")
        return lines

    def write_json(self, report_dir: str | None) -> None:
        if not report_dir:
            return
        for hunted in self.tests.values():
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", hunted.test_id)[-120:]
            path = os.path.join(report_dir, f"{safe}-hunt.json")
            try:
                os.makedirs(report_dir, exist_ok=True)
                with open(path, "w") as out:
                    json.dump(hunted.to_json(), out, indent=1)
            except OSError:
                continue
