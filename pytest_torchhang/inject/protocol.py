"""The child protocol: every name, environment key, signal, thread prefix and file format that the
processes of a guarded tree (``inject/``) and the plugin's capture share, in one place.

Both sides import it: ``inject/hook.py``, ``beats.py``, ``stress.py`` and the injected
``sitecustomize`` on the child's side; the capture, the watchdog, the runner and the hunt on
the plugin's. Standard library only and cheap to import, like all of ``inject/``: the start-up
hook loads it by path before anything else. ``tests/unit/test_protocol.py`` checks that no other
module spells these literals.
"""

from __future__ import annotations

import os
import signal
import struct

# --- environment keys -------------------------------------------------------------------------

#: Set by the plugin while a timeout is armed; names the directory for per-process dump files.
DUMP_DIR_ENV = "PYTEST_TORCH_HANG_DUMP_DIR"
#: Names the session's pointer to the guarded test's progress board (stall detection armed).
PROGRESS_ENV = "PYTEST_TORCH_HANG_PROGRESS"
#: The run's seed, or the path of the hunt's switch file that holds it during a stressed run
#: (empty during a plain one): set once a session, in the environment of the tree's processes.
STRESS_ENV = "PYTEST_TORCH_HANG_STRESS"
#: The place in the tree of a stressed fork child's other children (a subprocess, the resource
#: tracker); multiprocessing's spawned children get theirs in their preparation data.
STRESS_IDENTITY_ENV = "PYTEST_TORCH_HANG_STRESS_ID"
#: A directory: each stressed process writes the decisions of its schedule to ``<place>.schedule``.
STRESS_RECORD_ENV = "PYTEST_TORCH_HANG_STRESS_RECORD"
#: The key of multiprocessing's preparation data (spawn, forkserver) that hands a stressed child
#: its place: never the environment, which a setenv per start would change under native threads.
STRESS_PLACE_KEY = "torch_hang_stress_place"

# --- the dump signal and the plugin's threads -------------------------------------------------

#: The signal a guarded process answers by writing the stacks of all its threads. A real-time
#: signal, so it does not collide with SIGUSR1/SIGUSR2 handlers that training code installs.
DUMP_SIGNAL = signal.SIGRTMIN + 5
#: Sent to a thread of the pytest process to raise HangError where it is blocked (processwide.py);
#: here so that the plugin's two signals are chosen in one place and never collide.
INTERRUPT_SIGNAL = signal.SIGRTMIN + 6

#: The plugin's own threads are named so, in Python and in the kernel (``/proc/PID/task/TID/comm``,
#: cut at 15 bytes), so that a capture from outside leaves them out of the test's CPU, stress
#: never delays them, and reports set them apart.
THREAD_PREFIX = "torchhang-"
#: Every prefix a thread of the plugin has had: the current one, and the names of reports
#: recorded before the rename (``torch-hang watchdog``, ``pytest-torchhang launcher``).
PLUGIN_THREAD_NAMES = (THREAD_PREFIX, "torch-hang ", "pytest-torchhang ")

# --- files in the dump directory, one set per process ------------------------------------------

#: ``PID<suffix>`` per kind of file; the capture finds gone processes' files by these suffixes.
STACK_SUFFIX = ".stack"  # faulthandler's dump of every thread, on the dump signal
ROLE_SUFFIX = ".role"  # the role a process states for reports (a rank, a runner child)
FR_REQUEST_SUFFIX = ".fr"  # a rank's flight-recorder FIFO (one byte asks for a dump)
COLLECTIVES_SUFFIX = ".collectives.json"  # a rank's flight-recorder entries, on request
STDERR_SUFFIX = ".stderr"  # the tail of what the process wrote to sys.stderr (format below)
NOTES_SUFFIX = ".notes"  # what the plugin's own code failed to do there, one stamped line each
TASKS_SUFFIX = ".tasks.json"  # its event loops' pending tasks, on the dump signal
SIGNALS_SUFFIX = ".signals.json"  # its Python signal handlers and pending alarm, on the dump signal


