"""A capture stays bounded when /proc reads block: a process stuck on a page nobody serves.

The page is a file of a FUSE file system served by this test, which never answers a READ: the
child's ``poll`` faults on its pollfd array there and waits, and so does any read of that memory
through ``/proc/PID/mem``, as on a hung NFS or FUSE mount. (Root and /dev/fuse are needed.)
"""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_torchhang.capture import procfs, waitgraph
from pytest_torchhang.hang import path as hang_path

_LOOKUP, _FORGET, _GETATTR, _OPEN, _READ, _INIT = 1, 2, 3, 14, 15, 26
_NO_REPLY = {_FORGET, 36, 42}  # FORGET, INTERRUPT, BATCH_FORGET
_ATTR = "<QQQQQQIIIIIIIIII"


def _attr(ino: int) -> bytes:
    mode, size = (0o40755, 0) if ino == 1 else (0o100644, 4096)
    return struct.pack(_ATTR, ino, size, 8, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)


class _StuckFuse:
    """A FUSE file system with one file, ``f``, whose contents are never served."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = os.open("/dev/fuse", os.O_RDWR)
        opts = f"fd={self.fd},rootmode=40000,user_id=0,group_id=0".encode()
        if self.libc.mount(b"torchhang-test", bytes(mountpoint), b"fuse", 0, opts) != 0:
            os.close(self.fd)
            raise OSError(ctypes.get_errno(), "mount")
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.connection = os.minor(os.stat(mountpoint).st_dev)  # its fusectl directory

    def _reply(self, unique: int, payload: bytes = b"", error: int = 0) -> None:
        os.write(self.fd, struct.pack("<IiQ", 16 + len(payload), error, unique) + payload)

    def _serve(self) -> None:
        while True:
            try:
                request = os.read(self.fd, 1 << 20)
            except OSError:
                return  # unmounted
            _len, opcode, unique, node = struct.unpack_from("<IIQQ", request)
            body = request[40:]
            if opcode == _INIT:
                init = struct.pack("<IIIIHHIIHHI", 7, 31, 0, 0, 1, 1, 1 << 16, 1, 1, 0, 0)
                self._reply(unique, init + bytes(28))
            elif opcode == _LOOKUP and body.rstrip(b"\0") == b"f":
                self._reply(unique, struct.pack("<QQQQII", 2, 0, 60, 60, 0, 0) + _attr(2))
            elif opcode == _GETATTR:
                self._reply(unique, struct.pack("<QII", 60, 0, 0) + _attr(node))
            elif opcode == _OPEN:
                self._reply(unique, struct.pack("<QII", 1, 0, 0))
            elif opcode == _READ or opcode in _NO_REPLY:
                continue  # the hang: a READ is never answered
            else:
                self._reply(unique, error=-38)  # ENOSYS

    def close(self) -> None:
        """Abort the connection: every waiter (the child, a reader thread stuck in its page)
        gets an error. Neither closing the device nor unmounting ends requests already sent."""
        connections = Path("/sys/fs/fuse/connections")
        if not any(connections.iterdir()):
            subprocess.run(["mount", "-t", "fusectl", "none", str(connections)], check=False)
        (connections / str(self.connection) / "abort").write_text("1")
        self.libc.umount2(bytes(self.mountpoint), 2)  # MNT_DETACH
        self.thread.join(10)
        os.close(self.fd)


@pytest.fixture
def stuck_child(tmp_path: Path) -> Iterator[int]:
    """A process whose poll() waits on a pollfd array in a page the file system never serves."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse to serve a page that never arrives")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        fs = _StuckFuse(mnt)
    except OSError as exc:
        pytest.skip(f"cannot mount a FUSE file system here: {exc}")
    code = (
        "import ctypes, mmap, sys\n"
        "f = open(sys.argv[1], 'rb')\n"
        "page = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)\n"
        "addr = ctypes.c_void_p.from_buffer(bytearray(8))\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.mmap.restype = ctypes.c_void_p\n"
        "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,"
        " ctypes.c_int, ctypes.c_long]\n"
        "where = libc.mmap(None, 4096, 1, 1, f.fileno(), 0)\n"  # PROT_READ, MAP_SHARED
        "libc.poll.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int]\n"
        "print(hex(where), flush=True)\n"
        "libc.poll(where, 1, -1)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(mnt / "f")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        child.stdout.readline()
        deadline = time.monotonic() + 30
        while procfs.text(f"/proc/{child.pid}/wchan") in ("", "0", "do_sys_poll"):
            assert time.monotonic() < deadline, "the child never reached its poll"
            time.sleep(0.01)
        yield child.pid
    finally:
        fs.close()  # first: a process waiting on a FUSE reply ignores even SIGKILL
        child.kill()
        child.wait(30)


def test_the_wait_for_graph_of_a_process_stuck_on_an_unserved_page_is_read_in_bounded_time(
    stuck_child: int,
) -> None:
    started = time.monotonic()
    evidence = waitgraph.read([stuck_child], budget_s=0.5)
    assert time.monotonic() - started < 0.5 + 1.0
    (task,) = evidence.members[stuck_child].tasks[:1]
    assert task.call == "poll"
    assert any(
        note.startswith(f"pid {stuck_child}:") and "memory at" in note for note in evidence.notes
    ), evidence.notes


def test_a_read_of_its_memory_is_abandoned_and_said_so(stuck_child: int) -> None:
    addr = int(procfs.text(f"/proc/{stuck_child}/syscall").split()[1], 16)
    reader = procfs.ProcReader(timeout_s=0.3, skip_disk_sleep=False)
    started = time.monotonic()
    assert reader.mem(stuck_child, addr, 8) is None
    assert time.monotonic() - started < 0.3 + 1.0
    assert procfs.NOT_IN_TIME in reader.unread[0].reason


def test_the_whole_capture_of_it_is_bounded_and_reports_what_it_could_not_read(
    stuck_child: int,
) -> None:
    target = hang_path.CaptureTarget(
        test_id="t",
        timeout_s=1.0,
        root_pid=stuck_child,
        dump_dir=None,
        roots=[stuck_child],
        root_in_process=False,
        capture_budget_s=1.0,
    )
    report = procfs.call_with_timeout(20.0, hang_path.capture, target)
    # bounded: the wait-for graph, facts and stacks within their budgets (the time left over
    # is pystack/py-spy's own bounded attempt at a Python process without the dump handler)
    assert report.capture_s < 10.0
    assert any(f"pid {stuck_child}:" in note and "memory at" in note for note in report.notes)
