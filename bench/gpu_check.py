"""Check pytest-torchhang on a real GPU machine: markers, leases, CUDA DataLoader, nccl, CUDA hangs.

Usage, on a Linux machine with NVIDIA GPUs, a CUDA build of torch, and this package installed
(``pip install -e '.[test]'`` for pytest-xdist)::

    python bench/gpu_check.py                 # every scenario the machine has GPUs for
    python bench/gpu_check.py --timeout 60    # hang timeout of the hang scenarios (default 45 s)
    python bench/gpu_check.py --keep          # keep the scenario directories for inspection
    python bench/gpu_check.py nccl_hang       # only the named scenarios

Each scenario is a real pytest session in a temporary directory, run in a subprocess; the script
checks its outcomes and output lines, that no process of it outlived it, prints one line with
the result and the wall time per scenario, and exits 1 if any scenario failed. Scenarios that
need more GPUs than the machine has are listed as skipped. Where there is no real GPU (none
found, a CPU-only torch, or fake GPUs through PYTEST_TORCH_HANG_FAKE_GPUS), it says so and exits
0, so that it can run anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from pytest_torchhang.devices.build import torch_build
from pytest_torchhang.devices.detect import FAKE_GPUS_ENV, detect_gpus

TAG_ENV = "TORCHHANG_GPU_CHECK_TAG"
HERE = "@HERE@"  # replaced by the scenario's directory in the files below

# Functions that run in spawned processes must be importable there: they live in a module.
RANKS = '''
"""Code for spawned children of the scenario tests."""
import datetime
import os
import time

import torch
import torch.distributed as dist


def _init(rank, world_size, store, timeout_s):
    torch.cuda.set_device(rank)  # CUDA_VISIBLE_DEVICES names the test's leased GPUs: cuda:rank
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def nccl_step(rank, world_size, store, out_dir):
    _init(rank, world_size, store, 120)
    try:
        t = torch.full((1 << 20,), float(rank + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        assert torch.all(t == world_size * (world_size + 1) / 2).item(), t[:4].tolist()
        dist.barrier()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as out:
            out.write(f'{{"rank": {rank}, "uuid": "{props.uuid}"}}')
    finally:
        dist.destroy_process_group()


def nccl_stuck(rank, world_size, store):
    # The process-group timeout is far above the plugin's: pytest-torchhang must decide.
    _init(rank, world_size, store, 1800)
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)  # both ranks: the communicator is up
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(3600)  # rank 1 never joins the second collective
    dist.all_reduce(t)
    torch.cuda.synchronize()  # rank 0 waits here for an NCCL kernel that cannot finish


def cuda_stuck(index):
    torch.cuda.set_device(0)
    torch.cuda._sleep(1 << 62)  # a kernel that spins for ~70 years of clock cycles
    torch.cuda.synchronize()
'''

MARKERS = """
import os
import subprocess
import sys
import time

import pytest


def test_00_detection_left_cuda_alone():
    import torch

    assert not torch.cuda.is_initialized()


@pytest.mark.cpu
def test_cpu_test_cannot_reach_a_gpu():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    start = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-c", "import torch; torch.zeros(1).cuda()"],
        capture_output=True, text=True, timeout=300,
    )
    assert child.returncode != 0
    assert "No CUDA GPUs are available" in child.stderr, child.stderr[-2000:]
    print(f"cpu test: .cuda() in a child failed after {time.monotonic() - start:.1f}s")


@pytest.mark.gpu(1)
def test_gpu1_runs_on_one_leased_gpu(request):
    import torch
    from pytest_torchhang.devices import leased_gpus

    assert len(os.environ["CUDA_VISIBLE_DEVICES"].split(",")) == 1
    assert len(leased_gpus(request.node)) == 1
    assert torch.cuda.device_count() == 1
    x = torch.randn(512, 512, device="cuda")
    assert torch.allclose(x @ torch.eye(512, device="cuda"), x)


@pytest.mark.gpu(1024)
def test_never_enough_gpus():
    pass
"""

DATALOADER = """
import pytest
import torch
from torch.utils.data import DataLoader, Dataset


class Rows(Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, index):
        return torch.full((1024,), float(index))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.gpu
def test_cuda_dataloader_with_pinned_memory(workers):
    loader = DataLoader(Rows(), batch_size=32, num_workers=workers, pin_memory=True)
    total = 0.0
    for batch in loader:
        assert batch.is_pinned()
        total += batch.cuda(non_blocking=True).sum().item()
    assert total == 1024 * sum(range(256))
"""

NCCL_STEP = """
import json
import os

import pytest
import torch.multiprocessing as mp

import ranks


