"""Hang hunting: rerun each selected test N times, group its hangs by signature, summarise.

Each run is an item of its own (``test_x[hunt7]``), so pytest-xdist spreads the runs over its
workers and fixtures (the warm zygote above all) are reused. A hang's signature is the set of
(role, stuck frame) pairs of its processes: the same deadlock in other pids, at other times,
counts once.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import pytest

from . import clock
from .inject.protocol import STRESS_ENV, STRESS_RECORD_ENV
from .report.handoff import HEADLINE_PROPERTY
from .report.hunts import hunt_line, pressure_lines, signature, wilson
from .report.model import HangReport

RUN_FIXTURE = "_torch_hang_hunt_run"
RUN_PROPERTY = "torch_hang_hunt_run"
SIGNATURE_PROPERTY = "torch_hang_signature"
REPORT_PROPERTY = "torch_hang_report"
#: The key of pytest-xdist's workerinput that hands the workers the shared "found" directory.
FOUND_DIR_KEY = "torchhang_hunt_found_dir"
#: The key of pytest-xdist's workerinput that hands the workers the hunt's seed.
SEED_KEY = "torchhang_hunt_seed"
#: A stressed run's seed, on its hang's report (JUnit property).
SEED_PROPERTY = "torch_hang_hunt_seed"
#: The terminal hears how the hunt goes at most this often.
PROGRESS_EVERY_S = 5.0


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


def run_seed(base: int, test_id: str, run: int) -> int:
    """The seed of one stressed run: drawn from the hunt's seed, the test and the run number,
    so that every worker of an xdist session (and the controller) agrees on it."""
    return random.Random(f"{base}/{test_id}/{run}").randrange(1, 2**31)


@dataclass
class Signature:
    """One distinct way a test hung."""

    text: str
    runs: list[int] = field(default_factory=list)
    headline: str = ""
    first_report: str = ""  # the first report's text, in full
    json_path: str = ""
    seeds: dict[int, int] = field(default_factory=dict)  # stressed run -> its seed


@dataclass
class Tally:
    """The runs of one kind (plain or stressed) of a hunted test."""

    runs: int = 0
    hangs: int = 0
    passed: int = 0
    passed_s: float = 0.0  # the time of the runs that passed: a hung run lasts its timeout

    def per_passing_run(self) -> float | None:
        return self.passed_s / self.passed if self.passed else None

    def to_json(self) -> dict[str, Any]:
        low, high = wilson(self.hangs, self.runs)
        return {
            "runs": self.runs,
            "hangs": self.hangs,
            "rate": self.hangs / self.runs if self.runs else 0.0,
            "ci95": [low, high],
            "seconds_per_passing_run": self.per_passing_run(),
        }


@dataclass
class Hunted:
    """What the hunt found for one test."""

    test_id: str
    planned: int
    runs: int = 0
    skipped: int = 0
    seconds: float = 0.0
    signatures: dict[str, Signature] = field(default_factory=dict)
    plain: Tally = field(default_factory=Tally)
    stressed: Tally = field(default_factory=Tally)

    @property
    def hangs(self) -> int:
        return sum(len(s.runs) for s in self.signatures.values())

    def line(self) -> str:
        """``test_x: hung 3 of 200 runs (1.5%, 95% CI 0.5%-4.3%), 2 distinct signatures``."""
        text = hunt_line(self.test_id, self.hangs, self.runs, len(self.signatures))
        if self.skipped:
            text += f"; {self.skipped} more run(s) not needed after its first hang"
        return text

    def pressure(self) -> list[str]:
        """The plain and the stressed rate, when stress ran (nothing for a plain hunt)."""
        if not self.stressed.runs:
            return []
        kinds = self.plain, self.stressed
        return pressure_lines(*((t.hangs, t.runs, t.per_passing_run()) for t in kinds))

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
            "plain": self.plain.to_json(),
            "stressed": self.stressed.to_json(),
            "signatures": [
                {
                    "signature": s.text,
                    "count": len(s.runs),
                    "runs": s.runs,
                    "seeds": {str(run): seed for run, seed in s.seeds.items()},
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
    """The hooks of ``--torch-hang-hunt``: make the runs, stop at a first hang, summarise.

    With ``--torch-hang-hunt-stress`` the odd runs are stressed and the even ones plain, so the
    summary can say how much stress raised the rate, and what it cost; with
    ``--torch-hang-hunt-seed=S`` every run is stressed with the schedule of ``S``.
    """

    def __init__(
        self,
        config: pytest.Config,
        runs: int,
        run_all: bool,
        stress: bool,
        seed: int | None = None,
    ) -> None:
        self.config = config
        self.runs = runs
        self.run_all = run_all
        self.stress = stress or seed is not None
        self.seed = seed
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
        #: The hunt's own seed, from which each stressed run's seed is drawn (the controller's,
        #: handed to the workers like the found directory).
        self.base_seed = int(
            workerinput.get(SEED_KEY, 0) if workerinput else 0
        ) or random.SystemRandom().randrange(1, 2**31)
        self._not_run: set[str] = set()  # runs skipped after their test's first hang
        #: The switch of stress: named in the environment once a session, as the progress
        #: board is (a setenv per run would race the native threads, OpenMP or CUDA, that read
        #: the environment meanwhile); it holds a stressed run's seed, and nothing otherwise.
        self._switch = ""
        if self.stress:
            fd, self._switch = tempfile.mkstemp(prefix="torchhang-stress-")
            os.close(fd)
            os.environ[STRESS_ENV] = self._switch
        self._durations: dict[str, float] = {}  # nodeid -> its phases' time so far
        self._stressing = False

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
        node.workerinput[SEED_KEY] = self.base_seed

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self._switch:
            if os.environ.get(STRESS_ENV) == self._switch:
                del os.environ[STRESS_ENV]
            with contextlib.suppress(OSError):
                os.unlink(self._switch)
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

    def stressed(self, nodeid: str) -> bool:
        """Whether this run is stressed: every run with a seed given, else the odd runs."""
        return self.stress and (self.seed is not None or run_number(nodeid) % 2 == 1)

    def seed_of(self, nodeid: str) -> int:
        """The seed of a stressed run: ``--torch-hang-hunt-seed``, or drawn for this run."""
        if self.seed is not None:
            return self.seed
        return run_seed(self.base_seed, base_id(nodeid), run_number(nodeid))

    def found(self, nodeid: str, hang: HangReport) -> list[tuple[str, str]]:
        """A run hung: tell the other runs (and workers), and label the report."""
        os.makedirs(self.found_dir, exist_ok=True)
        with open(self._found_path(base_id(nodeid)), "a") as marker:
            marker.write(f"{run_number(nodeid)}\n")
        labels = [(SIGNATURE_PROPERTY, signature(hang)), (RUN_PROPERTY, str(run_number(nodeid)))]
        if self.stressed(nodeid):
            labels.append((SEED_PROPERTY, str(self.seed_of(nodeid))))
        return labels

    def run_note(self, nodeid: str) -> str:
        """What a hung run's report says of its run: plain, or stressed with its seed."""
        run = run_number(nodeid)
        if not self.stressed(nodeid):
            return f"run {run} of {self.runs}, plain (not stressed)"
        seed = self.seed_of(nodeid)
        return (
            f"run {run} of {self.runs}, stressed with seed {seed}; the same schedule again: "
            f"pytest '{base_id(nodeid)}' --torch-hang-hunt=1 --torch-hang-hunt-seed={seed} "
            "(and the same timeout)"
        )

    # --- pressure ---------------------------------------------------------------------------

    def begin_run(self, item: pytest.Item) -> None:
        """A stressed run: its seed in the environment of every process it starts, and the
        same stress in this process for the run (inject/stress.py, loaded only now)."""
        if not self.stressed(item.nodeid):
            return
        from .inject import stress

        seed = self.seed_of(item.nodeid)
        self._flip(str(seed))
        stress.install(seed, "0", os.environ.get(STRESS_RECORD_ENV, ""))
        self._stressing = True

    def end_run(self, item: pytest.Item) -> None:
        if not self._stressing:
            return
        from .inject import stress

        self._stressing = False
        stress.uninstall()
        self._flip("")

    def _flip(self, seed: str) -> None:
        """Say to the processes that start from now on whether they are stressed, and how."""
        with open(self._switch, "w") as switch:
            switch.write(seed)

    # --- what the runs said (on the xdist controller too) -------------------------------------

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if run_number(report.nodeid) == 0:
            return
        test_id = base_id(report.nodeid)
        hunted = self.tests.setdefault(test_id, Hunted(test_id, self.runs))
        tally = hunted.stressed if self.stressed(report.nodeid) else hunted.plain
        if report.when == "setup" and report.skipped:
            hunted.skipped += 1
            self._not_run.add(report.nodeid)
            return
        self._durations[report.nodeid] = self._durations.get(report.nodeid, 0.0) + report.duration
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
                tally.hangs += 1
                if SEED_PROPERTY in properties:
                    sig.seeds[run] = int(str(properties[SEED_PROPERTY]))
        if report.when == "teardown" and report.nodeid not in self._not_run:
            seconds = self._durations.pop(report.nodeid, 0.0)
            hunted.runs += 1
            hunted.seconds += seconds
            tally.runs += 1
            run = run_number(report.nodeid)
            # The first run of each kind pays what the session sets up once (fixtures, the
            # zygote's torch import): left out of the cost of stress when there are others.
            first = run <= 2 and self.runs > 4
            if not first and not any(run in sig.runs for sig in hunted.signatures.values()):
                tally.passed += 1
                tally.passed_s += seconds
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
            lines.extend("    " + line for line in hunted.pressure())
            for number, sig in enumerate(hunted.signatures.values(), 1):
                lines.append("")
                lines.append(
                    f"signature {number} of {hunted.test_id}, {len(sig.runs)} run(s) "
                    f"(runs {', '.join(map(str, sorted(sig.runs)))}): {sig.text}"
                )
                for run in sorted(sig.seeds):
                    lines.append(
                        f"    run {run} was stressed with seed {sig.seeds[run]}: rerun its "
                        f"schedule with --torch-hang-hunt=1 --torch-hang-hunt-seed={sig.seeds[run]}"
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
