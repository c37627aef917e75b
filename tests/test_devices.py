"""gpu/cpu markers, GPU detection without CUDA, GPU leases under pytest-xdist, fake GPUs."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from pytest_torchhang.devices import build, detect, leases

FAKE = detect.FAKE_GPUS_ENV
REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "gpu_check.py"

# Inner-session helper: a test body that holds its GPUs for a while and writes down what it saw.
# Its waits (a meeting of workers, a replacement worker's first test) are events read from the
# records folder, each bounded so that a wait that never ends fails the inner test.
RECORDING_CONFTEST = """
import glob, json, os, time
import pytest
from pytest_torchhang.devices import leased_devices, leased_gpus

RECORDS = {records!r}
ORIGINAL_WORKERS = {{"gw0", "gw1"}}
BOUND_S = 90.0


def records():
    return [json.load(open(path)) for path in glob.glob(os.path.join(RECORDS, "*.json"))]


def wait_until(what, done):
    deadline = time.monotonic() + BOUND_S
    while not done():
        assert time.monotonic() < deadline, f"waited {{BOUND_S}}s for {{what}}"
        time.sleep(0.02)


@pytest.fixture
def hold(request):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")

    def run(seconds=0.25, meet=0, replacement=False):
        start = time.monotonic()
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        if meet:  # a barrier: the GPUs are held until ``meet`` workers have arrived
            open(os.path.join(RECORDS, f"meet-{{worker}}"), "w").close()
            wait_until(f"{{meet}} workers to meet", lambda: len(glob.glob(os.path.join(RECORDS, "meet-*"))) >= meet)
        crashed = any(r["test"] == "test_a_crash" for r in records())
        if replacement and crashed and worker in ORIGINAL_WORKERS:
            # the survivor leaves tests for the replacement worker: it holds its GPUs until
            # the replacement has run one
            wait_until("a test on the replacement worker", lambda: any(
                r["worker"] not in ORIGINAL_WORKERS for r in records()))
        time.sleep(seconds)
        record = dict(
            test=request.node.name, worker=worker,
            pid=os.getpid(), cvd=seen, leased=leased_gpus(request.node),
            devices=leased_devices(request.node), start=start, end=time.monotonic(),
        )
        name = os.path.join(RECORDS, f"{{os.getpid()}}-{{time.monotonic_ns()}}")
        with open(name + ".tmp", "w") as out:
            json.dump(record, out)
        os.replace(name + ".tmp", name + ".json")  # readers never see half a record
    return run
"""


@pytest.fixture(autouse=True)
def clean_device_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner sessions start from no fake GPUs, no lease or hang timeout from the outer shell
    (pytester drops the outer PYTEST_ADDOPTS; conftest sets the suite's own)."""
    for name in (FAKE, leases.LEASE_TIMEOUT_ENV, "PYTEST_TORCH_HANG_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


def recording_session(pytester: pytest.Pytester, tests: str) -> Path:
    records = pytester.path / "records"
    records.mkdir()
    pytester.makeconftest(RECORDING_CONFTEST.format(records=str(records)))
    pytester.makepyfile(test_gpus="import os, pytest\n\n" + textwrap.dedent(tests))
    return records


def load_records(records: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(records.glob("*.json"))]


def assert_no_device_shared_while_overlapping(records: list[dict[str, Any]]) -> int:
    """No two tests whose bodies overlapped in time saw a common device; returns the overlaps."""
    overlaps = 0
    for a, b in itertools.combinations(records, 2):
        if a["start"] < b["end"] and b["start"] < a["end"]:
            overlaps += 1
            shared = set(a["cvd"].split(",")) & set(b["cvd"].split(","))
            assert not shared, f"{a['test']} and {b['test']} ran at once on GPUs {shared}"
    return overlaps


# --- skipping -----------------------------------------------------------------------------


def test_a_gpu_test_is_skipped_with_need_and_supply_when_too_few_gpus_are_visible(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAKE, "1")
    pytester.makepyfile(
        """
        import os, pytest

        @pytest.mark.gpu(2)
        def test_two():
            pass

        @pytest.mark.gpu(count=5)
        class TestFive:
            def test_in_class(self):
                pass

        @pytest.mark.gpu
        def test_one():
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
        """
    )
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED * needs 2 CUDA GPUs, found 1 (fake: PYTEST_TORCH_HANG_FAKE_GPUS=1)",
            "SKIPPED * needs 5 CUDA GPUs, found 1 (fake: *)",
        ],
        consecutive=False,
    )