def _path(dump_dir: str, pid: int, suffix: str) -> str:
    return os.path.join(dump_dir, f"{pid}{suffix}")


def dump_path(dump_dir: str, pid: int) -> str:
    """The file process ``pid`` writes its stacks to."""
    return _path(dump_dir, pid, STACK_SUFFIX)


def role_path(dump_dir: str, pid: int) -> str:
    """The file where a process may state its role (a rank, a runner child) for reports."""
    return _path(dump_dir, pid, ROLE_SUFFIX)


def collectives_request_path(dump_dir: str, pid: int) -> str:
    """The FIFO a rank's flight-recorder listener waits on (one byte asks for a dump)."""
    return _path(dump_dir, pid, FR_REQUEST_SUFFIX)


def collectives_path(dump_dir: str, pid: int) -> str:
    """The JSON file a rank writes its flight-recorder entries to, on request."""
    return _path(dump_dir, pid, COLLECTIVES_SUFFIX)


def stderr_path(dump_dir: str, pid: int) -> str:
    """The file where process ``pid`` keeps a copy of the last text it wrote to ``sys.stderr``."""
    return _path(dump_dir, pid, STDERR_SUFFIX)


def notes_path(dump_dir: str, pid: int) -> str:
    """The file where process ``pid`` appends what the plugin's own code failed to do there."""
    return _path(dump_dir, pid, NOTES_SUFFIX)


def tasks_path(dump_dir: str, pid: int) -> str:
    """The JSON file where process ``pid`` writes its loops' pending tasks, on the dump signal."""
    return _path(dump_dir, pid, TASKS_SUFFIX)


def signals_path(dump_dir: str, pid: int) -> str:
    """The JSON file a process writes its own signal facts to when asked for its stacks."""
    return _path(dump_dir, pid, SIGNALS_SUFFIX)


def pid_of(name: str, suffix: str) -> int | None:
    """The pid of a dump directory's file ``name`` of the kind ``suffix``, else None."""
    stem, _, rest = name.partition(".")
    return int(stem) if f".{rest}" == suffix and stem.isdigit() else None


# --- the stderr copy ------------------------------------------------------------------------------
# ``PID.stderr`` is a fixed-size file the process maps (``MAP_SHARED``) and writes into with
# memory stores, never a system call per line: what it wrote is in the page cache at once, so a
# capture from outside reads it whatever the process does next (hangs in C, dies, is killed).
# Layout: a header (the wall time of the last write, a float64), then the text, UTF-8, followed
# by zero bytes up to the end of the file. When the text reaches the end, its last
# ``STDERR_KEEP_BYTES`` are moved to the front and the rest is zeroed.

STDERR_HEADER = struct.Struct("<d")
#: The text area of a stderr copy; its last ``STDERR_KEEP_BYTES`` survive a wrap (the report
#: shows at most 20 lines / 4 KiB of it: capture/pipeline.py).
STDERR_FILE_BYTES = 64 * 1024
STDERR_KEEP_BYTES = 8 * 1024
STDERR_MAP_BYTES = STDERR_HEADER.size + STDERR_FILE_BYTES


def read_stderr_copy(path: str) -> tuple[bytes, float, bool]:
    """The last (at most ``STDERR_KEEP_BYTES``) bytes of a process's stderr copy, the wall time
    of its last write (0.0: none, or no such file), and whether the text was cut there (its
    first line is then partial). Reads without waiting, while the writer may be writing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return b"", 0.0, False
    try:
        raw = os.pread(fd, STDERR_MAP_BYTES, 0)
    except OSError:
        return b"", 0.0, False
    finally:
        os.close(fd)
    if len(raw) < STDERR_HEADER.size:
        return b"", 0.0, False
    (written,) = STDERR_HEADER.unpack_from(raw)
    text = raw[STDERR_HEADER.size :].rstrip(b"\0")
    return text[-STDERR_KEEP_BYTES:], written, len(text) > STDERR_KEEP_BYTES