@pytest.mark.gpu(2)
def test_two_rank_nccl_step(tmp_path):
    assert len(os.environ["CUDA_VISIBLE_DEVICES"].split(",")) == 2
    mp.start_processes(
        ranks.nccl_step, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2,
        join=True, start_method="spawn",
    )
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen[0]["uuid"] != seen[1]["uuid"], "both ranks ran on one GPU"
"""

NCCL_HANG = """
import pytest
import torch.multiprocessing as mp

import ranks


@pytest.mark.gpu(2)
def test_rank_stuck_in_nccl_all_reduce(tmp_path):
    mp.start_processes(
        ranks.nccl_stuck, args=(2, str(tmp_path / "store")), nprocs=2, join=True,
        start_method="spawn",
    )
"""

CUDA_HANG = """
import pytest
import torch.multiprocessing as mp

import ranks


@pytest.mark.gpu
def test_cuda_kernel_never_finishes():
    mp.start_processes(ranks.cuda_stuck, nprocs=1, join=True, start_method="spawn")
"""

XDIST_LEASES = """
import json
import os
import subprocess
import sys
import time

import pytest

RECORDS = "@HERE@/records"
CHILD = "import torch; print(torch.cuda.get_device_properties(0).uuid)"


@pytest.mark.parametrize("i", range(8))
@pytest.mark.gpu
def test_leased_gpu(i):
    start = time.monotonic()
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-2000:]
    time.sleep(1.0)
    os.makedirs(RECORDS, exist_ok=True)
    record = dict(test=i, uuid=child.stdout.strip(), start=start, end=time.monotonic(),
                  worker=os.environ.get("PYTEST_XDIST_WORKER"))
    with open(os.path.join(RECORDS, f"{i}.json"), "w") as out:
        json.dump(record, out)
