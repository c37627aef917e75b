"""Where a hang's report goes: terminal, JUnit XML, JSON files, pytest-xdist, GitHub annotations."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import GuardedRunner, assert_hang
from outcomes import assert_outcomes

HANG_AND_PASS = """
import threading

import torch
from torch.utils.data import DataLoader, Dataset

LOCK = threading.Lock()


class LockedDataset(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        with LOCK:
            return torch.tensor([index])


def test_hangs():
    LOCK.acquire()
    for _ in DataLoader(LockedDataset(), num_workers=2, multiprocessing_context="fork"):
        pass


def test_passes():
    pass
"""


def test_junit_xml_json_files_the_terminal_and_github_actions_carry_the_hang(
    guarded: GuardedRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one session for every place the report goes: each inner session costs a torch start-up
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    guarded.pytester.makepyfile(test_hang=HANG_AND_PASS)
    junit = guarded.pytester.path / "junit.xml"
    reports = guarded.pytester.path / "reports"
    session = guarded.run(f"--junitxml={junit}", f"--torch-hang-report-dir={reports}", timeout=2)
    assert_outcomes(session.result, hang=1, passed=1)
    out = session.result.stdout.str()
    # terminal: the status word, the summary section, the headline in the short summary
    session.result.stdout.fnmatch_lines(
        [
            "*torch-hang summary*",
            "HANG after 2.* in test_hang.py::test_hangs: 3 processes, 2 stuck in DataLoader worker __getitem__",
            "HANG test_hang.py::test_hangs - HANG after 2.*",
        ]
    )
    assert "test_hang.py H." in out
    # GitHub Actions: one error annotation per hang, at the test's line
    session.result.stdout.fnmatch_lines(
        [
            "::error file=test_hang.py,line=18,title=HANG::HANG after 2.* in test_hang.py::test_hangs*"
        ]
    )
    assert out.count("::error ") == 1
    # JUnit XML: the headline is the message, the report the text, and properties say what it was
    case = next(c for c in ET.parse(junit).iter("testcase") if c.get("name") == "test_hangs")
    failure = case.find("failure")
    assert failure is not None
    assert failure.get("message", "").startswith("HANG after 2.")
    assert "[DataLoader worker 0/2 (dataset LockedDataset)]" in (failure.text or "")
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props["torch_hang"] == "true"
    assert props["torch_hang_timeout"] == "2"
    assert props["torch_hang_processes"] == "3"
    # one versioned JSON document per hang
    (path,) = reports.glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["schema"] == "pytest-torchhang/hang-report" and doc["schema_version"] == 1
    assert doc["test_id"] == "test_hang.py::test_hangs" and doc["timeout_s"] == 2
    roles = sorted(p["role"] for p in doc["processes"])
    assert roles == [
        "DataLoader worker 0/2 (dataset LockedDataset)",
        "DataLoader worker 1/2 (dataset LockedDataset)",
        "pytest",
    ]
    worker = next(p for p in doc["processes"] if p["role"].startswith("DataLoader worker 0"))
    frames = [f["name"] for t in worker["threads"] for f in t["frames"]]
    assert "__getitem__" in frames
    assert doc["hints"][0]["text"].startswith("2 DataLoader worker(s) wait for a lock")
    assert len(doc["killed"]) == 2 and doc["headline"].startswith("HANG after 2.")
    session.assert_clean()


def test_under_xdist_the_controller_prints_the_workers_full_report(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_hang=HANG_AND_PASS)
    junit = guarded.pytester.path / "junit.xml"
    reports = guarded.pytester.path / "reports"
    session = guarded.run(
        "-n", "2", f"--junitxml={junit}", f"--torch-hang-report-dir={reports}", timeout=2
    )
    assert_outcomes(session.result, hang=1, passed=1)
    assert_hang(
        session,
        "test_hangs",
        "*[[]DataLoader worker 1/2 (dataset LockedDataset)[]]*",
        "*with LOCK:",
        "cleanup: killed 2 process*",
    )
    failure = next(
        c for c in ET.parse(junit).iter("testcase") if c.get("name") == "test_hangs"
    ).find("failure")
    assert failure is not None and failure.get("message", "").startswith("HANG after 2.")
    assert len(list(reports.glob("*-gw*.json"))) == 1
    session.assert_clean()


PYTEST_TIMEOUT = """
import subprocess
import sys

import pytest


def test_uses_pytest_timeouts_option():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"]).wait()


@pytest.mark.timeout(1)
def test_uses_pytest_timeouts_marker():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"]).wait()


def test_next_test_runs():
    pass
"""


def test_pytest_timeout_deadlines_get_the_whole_tree_report(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_pt=PYTEST_TIMEOUT)
    session = guarded.run("--timeout=2", timeout=None)
    assert_outcomes(session.result, hang=2, passed=1)
    assert_hang(session, "test_uses_pytest_timeouts_option", "HANG after 2.*", "*time.sleep(1000)*")
    assert_hang(
        session, "test_uses_pytest_timeouts_marker", "HANG after 1.*", "cleanup: killed 1 process*"
    )
    assert "Timeout (0:00" not in session.result.stdout.str()  # pytest-timeout's own dump
    session.assert_clean()


def test_with_both_timeouts_the_earlier_deadline_applies(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_pt=PYTEST_TIMEOUT)
    session = guarded.run("--timeout=30", timeout=1.5)
    assert_outcomes(session.result, hang=2, passed=1)
    assert_hang(session, "test_uses_pytest_timeouts_option", "HANG after 1.*")
    session.assert_clean()


PDB = """
import time


def test_sits_in_the_debugger():
    breakpoint()
    time.sleep(2.5)
"""


def test_no_hang_is_declared_while_the_user_is_in_pdb(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_pdb=PDB)
    guarded.monkeypatch.setenv("PYTHONBREAKPOINT", "")
    session = guarded.run(timeout=1, stdin=b"continue\n")
    assert_outcomes(session.result, passed=1)
    assert "HANG" not in session.result.stdout.str()


NATIVE = """
import subprocess
import sys


def test_child_waits_on_a_lock():
    code = "import threading; lock = threading.Lock(); lock.acquire(); lock.acquire()"
    subprocess.Popen([sys.executable, "-c", code]).wait()
"""


def test_native_stacks_show_the_c_frames_where_the_child_waits(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_native=NATIVE)
    session = guarded.run("--torch-hang-native", timeout=2)
    report = assert_hang(
        session,
        "test_child_waits_on_a_lock",
        "*stacks read with pystack/py-spy (most recent call last):",
    )
    # the C frames are the child's own, read by the tool: the wait-for line above names the
    # futex whatever the tool does, and the Python stack stops at lock.acquire()
    block = re.search(
        r"^--- process \d+ \[Python child\].*?(?=^--- process|^cleanup:)", report, re.M | re.S
    )
    assert block, report
    child = block.group()
    native = child[child.index("stacks read with pystack/py-spy") :]
    assert "PyThread_acquire_lock" in native, child
    session.assert_clean()


def _python_alone(root: Path) -> Path:
    """This interpreter linked into ``root/bin``, alone there, with this one's packages.

    A venv's interpreter linked elsewhere is the base interpreter again (the venv is the
    ``pyvenv.cfg`` beside or above it), without the venv's site-packages, so without the plugin
    (a fresh venv, as the README's test command makes, failed so). The venv's ``pyvenv.cfg``
    beside the link and its ``lib`` linked keep them; its ``bin``, where the tools are, stays out.
    """
    (root / "bin").mkdir()
    python = root / "bin" / "python"
    os.symlink(sys.executable, python)
    if sys.prefix != sys.base_prefix:
        venv = Path(sys.prefix)
        shutil.copy(venv / "pyvenv.cfg", root / "pyvenv.cfg")
        for lib in ("lib", "lib64"):
            if (venv / lib).is_dir():
                os.symlink(venv / lib, root / lib)
    return python


def test_without_a_native_tool_the_report_says_so_in_one_line(
    guarded: GuardedRunner,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # a python with no pystack or py-spy beside it, and a PATH without them
    python = _python_alone(tmp_path_factory.mktemp("alone"))
    monkeypatch.setenv("PATH", f"{python.parent}:/usr/bin:/bin")
    guarded.pytester.makepyfile(test_native=NATIVE)
    session = guarded.run("--torch-hang-native", timeout=2, python=str(python))
    assert_hang(
        session,
        "test_child_waits_on_a_lock",
        "note: --torch-hang-native: neither pystack nor py-spy is installed*; Python stacks only",
        "*lock.acquire(); lock.acquire()*",
    )
    session.assert_clean()


WAITS_AND_COLLECTIVES = """
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp


def test_child_reads_what_the_test_never_writes():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    child.wait()


def _ranks(rank, store):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    dist.all_reduce(torch.ones(4))
    if rank == 0:
        dist.all_reduce(torch.ones(8))
    else:
        dist.barrier()


def test_ranks_part_ways(tmp_path):
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "100")
    tmp.start_processes(_ranks, args=(str(tmp_path / "s"),), nprocs=2, start_method="fork")
