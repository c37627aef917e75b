"""A warm start for the suite's inner pytest sessions: one interpreter that has imported pytest and
torch (and never ran a torch op, nor started a thread) forks one inner session per request, as the
plugin's own zygote forks runner children.

An inner session started here is what ``python -m pytest ARGS`` run in ``cwd`` with ``env`` would
be, minus the interpreter's start-up: the same ``sys.path`` (``cwd``, then ``PYTHONPATH``, then the
interpreter's own), ``pytest`` run as ``__main__`` through runpy as ``-m`` does, the interpreter's
exit steps (non-daemon threads joined, atexit) before the exit status. tests/warm.py decides which
sessions may start warm (the start-up must not be what the test looks at) and talks to this server.

Protocol: one JSON request per line on stdin; ``PID <pid>`` then ``EXIT <status>`` per request on
stdout. One request at a time (each pytest-xdist worker has its own server).
"""

from __future__ import annotations

import atexit
import ctypes
import io
import json
import os
import runpy
import sys
import threading
import traceback

#: the interpreter's own path, without this script's directory
BASE_PATH = sys.path[1:]

import pytest  # noqa: E402  (what every inner session imports first)

for _name in sys.argv[1:]:  # torch, torchvision: what the inner sessions' tests import
    try:
        __import__(_name)
    except ImportError:
        pass

_CLONE_NEWNS = 0x00020000
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18


def _private_shm(directory: str) -> None:
    """This process's /dev/shm becomes ``directory``, in a mount namespace of its own (as
    ``unshare --mount`` and ``mount --bind`` do for a cold session)."""
    libc = ctypes.CDLL(None, use_errno=True)
    steps = (
        ("unshare", lambda: libc.unshare(_CLONE_NEWNS)),
        ("make / private", lambda: libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)),
        ("bind", lambda: libc.mount(directory.encode(), b"/dev/shm", None, _MS_BIND, None)),
    )
    for what, step in steps:
        if step() != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _session(request: dict[str, object]) -> int:
    """Run in the forked child: become ``python -m pytest ARGS`` and return its exit status."""
    shm = request.get("shm")
    if isinstance(shm, str):
        _private_shm(shm)
    streams = (
        (str(request["stdin"]), os.O_RDONLY),
        (str(request["stdout"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (str(request["stderr"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    )
    for fd, (path, flags) in enumerate(streams):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    cwd = str(request["cwd"])
    os.chdir(cwd)
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *BASE_PATH]
    args = request["args"]
    assert isinstance(args, list)
    sys.argv = ["-m", *args]
    try:
        runpy.run_module("pytest", run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as exit_:
        status = _exit_status(exit_.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    # what the interpreter does at exit: join non-daemon threads, then atexit
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return status


def main() -> None:
    threads = threading.active_count()
    tasks = len(os.listdir("/proc/self/task"))
    print(f"READY threads={threads} tasks={tasks}", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            status = 70
            try:
                status = _session(request)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(status)
        print(f"PID {pid}", flush=True)
        _, wait_status = os.waitpid(pid, 0)
        print(f"EXIT {os.waitstatus_to_exitcode(wait_status)}", flush=True)


if __name__ == "__main__":
    main()
