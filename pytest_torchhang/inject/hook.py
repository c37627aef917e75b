"""Start-up hook for every Python process of a guarded test: dump all thread stacks on a signal
(and, from the main thread, the pending tasks of its asyncio event loops).

This module must stay standard-library only and cheap to import: the injected ``sitecustomize``
loads it by path in every interpreter a guarded test starts, before any user code runs.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
import time
from typing import TYPE_CHECKING, Any, TextIO

from .imports import C10D, after_import, sibling
from .protocol import (
    DUMP_DIR_ENV,
    DUMP_SIGNAL,
    THREAD_PREFIX,
    collectives_path,
    collectives_request_path,
    dump_path,
    notes_path,
    role_path,
    signals_path,
    tasks_path,
)
from .snapshot import MAX_TASKS as MAX_TASKS  # the bound a test of the snapshot reads here
from .snapshot import asyncio_snapshot, signal_snapshot
from .stderr import StderrTail

if TYPE_CHECKING:
    import threading
    from types import ModuleType

# Wall time out of reach of a test's patches of ``time`` (freezegun, time-machine), as the
# package's ``clock.wall`` reads it (this module may not import the package): the host's while
# it agrees with its last trusted reading carried on the boot clock, else that reading carried.
# A note's time is compared with a capture's start.
_boottime = functools.partial(time.clock_gettime, time.CLOCK_BOOTTIME)
_realtime = functools.partial(time.time)
_anchor = (time.time(), _boottime())


def _wall() -> float:
    global _anchor
    wall_then, boot_then = _anchor
    now = _boottime()
    carried = wall_then + (now - boot_then)
    host = _realtime()
    if abs(host - carried) < 1.0:
        _anchor = (host, now)
        return host
    return carried


def name_thread(thread: threading.Thread) -> None:
    """Give a started thread of the plugin its Python name in the kernel too (Python before 3.14
    does not), where a reader from outside sees it."""
    if thread.native_id is None:
        return
    try:
        with open(f"/proc/self/task/{thread.native_id}/comm", "w") as comm:
            comm.write(thread.name.encode()[:15].decode(errors="ignore"))
    except OSError:  # no procfs (another platform), or the thread is gone
        pass


def child_note(text: str) -> None:
    """Record a failure of the plugin's own child-side code (a patch, a listener) for the report.

    Nothing the plugin does in a child may fail silently: the capture reads these notes into the
    hang report. Each line starts with the wall time, so a capture keeps only its test's notes.
    Never raises (no dump directory: nothing is written).
    """
    dump_dir = _Registration.dump_dir or os.environ.get(DUMP_DIR_ENV)
    if not dump_dir:
        return
    line = f"{_wall():.3f} " + " ".join(text.split())[:1000] + "\n"
    try:
        fd = os.open(
            notes_path(dump_dir, os.getpid()), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
        )
    except OSError:
        return
    try:
        os.write(fd, line.encode("utf-8", "replace"))  # one write: lines never interleave
    except OSError:
        pass
    finally:
        os.close(fd)


def set_role(role: str) -> None:
    """Record this process's role for hang reports (no-op when no dump directory is set)."""
    dump_dir = _Registration.dump_dir or os.environ.get(DUMP_DIR_ENV)
    if dump_dir and os.path.isdir(dump_dir):
        try:
            with open(role_path(dump_dir, os.getpid()), "w") as out:
                out.write(role)
        except OSError as exc:
            child_note(
                f"pytest-torchhang could not record the role {role!r} of pid {os.getpid()}: {exc}"
            )


class _Registration:
    """Per-process state of the hook: which file the handler writes to (kept open on purpose)."""

    dump_dir: str | None = None
    file: TextIO | None = None
    pid: int = 0  # the process the handler was registered in (a fork child re-registers)
    fork_hook_installed = False
    finder_installed = False
    listener_pid = 0  # the process whose flight-recorder listener runs (not inherited by fork)
    #: Flight-recorder entries older than this (ns, wall clock) are not this process's: a fork
    #: copies its parent's ring buffer, and an earlier, destroyed process group leaves entries.
    group_since_ns = 0
    #: The dump handler chains to the Python one that writes the asyncio tasks (main thread).
    python_handler = False


