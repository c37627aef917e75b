"""The warm parent (runner/zygote.py) on its own: its protocol, and what its children inherit.

The zygote runs here with nothing preloaded (no torch): what is tested is its own code.
"""

from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
from pathlib import Path

import pytest_torchhang
from pytest_torchhang import clock

PACKAGE_PARENT = str(Path(pytest_torchhang.__file__).parent.parent)


def _request(tmp_path: Path, name: str, text: str) -> tuple[Path, Path]:
    """A request file for the child protocol: print ``text``; returns it and its output file."""
    out = tmp_path / f"{name}.out"
    header = (
        str(tmp_path / f"{name}.result"),
        str(tmp_path / f"{name}.crash"),
        str(tmp_path),
        "zygote test child",
        dict(os.environ),
        list(sys.path),
        str(tmp_path),
        str(out),
        None,
    )
    path = tmp_path / f"{name}.request"
    with open(path, "wb") as request:
        pickle.dump(header, request)
        pickle.dump((print, (text,), {}), request)
    return path, out


def _events(proc: subprocess.Popen[bytes], until: int, budget_s: float = 30.0) -> list[str]:
    """The zygote's stdout lines until ``until`` EXIT lines came, bounded in time."""
    assert proc.stdout is not None
    lines: list[str] = []
    pending = b""
    deadline = clock.monotonic() + budget_s
    while sum(line.startswith("EXIT") for line in lines) < until:
        left = deadline - clock.monotonic()
        assert left > 0, f"the zygote said only {lines}"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            data = os.read(proc.stdout.fileno(), 65536)
            assert data, f"the zygote ended after {lines}"
            pending += data
            *done, pending = pending.split(b"\n")
            lines += [line.decode() for line in done]
    return lines


def test_a_child_forked_by_the_zygote_writes_none_of_the_zygote_s_lines(tmp_path: Path) -> None:
    requests = [_request(tmp_path, f"r{i}", f"child {i} speaking") for i in range(3)]
    path = os.pathsep.join(filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTEST_TORCH_HANG_ZYGOTE_PRELOAD": "", "PYTHONPATH": path}
    env.pop("PYTHONUNBUFFERED", None)  # buffered, as a user's stdout pipe is (CI sets it)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest_torchhang.runner.zygote"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert proc.stdin is not None
        # One write: the zygote forks the later children with the earlier ones' PID lines
        # written to its stdout's buffer.
        proc.stdin.write(b"".join(f"{path}\n".encode() for path, _ in requests))
        proc.stdin.flush()
        lines = _events(proc, until=len(requests))
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=10)
    assert lines[0] == "READY"
    assert sorted(line.split()[0] for line in lines[1:]) == ["EXIT"] * 3 + ["PID"] * 3
    for i, (_, out) in enumerate(requests):
        assert out.read_text() == f"child {i} speaking\n"