"""


@pytest.mark.needs_torch
def test_the_report_and_json_carry_wait_for_edges_and_ranks_collectives(
    guarded: GuardedRunner,
) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch, which is not installed")
    guarded.pytester.makepyfile(test_waits=WAITS_AND_COLLECTIVES)
    reports = guarded.pytester.path / "reports"
    session = guarded.run(f"--torch-hang-report-dir={reports}", timeout=3)
    assert_outcomes(session.result, hang=2)
    text = assert_hang(
        session,
        "test_child_reads_what_the_test_never_writes",
        "      blocked in wait4(waits for child * to exit)*",
        "        waits for pid * [[]Python child[]] (its exit (the parent waits for its child))",
        "      blocked in read(fd 0: pipe:[[]*[]])*",
        "        waits for pid * [[]pytest[]] (pipe:[[]*[]], whose write end it holds)",
    )
    # the test waits for the child, which reads the stdin the test never closes: a cycle
    assert "hint: a cycle of waits through 2 processes: pytest" in text
    assert "Close child.stdin" in text
    docs = {
        d["test_id"].split("::")[1]: d
        for d in (json.loads(p.read_text()) for p in reports.glob("*.json"))
    }
    pipe = docs["test_child_reads_what_the_test_never_writes"]
    pytest_pid = next(p["pid"] for p in pipe["processes"] if p["role"] == "pytest")
    child = next(p for p in pipe["processes"] if p["role"] == "Python child")
    (task,) = [t for t in child["tasks"] if t["tid"] == child["pid"]]
    assert task["call"] == "read" and task["python_thread"] == child["threads"][0]["ident"]
    assert {e["pid"] for e in task["waits_for"]} == {pytest_pid}
    assert {h["rule"] for h in pipe["hints"]} == {"join_cycle"}
    assert task["wait"] == {"kind": "pipe", "fd": 0, "inode": task["obj"][len("fd 0: pipe:[") : -1]}
    ranks = docs["test_ranks_part_ways"]
    collectives = {
        p["role"].split()[1]: p["collectives"] for p in ranks["processes"] if p["collectives"]
    }
    assert collectives["0/2"][-1] == {
        "seq": 2, "name": "all_reduce", "group": "default_pg", "sizes": [[8]], "completed": False
    }  # fmt: skip
    assert [c["completed"] for c in collectives["1/2"]] == [True, False]
    assert collectives["1/2"][-1]["name"] == "barrier"
    assert_hang(
        session,
        "test_ranks_part_ways",
        "hint: ranks wait in different collectives (rank 0/2 in all_reduce, rank 1/2 in barrier)*"
        "Flight recorder: rank 0/2 completed #1 all_reduce([[]4[]]) and is in #2 all_reduce([[]8[]]);"
        " rank 1/2 completed #1 all_reduce([[]4[]]) and is in #2 barrier.",
        "    collectives (flight recorder, oldest first):",
        "        #2 barrier on process group 'default_pg' NOT COMPLETED",
    )
    session.assert_clean()