def keep_stderr_tail() -> bool:
    """Copy what this process writes to ``sys.stderr`` to its file in the dump directory.

    For the processes of a guarded tree only (the start-up hook and every fork of a guarded
    process call it; pytest captures its own stderr). Returns False when there is no dump
    directory or no ``sys.stderr``. Idempotent: an inherited wrapper is kept (it opens this
    process's own file at its first write).
    """
    import sys

    dump_dir = _Registration.dump_dir or os.environ.get(DUMP_DIR_ENV)
    stream = sys.stderr
    if not dump_dir or stream is None:
        return False
    if isinstance(stream, StderrTail):
        stream._torchhang_dir = dump_dir
        return True
    sys.stderr = StderrTail(stream, dump_dir, child_note)
    return True


def guarded_env() -> dict[str, str]:
    """Extra environment variables every process of a guarded tree gets, unless the user set them.

    ``TORCH_FR_BUFFER_SIZE`` turns on torch's flight recorder, so a hang report can show each
    rank's last collectives; it must be set before a process group is created.
    """
    return {"TORCH_FR_BUFFER_SIZE": "100"}


def _register() -> None:
    dump_dir = _Registration.dump_dir
    if dump_dir is None:
        return
    inherited = _Registration.file
    try:
        new_file = open(dump_path(dump_dir, os.getpid()), "w")  # noqa: SIM115 - must outlive us
    except OSError as exc:
        child_note(
            f"pytest-torchhang could not open the stack dump file of pid {os.getpid()}, so its "
            f"stacks cannot be taken: {exc}"
        )
        return
    if inherited is None:  # faulthandler is not registered here yet: install its chain first
        _chain_python_handler()
    chain = _Registration.python_handler
    faulthandler.register(DUMP_SIGNAL, file=new_file, all_threads=True, chain=chain)
    _Registration.file = new_file
    _Registration.pid = os.getpid()
    if inherited is not None and inherited is not new_file:
        # After fork the parent's file object came along; close our copy of its descriptor so
        # every fork generation does not carry one more open file.
        try:  # noqa: SIM105 - no contextlib: this module must stay cheap to import
            inherited.close()
        except OSError:
            pass


def _after_fork() -> None:
    """A fork child of a guarded process is a process of the tree: its own dump file, and its
    own stderr tail (a fork of the pytest process included, whose stderr pytest does not show
    as the child's)."""
    _register()
    if _Registration.dump_dir is not None:
        try:
            keep_stderr_tail()
        except Exception as exc:
            child_note(
                f"pytest-torchhang could not keep the stderr lines of pid {os.getpid()}: "
                f"{type(exc).__name__}: {exc}"
            )


def install(dump_dir: str | None = None) -> bool:
    """Register the dump handler for this process and, through ``os.register_at_fork``, its forks
    (which also keep their stderr tail: see :func:`keep_stderr_tail`).

    Returns False (and does nothing) when no dump directory is configured or it does not exist.
    """
    dump_dir = dump_dir or os.environ.get(DUMP_DIR_ENV)
    if not dump_dir or not os.path.isdir(dump_dir):
        return False
    if (
        _Registration.dump_dir == dump_dir
        and _Registration.pid == os.getpid()
        and _Registration.file is not None
    ):
        return True  # already answering in this process (the start-up hook, then the runner)
    _Registration.dump_dir = dump_dir
    _register()
    if not _Registration.fork_hook_installed:
        os.register_at_fork(after_in_child=_after_fork)
        _Registration.fork_hook_installed = True
    try:  # ranks' collectives are a bonus: never break the start-up
        _install_finder()
    except Exception as exc:
        child_note(
            f"pytest-torchhang could not hook torch.distributed in pid {os.getpid()} (no flight-"
            f"recorder entries from it): {type(exc).__name__}: {exc}"
        )
    return True


#: Flight-recorder fields kept per entry (the rest, such as frames, stays in the process).
_FR_KEYS = (
    "collective_seq_id",
    "profiling_name",
    "input_sizes",
    "state",
    "retired",
    "process_group",
)


