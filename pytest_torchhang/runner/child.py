"""The child side of the subprocess runner: read a request, run it, write the outcome to a file.

A request file holds two pickles: a header of plain values (where to write, the dump directory,
the role, environment, sys.path, cwd, an output file) and the job ``(fn, args, kwargs)``, which is
unpickled inside the error handling so that an import error reaches the test as its exception.
A child never talks back through a multiprocessing Queue (they deadlock at exit): the outcome is a
pickle written atomically next to the request, and a crash is told by the exit status and the
faulthandler trace in the crash file.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import sys
import traceback
from dataclasses import dataclass
from typing import Any

from .. import clock
from ..capture.kill import kill_tree
from ..inject import beats, hook, protocol
from ..processwide import become_subreaper, die_with_parent

#: Seconds a child that failed waits (its outcome already written) before it exits.
LINGER_ENV = "PYTEST_TORCH_HANG_LINGER"


@dataclass
class Outcome:
    """What a child sends back: a result, or an exception with its formatted traceback."""

    ok: bool
    value: Any = None
    exc_type: str = ""
    exc_message: str = ""
    traceback: str = ""


def _write_outcome(path: str, outcome: Outcome) -> None:
    tmp = path + ".tmp"
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:  # the result or the exception itself does not pickle
        data = pickle.dumps(
            Outcome(
                ok=False,
                exc_type="TypeError",
                exc_message=f"the child's {'result' if outcome.ok else 'exception'} cannot be pickled "
                f"back to the test: {exc}",
                traceback=outcome.traceback,
            )
        )
    with open(tmp, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def _has_children() -> bool:
    """Cheaply, without listing every process: does any thread of this process have a child?"""
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as children:
                if children.read().strip():
                    return True
        return False
    except OSError:
        return True  # cannot tell: look the slow way


def _apply_environment(env: dict[str, str]) -> None:
    """Make ``env`` (the calling test's environment) this process's whole environment.

    A zygote child inherited the environment of the test that started the zygote; it must see
    its own test's instead, as a spawned child would. Thread-count variables were read when
    torch was imported in the zygote, so a changed ``OMP_NUM_THREADS`` is applied here too.
    """
    threads_before = os.environ.get("OMP_NUM_THREADS")
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0 and threads != threads_before:
        with contextlib.suppress(Exception):
            torch.set_num_threads(int(threads))


def _arm_progress_and_stress() -> None:
    """What the start-up hook does in fresh interpreters, for this forked one: progress beats
    when the test has stall detection, the hunt's stress when asked for."""
    if os.environ.get(protocol.PROGRESS_ENV):
        beats.look_again()  # the zygote looked when it started, maybe in another test
        beats.install()
    if hook.stress_requested(os.environ.get(protocol.STRESS_ENV, "")):
        from ..inject import stress

        stress.install_from_env(".r")  # its place: a child of the test's process


def _load_main(path: str) -> None:
    """Make the parent's ``__main__`` functions unpicklable here, as multiprocessing's spawn does."""
    import runpy
    import types

    namespace = runpy.run_path(path, run_name="__mp_main__")
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def run_request(request_path: str) -> int:
    """Run one request in this (fresh or forked) process; returns the exit code to use."""
    die_with_parent()
    with open(request_path, "rb") as raw:
        header = pickle.load(raw)  # (result_path, crash_path, dump_dir, role, env, sys_path, ...)
        payload = raw.read()
    result_path, crash_path, dump_dir, role, env, sys_path, cwd, stdout_path, main_path = header
    if stdout_path:
        fd = os.open(stdout_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    crash = open(crash_path, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.enable(file=crash, all_threads=True)
    try:  # from here on every error reaches the test as this child's exception
        _apply_environment(env)
        _arm_progress_and_stress()
        if cwd:
            with contextlib.suppress(OSError):
                os.chdir(cwd)
        sys.path[:] = sys_path or sys.path
        hook.install(dump_dir)
        hook.set_role(role)
        become_subreaper()  # so what the job starts stays in this child's tree until we clean it
        if main_path:
            _load_main(main_path)
        fn, args, kwargs = pickle.loads(payload)
        value = fn(*args, **kwargs)
        outcome = Outcome(ok=True, value=value)
    except BaseException as exc:  # the test wants every error, SystemExit included
        outcome = Outcome(
            ok=False,
            value=exc,
            exc_type=type(exc).__qualname__,
            exc_message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
        )
    _write_outcome(result_path, outcome)
    linger = os.environ.get(LINGER_ENV)
    if not outcome.ok and linger:
        # A failed rank stays a moment, its connections open, so the parent can take the stacks
        # of the ranks still waiting for it in a collective before they notice it is gone.
        clock.sleep(min(float(linger), 30.0))
    if _has_children():
        kill_tree(os.getpid(), budget_s=3.0)  # whatever the job left running dies with it
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


def main() -> None:
    """Entry point of a spawned child: ``python -m pytest_torchhang.runner.child REQUEST``."""
    code = run_request(sys.argv[1])
    os._exit(code)


if __name__ == "__main__":
    # run through the package's module, so Outcome pickles as pytest_torchhang.runner.child.Outcome
    from pytest_torchhang.runner.child import main as package_main

    package_main()