"""


def _check_xdist_records(directory: Path, output: str) -> list[str]:
    records = [json.loads(p.read_text()) for p in (directory / "records").glob("*.json")]
    problems = []
    overlaps = 0
    for a, b in itertools.combinations(records, 2):
        if a["start"] < b["end"] and b["start"] < a["end"]:
            overlaps += 1
            if a["uuid"] == b["uuid"]:
                problems.append(f"tests {a['test']} and {b['test']} ran at once on {a['uuid']}")
    if len({r["uuid"] for r in records}) < 2:
        problems.append("all tests ran on one GPU")
    if not overlaps:
        problems.append("no two tests ran at the same time")
    print(
        f"    xdist: {len(records)} tests, {overlaps} overlapping pairs, "
        f"{len({r['uuid'] for r in records})} distinct GPUs"
    )
    return problems


@dataclass(frozen=True)
class Scenario:
    """One pytest session to run and what it must show."""

    name: str
    what: str
    min_gpus: int
    files: dict[str, str]
    outcomes: dict[str, int]  # junit outcome -> count: passed, failed, error, skipped
    args: tuple[str, ...] = ()
    lines: tuple[str, ...] = ()  # fnmatch patterns that must match a line of the output
    hang: bool = False  # runs under --torch-hang-timeout
    needs_xdist: bool = False
    check: Callable[[Path, str], list[str]] | None = field(default=None, compare=False)


SCENARIOS = [
    Scenario(
        "markers",
        "gpu(1) on one leased GPU, cpu hides CUDA from children, gpu(1024) skipped",
        1,
        {"test_markers.py": MARKERS},
        {"passed": 3, "skipped": 1},
        lines=("*needs 1024 CUDA GPUs, found *",),
    ),
    Scenario(
        "dataloader",
        "CUDA DataLoader with pin_memory=True, in-process and 2 workers",
        1,
        {"test_dataloader.py": DATALOADER},
        {"passed": 2},
    ),
    Scenario(
        "nccl_step",
        "2-rank nccl all_reduce, one rank per leased GPU",
        2,
        {"ranks.py": RANKS, "test_nccl_step.py": NCCL_STEP},
        {"passed": 1},
    ),
    Scenario(
        "cuda_hang",
        "a child stuck in torch.cuda.synchronize() caught with its stack",
        1,
        {"ranks.py": RANKS, "test_cuda_hang.py": CUDA_HANG},
        {"failed": 1},
        lines=("*HANG after *test_cuda_kernel_never_finishes*", "*cuda_stuck*", "*synchronize*"),
        hang=True,
    ),
    Scenario(
        "nccl_hang",
        "rank 0 stuck in an nccl all_reduce rank 1 never joins, caught with stacks",
        2,
        {"ranks.py": RANKS, "test_nccl_hang.py": NCCL_HANG},
        {"failed": 1},
        lines=(
            "*HANG after *test_rank_stuck_in_nccl_all_reduce*",
            "*nccl_stuck*",
            "*synchronize*",
        ),
        hang=True,
    ),
    Scenario(
        "xdist_leases",
        "pytest -n 2: gpu(1) tests at the same time never share a GPU",
        2,
        {"test_xdist_leases.py": XDIST_LEASES},
        {"passed": 8},
        args=("-n", "2"),
        needs_xdist=True,
        check=_check_xdist_records,
    ),
]


@dataclass
class Outcome:
    scenario: Scenario
    status: str  # ok, FAIL, skipped
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    output: str = ""


def _junit_outcomes(path: Path) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        if "error" in kinds:
            counts["error"] += 1
        elif "failure" in kinds:
            counts["failed"] += 1
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {kind: n for kind, n in counts.items() if n}


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(TAG_ENV) == tag:
                found.append(proc)
    return found


def run_scenario(scenario: Scenario, root: Path, hang_timeout: float) -> Outcome:
    directory = root / scenario.name
    directory.mkdir()
    for name, source in scenario.files.items():
        text = textwrap.dedent(source).replace(HERE, str(directory))
        (directory / name).write_text(text)
    tag = uuid.uuid4().hex
    dropped = (FAKE_GPUS_ENV, "PYTEST_ADDOPTS")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env[TAG_ENV] = tag
    junit = directory / "junit.xml"
    timeout_args = [f"--torch-hang-timeout={hang_timeout:g}"] if scenario.hang else []
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-rA",
        "-v",
        f"--junitxml={junit}",
        *timeout_args,
        *scenario.args,
    ]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            command,
            cwd=directory,
            env=env,
            capture_output=True,
            text=True,
            timeout=hang_timeout * 4 + 300,
        )
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        output = f"the session itself did not finish: {exc}"
    wall = time.monotonic() - start
    outcome = Outcome(scenario, "ok", wall, output=output)
    if junit.exists():
        got = _junit_outcomes(junit)
        if got != scenario.outcomes:
            outcome.problems.append(f"outcomes {got}, expected {scenario.outcomes}")
    else:
        outcome.problems.append("no junit report: the session did not run")
    lines = output.splitlines()
    for pattern in scenario.lines:
        if not any(fnmatch.fnmatch(line, pattern) for line in lines):
            outcome.problems.append(f"no output line matches {pattern!r}")
    if scenario.check is not None:
        outcome.problems.extend(scenario.check(directory, output))
    deadline = time.monotonic() + 15  # resource trackers and the like exit on their own
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        outcome.problems.append(
            "processes outlived the session: "
            + "; ".join(f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left)
        )
        for proc_left in left:
            with contextlib.suppress(psutil.Error):
                proc_left.kill()
    if outcome.problems:
        outcome.status = "FAIL"
    return outcome


def _has_xdist() -> bool:
    return importlib.util.find_spec("xdist") is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("names", nargs="*", help="Scenarios to run (default: all)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=45.0,
        help="--torch-hang-timeout of the hang scenarios, in seconds",
    )
    parser.add_argument("--keep", action="store_true", help="Keep the scenario directories")
    options = parser.parse_args(argv)

    inventory = detect_gpus()
    if inventory.fake:
        print(
            f"no real GPU present: {FAKE_GPUS_ENV} is set (fake GPUs are a testing "
            "aid for CPU machines); unset it on a GPU machine to run this check"
        )
        return 0
    if inventory.count == 0:
        print(f"no real GPU present ({inventory.describe()}): nothing to check here")
        return 0
    build = torch_build()
    print(
        f"torch {build.version} (CUDA {build.cuda}), {inventory.count} GPU(s): "
        f"{','.join(inventory.devices)} from {inventory.source}"
    )
    unknown = set(options.names) - {s.name for s in SCENARIOS}
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {[s.name for s in SCENARIOS]}")

    root = Path(tempfile.mkdtemp(prefix="torchhang-gpu-check-"))
    outcomes: list[Outcome] = []
    try:
        for scenario in SCENARIOS:
            if options.names and scenario.name not in options.names:
                continue
            if scenario.min_gpus > inventory.count:
                outcomes.append(Outcome(scenario, f"skipped (needs {scenario.min_gpus} GPUs)"))
            elif scenario.needs_xdist and not _has_xdist():
                outcomes.append(Outcome(scenario, "skipped (needs pytest-xdist)"))
            else:
                print(f"  running {scenario.name}: {scenario.what} ...", flush=True)
                outcomes.append(run_scenario(scenario, root, options.timeout))
            done = outcomes[-1]
            print(
                f"{done.scenario.name:14} {done.status:28} {done.wall_s:7.1f}s  "
                f"{done.scenario.what}",
                flush=True,
            )
            for problem in done.problems:
                print(f"    - {problem}")
            if done.problems:
                print(textwrap.indent("\n".join(done.output.splitlines()[-80:]), "    | "))
    finally:
        if options.keep:
            print(f"scenario directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    failed = [o.scenario.name for o in outcomes if o.status == "FAIL"]
    print(
        f"{len(outcomes) - len(failed)} of {len(outcomes)} scenarios ok or skipped"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