def _dump_collectives(out_path: str, since_ns: int) -> None:
    import json
    import pickle

    try:  # the rank's role and store waits, read now: they hold whatever the entries hold
        facts: dict[str, object] = sibling("ranks").rank_facts()
    except Exception as exc:
        facts = {"errors": [f"{type(exc).__name__}: {exc}"]}
    try:
        import torch

        dump = torch._C._distributed_c10d._dump_fr_trace  # type: ignore[attr-defined,unused-ignore]
        try:  # without C++ stack traces: symbolising them takes seconds
            raw = dump(includeStackTraces=False)
        except TypeError:  # an older torch without the argument
            raw = dump()
        entries = [
            e
            for e in pickle.loads(raw).get("entries", [])
            if (e.get("time_created_ns") or 0) >= since_ns
        ]
        doc: dict[str, object] = {"entries": [{k: e.get(k) for k in _FR_KEYS} for e in entries]}
    except Exception as exc:  # stacks must still work: the capture reads the error instead
        doc = {"error": f"{type(exc).__name__}: {exc}"}
    doc.update(facts)
    tmp = out_path + ".tmp"
    with open(tmp, "w") as out:
        json.dump(doc, out, default=str)
    os.replace(tmp, out_path)


def _serve_collectives(fifo: str, out_path: str, since_ns: int) -> None:
    while True:
        try:
            fd = os.open(fifo, os.O_RDONLY)  # blocks until the capture opens the other end
            try:
                os.read(fd, 64)
            finally:
                os.close(fd)
            _dump_collectives(out_path, since_ns)
        except Exception as exc:
            # Said here, or the report would read the missing answer as a GIL held in C.
            child_note(
                f"pytest-torchhang's flight-recorder listener in pid {os.getpid()} died, so its "
                f"collectives cannot be shown: {type(exc).__name__}: {exc}"
            )
            try:  # noqa: SIM105 - no contextlib: this module must stay cheap to import
                os.unlink(fifo)  # nobody listens: the capture must not ask
            except OSError:
                pass
            return


def start_collectives_listener(since_ns: int | None = None) -> bool:
    """Answer flight-recorder requests from a daemon thread of this process (ranks only).

    A Python signal handler would not run while the rank's main thread waits in C++; this thread
    blocks on a FIFO in the dump directory and, when the capture writes to it, writes the
    entries of ``torch._C._distributed_c10d._dump_fr_trace()`` next to the stack dump.
    Started once per process, after ``init_process_group``; ``since_ns`` (wall clock, ns) is
    when that call began: older entries are left out. Returns False when there is no dump
    directory or it cannot start.
    """
    dump_dir = _Registration.dump_dir or os.environ.get(DUMP_DIR_ENV)
    if not dump_dir or not os.path.isdir(dump_dir) or _Registration.listener_pid == os.getpid():
        return False
    pid = os.getpid()
    fifo = collectives_request_path(dump_dir, pid)
    try:
        if os.path.exists(fifo):
            os.unlink(fifo)  # left by an earlier process with this pid
        os.mkfifo(fifo, 0o600)
    except OSError as exc:
        child_note(
            f"pytest-torchhang could not start the flight-recorder listener of pid {pid}: {exc}"
        )
        return False
    import threading

    thread = threading.Thread(
        target=_serve_collectives,
        args=(fifo, collectives_path(dump_dir, pid), since_ns or _Registration.group_since_ns),
        name=f"{THREAD_PREFIX}flight-recorder",
        daemon=True,
    )
    thread.start()
    name_thread(thread)
    _Registration.listener_pid = pid
    return True


def _wrap_init(module: object) -> None:
    init = getattr(module, "init_process_group", None)
    if init is None or getattr(init, "_torch_hang_wrapped", False):
        return
    import functools

    @functools.wraps(init)
    def init_process_group(*args: object, **kwargs: object) -> object:
        _Registration.group_since_ns = int(_wall() * 1e9)
        result = init(*args, **kwargs)
        start_collectives_listener()
        return result

    init_process_group._torch_hang_wrapped = True  # type: ignore[attr-defined]
    module.init_process_group = init_process_group  # type: ignore[attr-defined]
    try:  # the key a rank waits for in store.get/wait, for its hang report
        sibling("ranks").wrap_stores()
    except Exception as exc:
        child_note(
            f"pytest-torchhang could not record the store keys pid {os.getpid()} waits for: "
            f"{type(exc).__name__}: {exc}"
        )
    import sys

    package = sys.modules.get("torch.distributed")
    if package is not None and getattr(package, "init_process_group", None) is init:
        package.init_process_group = init_process_group  # type: ignore[attr-defined]


def _wrap_init_or_say(module: ModuleType) -> None:
    """:func:`_wrap_init` at the module's import (through ``imports.after_import``), which says
    why it could not rather than break the user's import."""
    try:
        _wrap_init(module)
    except Exception as exc:
        child_note(
            f"pytest-torchhang could not wrap init_process_group in pid {os.getpid()} "
            f"(no flight-recorder entries from it): {type(exc).__name__}: {exc}"
        )