def test_cuda_visible_devices_empty_means_no_gpus_whatever_the_machine_has(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile("import pytest\n\n@pytest.mark.gpu\ndef test_one():\n    pass\n")
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED * needs 1 CUDA GPU, found 0 (*)"])


def test_detection_and_skipping_neither_import_torch_nor_initialise_cuda(
    pytester: pytest.Pytester,
) -> None:
    # Real detection (no fake GPUs): on a GPU machine test_one runs, here it is skipped.
    pytester.makepyfile(
        """
        import sys, pytest

        @pytest.mark.gpu(64)
        def test_never_enough():
            pass

        @pytest.mark.gpu
        def test_one():
            assert "torch" not in sys.modules

        def test_z_cuda_is_untouched():
            assert "torch" not in sys.modules, "the plugin imported torch at start-up"
            import torch
            assert not torch.cuda.is_initialized()
        """
    )
    result = pytester.runpytest_subprocess("-rs", "-p", "no:randomly")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, result.stdout.str()
    assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) == 3
    result.stdout.fnmatch_lines(["SKIPPED * needs 64 CUDA GPUs, found *"])


# --- invalid input ------------------------------------------------------------------------

INVALID_MARKERS = {
    "zero": ("gpu(0)", "@pytest.mark.gpu on test_zero.py::test_it: count must be a whole*got 0;*"),
    "negative": ("gpu(-2)", "*test_negative.py::test_it: count must be a whole*got -2;*"),
    "float": ("gpu(1.5)", "*test_float.py::test_it: count must be a whole*got 1.5;*"),
    "text": ("gpu('2')", "*test_text.py::test_it: count must be a whole*got '2';*"),
    "bool": ("gpu(True)", "*test_bool.py::test_it: count must be a whole*got True;*"),
    "two_args": ("gpu(1, 2)", "*test_two_args.py::test_it: takes one argument, gpu(count=1)*"),
    "bad_kw": ("gpu(n=2)", "*test_bad_kw.py::test_it: takes one argument, gpu(count=1)*"),
    "cpu_args": ("cpu(1)", "@pytest.mark.cpu on test_cpu_args.py::test_it: takes no arguments*"),
    "both": ("cpu\n@pytest.mark.gpu", "*test_both.py::test_it: *both cpu and gpu; keep one"),
}


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_invalid_marker_arguments_are_collection_errors_naming_test_and_marker(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, xdist: bool
) -> None:
    monkeypatch.setenv(FAKE, "2")
    for name, (marker, _) in INVALID_MARKERS.items():
        source = f"import pytest\n\n@pytest.mark.{marker}\ndef test_it():\n    pass\n"
        pytester.makepyfile(**{f"test_{name}": source})
    pytester.makepyfile(test_fine="def test_fine():\n    pass\n")
    result = pytester.runpytest_subprocess(*(["-n", "2"] if xdist else []))
    # A plain run stops after collection errors; xdist workers still run test_fine.
    result.assert_outcomes(errors=len(INVALID_MARKERS), passed=1 if xdist else 0)
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    for _, pattern in INVALID_MARKERS.values():
        result.stdout.fnmatch_lines([pattern])


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_an_invalid_fake_gpu_count_is_a_usage_error_naming_the_variable(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(FAKE, value)
    pytester.makepyfile("def test_one():\n    pass\n")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"ERROR: environment variable {FAKE} must be a whole number of fake GPUs >= 0, "
            f"got '{value}'*"
        ]
    )


def test_an_invalid_lease_timeout_is_a_usage_error_naming_the_ini_key(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini("[pytest]\ntorch_hang_gpu_lease_timeout = soon\n")
    pytester.makepyfile("def test_one():\n    pass\n")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini option torch_hang_gpu_lease_timeout must be*'soon'"])


# --- cpu marker ---------------------------------------------------------------------------


def test_a_cpu_test_hides_cuda_from_its_child_processes_and_gives_it_back_after(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    pytester.makepyfile(
        """
        import os, subprocess, sys, pytest

        CHILD = "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"

        @pytest.fixture
        def seen_in_teardown():
            yield
            assert os.environ["CUDA_VISIBLE_DEVICES"] == ""

        @pytest.mark.cpu
        def test_cpu(seen_in_teardown):
            out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
            assert out.stdout.strip() == "''"

        def test_after():
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=2)


# --- report header ------------------------------------------------------------------------


def test_the_report_header_shows_torch_cuda_gpus_and_timeout_in_one_line(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.metadata

    version = importlib.metadata.version("torch")
    monkeypatch.setenv(FAKE, "4")
    pytester.makepyfile("def test_one():\n    pass\n")
    result = pytester.runpytest_subprocess("--torch-hang-timeout=30")
    result.stdout.fnmatch_lines(
        [
            f"torch-hang: torch {version}, CUDA available: yes, "
            f"GPUs: 4 (fake: {FAKE}=4), timeout 30s (from command line)"
        ]
    )
    monkeypatch.setenv(FAKE, "0")
    result = pytester.runpytest_subprocess()
    result.stdout.fnmatch_lines(
        [f"torch-hang: torch {version}, CUDA available: no, GPUs: 0 (fake: *), timeout off"]
    )


# --- leases -------------------------------------------------------------------------------


def test_under_xdist_tests_running_at_the_same_time_never_share_a_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAKE, "4")
    monkeypatch.setenv(leases.LEASE_TIMEOUT_ENV, "30")
    records = recording_session(
        pytester,
        """
        @pytest.mark.parametrize("i", range(6))
        @pytest.mark.gpu
        def test_one(hold, i):
            hold()

        @pytest.mark.parametrize("i", range(4))
        @pytest.mark.gpu(2)
        def test_two(hold, i):
            hold()

        @pytest.mark.gpu(4)
        def test_all(hold):
            hold()

        @pytest.mark.gpu(5)
        def test_too_many(hold):
            hold()

        def test_unmarked(hold):
            hold()
        """,
    )
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest_subprocess("-n", "2", f"--junitxml={junit}", "-rs")
    result.assert_outcomes(passed=12, skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED * needs 5 CUDA GPUs, found 4 (fake: *)"])

    seen = load_records(records)
    gpu_records = [r for r in seen if r["test"] != "test_unmarked"]
    assert {r["worker"] for r in seen} == {"gw0", "gw1"}
    for record in gpu_records:
        wanted = {"test_one": 1, "test_two": 2, "test_all": 4}[record["test"].split("[")[0]]
        assert len(record["cvd"].split(",")) == wanted, record
        assert record["leased"] == [int(i) for i in record["cvd"].split(",")], record
        assert record["devices"] == record["cvd"].split(","), record
    (unmarked,) = (r for r in seen if r["test"] == "test_unmarked")
    assert unmarked["leased"] is None and unmarked["devices"] is None and unmarked["cvd"] is None
    # whether bodies overlapped here is up to the scheduler: the next test makes them meet
    assert_no_device_shared_while_overlapping(gpu_records)

    properties = {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
        for case in ET.parse(junit).getroot().iter("testcase")
    }
    assert properties["test_all"]["torch_hang_gpus"] == "0,1,2,3"
    assert float(str(properties["test_all"]["torch_hang_gpu_wait_s"])) >= 0


def test_two_workers_holding_gpus_at_the_same_moment_hold_disjoint_gpus(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A barrier inside the bodies: each test keeps its lease until both have arrived, so they
    # hold GPUs at the same moment by construction (a lease that waited for the other test's
    # release would never meet it, and the bounded wait would fail the inner test).
    monkeypatch.setenv(FAKE, "4")
    monkeypatch.setenv(leases.LEASE_TIMEOUT_ENV, "30")
    records = recording_session(
        pytester,
        """
        @pytest.mark.parametrize("i", range(2))
        @pytest.mark.gpu(2)
        def test_meet(hold, i):
            hold(0, meet=2)
        """,
    )
    result = pytester.runpytest_subprocess("-n", "2")
    result.assert_outcomes(passed=2)
    a, b = load_records(records)
    assert {a["worker"], b["worker"]} == {"gw0", "gw1"}
    assert assert_no_device_shared_while_overlapping([a, b]) == 1
    assert sorted(a["leased"] + b["leased"]) == [0, 1, 2, 3]


def test_waiting_for_a_lease_does_not_count_against_the_hang_timeout(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAKE, "2")
    pytester.makepyfile(
        """
        import time, pytest

        @pytest.mark.parametrize("i", range(2))
        @pytest.mark.gpu(2)
        def test_all_gpus(i):
            time.sleep(2.0)  # the second one waits 2 s, then runs 2 s: 4 s > the 3 s timeout
        """
    )
    result = pytester.runpytest_subprocess("-n", "2", "--torch-hang-timeout=3", "-rA")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["waited *s for GPUs 0,1 held by other tests"])


def test_gpus_held_by_a_crashed_worker_are_freed_for_its_replacement_and_the_rest(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAKE, "4")
    monkeypatch.setenv(leases.LEASE_TIMEOUT_ENV, "20")
    records = recording_session(
        pytester,
        """
        @pytest.mark.gpu(4)
        def test_a_crash(hold):
            hold(0.5)
            os._exit(3)  # the worker dies holding every GPU

        @pytest.mark.parametrize("i", range(8))
        @pytest.mark.gpu(2)
        def test_two(hold, i):
            hold(0.2, replacement=True)
        """,
    )
    result = pytester.runpytest_subprocess("-n", "2", "--max-worker-restart=2")
    result.assert_outcomes(passed=8, failed=1)
    result.stdout.fnmatch_lines(["*worker 'gw*' crashed while running*test_a_crash*"])
    seen = load_records(records)
    assert len(seen) == 9
    assert_no_device_shared_while_overlapping(seen)
    crash = next(r for r in seen if r["test"] == "test_a_crash")
    after = [r for r in seen if r["start"] > crash["end"]]
    assert after, "no gpu test ran after the crash"
    assert {r["worker"] for r in seen} - {"gw0", "gw1"}, "the replacement worker ran no test"


def test_a_test_that_waits_too_long_for_gpus_errors_naming_who_holds_them(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAKE, "1")
    pytester.makeini("[pytest]\ntorch_hang_gpu_lease_timeout = 0.3\n")
    pytester.makepyfile(
        """
        import os, pytest

        HELD = []

        def test_a_holder(request):
            plugin = request.config.pluginmanager.get_plugin("torchhang-devices")
            HELD.append(plugin.leaser.acquire(1, 1, 0, "the holder test"))

        @pytest.mark.gpu
        def test_b_waits():
            pass

        def test_c_release():
            HELD.pop().release()

        @pytest.mark.gpu
        def test_d_after():
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
        """
    )
    result = pytester.runpytest_subprocess("--strict-config", "-p", "no:randomly")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_b_waits*",
            "*test_b_waits: gave up waiting for 1 of 1 GPUs after 0.3s "
            "(torch_hang_gpu_lease_timeout / *); GPU 0 held by the holder test",
        ]
    )


def test_leased_gpus_are_translated_through_the_sessions_cuda_visible_devices(
    pytester: pytest.Pytester,
) -> None:
    # As detection would report a machine started with CUDA_VISIBLE_DEVICES=GPU-a,GPU-b,7,GPU-d.
    pytester.makeconftest(
        """
        from pytest_torchhang.devices.detect import GpuInventory

        def pytest_sessionstart(session):
            plugin = session.config.pluginmanager.get_plugin("torchhang-devices")
            plugin._inventory = GpuInventory(("GPU-a", "GPU-b", "7", "GPU-d"), "test")
        """
    )
    pytester.makepyfile(
        """
        import os, pytest
        from pytest_torchhang.devices import leased_devices, leased_gpus

        HELD = []

        def test_a_holds_gpu_1(request):
            plugin = request.config.pluginmanager.get_plugin("torchhang-devices")
            HELD.append(plugin.leaser.acquire(1, 4, 0, "test_a", [1]))

        @pytest.mark.gpu(2)
        def test_b_two(request):
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-a,7"
            assert leased_gpus(request.node) == [0, 2]
            assert leased_devices(request.node) == ["GPU-a", "7"]

        def test_c_unmarked(request):
            assert leased_gpus(request.node) is None and leased_devices(request.node) is None
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=3)


def test_once_a_gpu_test_initialised_cuda_in_process_later_gpu_tests_keep_its_gpus(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAKE, "4")
    monkeypatch.setenv(leases.LEASE_TIMEOUT_ENV, "0.3")
    # A stand-in for torch whose CUDA "initialises" in test_a: importing torch costs 3 s.
    pytester.makeconftest(
        """
        import sys, types

        STATE = {"cuda": False}
        sys.modules["torch"] = types.SimpleNamespace(
            cuda=types.SimpleNamespace(is_initialized=lambda: STATE["cuda"])
        )
        """
    )
    pytester.makepyfile(
        """
        import os, pytest
        from conftest import STATE

        HELD = []

        @pytest.mark.gpu
        def test_a_initialises_cuda():
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
            STATE["cuda"] = True

        @pytest.mark.gpu
        def test_b_gets_the_same_gpu():
            assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"

        def test_c_someone_else_takes_gpu_0(request):
            plugin = request.config.pluginmanager.get_plugin("torchhang-devices")
            HELD.append(plugin.leaser.acquire(1, 4, 0, "another worker", [0]))

        @pytest.mark.gpu
        def test_d_waits_for_gpu_0_not_another():
            pass

        @pytest.mark.gpu(2)
        def test_e_cannot_have_two_gpus_in_this_process():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*test_d_waits_for_gpu_0_not_another: gave up waiting for 1 of GPUs 0 after 0.3s"
            "*GPU 0 held by another worker",
            "*test_e_cannot_have_two_gpus_in_this_process: CUDA was initialised in this pytest "
            "process (main) during *test_a_initialises_cuda, with GPU(s) 0 of its lease;*",
        ],
        consecutive=False,
    )


def test_a_lease_prefers_the_candidates_given_in_order(tmp_path: Path) -> None:
    leaser = leases.GpuLeaser(str(tmp_path / "leases"))
    assert leaser.acquire(2, 4, 0, "a", [3, 1, 0, 2]).indices == (1, 3)
    with pytest.raises(leases.LeaseTimeout, match=r"1 of GPUs 3 after 0s.*GPU 3 held by a"):
        leaser.acquire(1, 4, 0, "b", [3])


def test_a_lease_is_all_or_nothing_and_ends_with_release(tmp_path: Path) -> None:
    leaser = leases.GpuLeaser(str(tmp_path / "leases"))
    first = leaser.acquire(3, 4, 0, "first")
    assert first.indices == (0, 1, 2)
    with pytest.raises(leases.LeaseTimeout, match=r"2 of 4 GPUs.*GPU 0 held by first"):
        leaser.acquire(2, 4, 0.1, "second")
    single = leaser.acquire(1, 4, 0, "third")  # the failed request kept nothing
    assert single.indices == (3,)
    first.release()
    first.release()
    assert leaser.acquire(3, 4, 0, "fourth").indices == (0, 1, 2)


# --- detection, as plain functions --------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "physical", "expected"),
    [
        (None, 3, ("0", "1", "2")),
        ("", 3, ()),
        ("2,0", 3, ("2", "0")),
        (" 1 , 2", 4, ("1", "2")),
        ("1,7,2", 4, ("1",)),  # stops at the first device that does not exist
        ("1,-1,2", 4, ("1",)),
        ("1,1", 4, ()),  # a repeated device hides them all
        ("0", 0, ()),
        ("GPU-aa,GPU-bb", 2, ("GPU-aa", "GPU-bb")),
        ("MIG-1,MIG-2,0", 1, ("MIG-1", "MIG-2")),
    ],
)
def test_cuda_visible_devices_is_read_the_way_cuda_reads_it(
    value: str | None, physical: int, expected: tuple[str, ...]
) -> None:
    assert detect.visible_devices(value, physical) == expected


def test_fake_gpus_override_detection_and_cuda_visible_devices() -> None:
    inventory = detect.detect_gpus({FAKE: "3", "CUDA_VISIBLE_DEVICES": ""})
    assert (inventory.count, inventory.devices, inventory.fake) == (3, ("0", "1", "2"), True)


def test_the_torch_build_is_read_without_importing_torch() -> None:
    code = (
        "import sys; from pytest_torchhang.devices.build import torch_build; b = torch_build(); "
        "assert 'torch' not in sys.modules; print(b.version, b.known)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import importlib.metadata

    assert out.stdout.split() == [importlib.metadata.version("torch"), "True"]


# --- the package: one job a module, imports flowing one way -------------------------------

# Each module of pytest_torchhang.devices and the package modules it may import: the hooks use
# the leaser and detection, detection reads the torch build, and nothing reaches up to plugin.py.
DEVICES_IMPORTS = {
    "__init__": {"devices.detect", "devices.leases", "devices.markers"},
    "build": set(),
    "detect": {"devices.build"},
    "leases": {"settings"},
    "markers": {"devices.build", "devices.detect", "devices.leases", "settings"},
}


def imported_package_modules(path: Path) -> set[str]:
    """The modules of pytest_torchhang that the devices module at ``path`` imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            module = importlib.util.resolve_name(base, "pytest_torchhang.devices")
            if node.module:  # from .detect import X: X is a name in detect
                names.add(module)
            else:  # from .. import settings: settings is a module
                names.update(f"{module}.{alias.name}" for alias in node.names)
    prefix = "pytest_torchhang."
    return {name.removeprefix(prefix) for name in names if name.startswith(prefix)}


def test_each_devices_module_has_one_job_and_imports_only_modules_below_it() -> None:
    package = Path(build.__file__).parent
    assert sorted(p.stem for p in package.glob("*.py")) == sorted(DEVICES_IMPORTS)
    for name, allowed in DEVICES_IMPORTS.items():
        path = package / f"{name}.py"
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        assert docstring and "\n" not in docstring, f"{path}: wants a one-line docstring"
        assert imported_package_modules(path) <= allowed, (name, imported_package_modules(path))


def test_importing_the_devices_package_starts_no_process_nor_loads_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        started = []
        sys.addaudithook(
            lambda event, args: started.append(event)
            if event in ("subprocess.Popen", "os.fork", "os.posix_spawn", "os.exec") else None
        )
        from pytest_torchhang import devices
        from pytest_torchhang.devices import detect, leases, markers
        assert not started, started
        assert "torch" not in sys.modules and "pytest_torchhang.plugin" not in sys.modules
        # The names plugin.py, fixtures.py and user code use, still at the package's top level.
        assert devices.DevicePlugin is markers.DevicePlugin
        assert devices.leased_gpus is markers.leased_gpus
        assert devices.leased_devices is markers.leased_devices
        assert devices.fake_gpu_count is detect.fake_gpu_count
        assert devices.FAKE_GPUS_ENV == detect.FAKE_GPUS_ENV
        assert devices.LEASE_TIMEOUT_ENV == leases.LEASE_TIMEOUT_ENV
        assert devices.LEASE_TIMEOUT_INI == leases.LEASE_TIMEOUT_INI
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- bench/gpu_check.py -------------------------------------------------------------------


@pytest.mark.parametrize("fake", [None, "2"])
def test_the_gpu_check_exits_cleanly_where_there_is_no_real_gpu(
    monkeypatch: pytest.MonkeyPatch, fake: str | None
) -> None:
    if detect.detect_gpus({}).count and fake is None:
        pytest.skip("a real GPU is present: run bench/gpu_check.py itself")
    env = dict(os.environ)
    if fake is not None:
        env[FAKE] = fake
    out = subprocess.run(
        [sys.executable, str(BENCH)], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no real GPU" in out.stdout


def test_the_gpu_check_scenarios_are_valid_python(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    for scenario in module.SCENARIOS:
        for name, source in scenario.files.items():
            compile(source, f"{scenario.name}/{name}", "exec")