def _install_finder() -> None:
    if _Registration.finder_installed:
        return
    _Registration.finder_installed = True
    loaded = after_import(C10D, "flight recorder", _wrap_init_or_say)
    if loaded is not None:
        _wrap_init(loaded)  # torch came first (the zygote's preload): wrap in place


# --- the dump handler's Python half ----------------------------------------------------------
# On the dump signal faulthandler writes the threads' stacks (in C, at once), then chains to a
# Python handler that writes what only Python code can read (snapshot.py: the asyncio tasks,
# the signal handlers) as soon as the main thread runs Python code again.


def _write_signals() -> None:
    """Write :func:`signal_snapshot` to this process's ``PID.signals.json``."""
    import json

    dump_dir = _Registration.dump_dir
    if dump_dir is None:
        return
    path = signals_path(dump_dir, os.getpid())
    try:  # without them the report says only what /proc shows: no note needed
        with open(path + ".tmp", "w") as out:
            json.dump({"pid": os.getpid(), **signal_snapshot()}, out)
        os.replace(path + ".tmp", path)
    except (OSError, ValueError):
        pass


def _write_tasks() -> None:
    """Write this process's snapshot to its ``PID.tasks.json`` (only where asyncio is imported)."""
    import sys

    dump_dir = _Registration.dump_dir
    if dump_dir is None or "asyncio" not in sys.modules:
        return
    import json

    try:
        doc: dict[str, Any] = {"pid": os.getpid(), "loops": asyncio_snapshot()}
    except Exception as exc:  # the stacks are taken already: say why the tasks are not
        doc = {"pid": os.getpid(), "loops": [], "error": f"{type(exc).__name__}: {exc}"}
    doc["written"] = _wall()
    path = tasks_path(dump_dir, os.getpid())
    with open(path + ".tmp", "w") as out:
        json.dump(doc, out, default=str)
    os.replace(path + ".tmp", path)


def _on_dump_signal(signum: int, frame: object) -> None:
    """The Python half of the dump handler (faulthandler chains to it): the asyncio tasks."""
    try:
        _write_signals()
        _write_tasks()
    except Exception as exc:  # never into the user's code
        child_note(
            f"pytest-torchhang could not write the asyncio tasks of pid {os.getpid()}: "
            f"{type(exc).__name__}: {exc}"
        )


def _chain_python_handler() -> bool:
    """Install :func:`_on_dump_signal` as the handler faulthandler chains to, before it
    registers. Where that cannot be (not the main thread; the user's own handler is there),
    faulthandler does not chain: chaining to the default action would kill the process."""
    current = signal.getsignal(DUMP_SIGNAL)
    if getattr(current, "__qualname__", None) == _on_dump_signal.__qualname__:
        # An earlier copy of this module (pytester's inline sessions import it anew) chained
        # it: faulthandler's registration chains to it still, and signal.signal would take
        # faulthandler's place in the kernel.
        _Registration.python_handler = True
        return True
    if current not in (signal.SIG_DFL, None):
        return False
    # An earlier copy's registration that did not chain: it is registered again, chained.
    faulthandler.unregister(DUMP_SIGNAL)
    try:
        signal.signal(DUMP_SIGNAL, _on_dump_signal)
    except ValueError:  # not the main thread
        return False
    _Registration.python_handler = True
    return True


def uninstall() -> None:
    """Stop answering the dump signal in this process (used by the pytest process at the end)."""
    _Registration.dump_dir = None
    _Registration.pid = 0
    try:  # noqa: SIM105
        faulthandler.unregister(DUMP_SIGNAL)
    except (RuntimeError, ValueError):
        pass
    if _Registration.python_handler:
        _Registration.python_handler = False
        try:  # noqa: SIM105
            signal.signal(DUMP_SIGNAL, signal.SIG_DFL)
        except (ValueError, OSError):  # not the main thread: ours stays, and only reads
            pass
    if _Registration.file is not None:
        _Registration.file.close()
        _Registration.file = None


def stress_requested(switch: str) -> bool:
    """Whether this run is stressed (inject/stress.py's ``seed_from_env``, without loading it: a
    plain run of a stressed hunt never does): the variable holds a seed, or names the hunt's
    switch file holding one."""
    if not switch or switch.isdigit():
        return bool(switch)
    try:
        with open(switch) as state:
            return state.read(32).strip().isdigit()
    except OSError:
        return False
