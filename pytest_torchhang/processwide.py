"""Process-wide state of the guard, shared by every pytest session in this process and counted.

Signal handlers, the stack-dump hook, environment variables, the child subreaper, the launcher
of the plugin's helper processes (and their end) belong to the process, not to a session: ``pytester.runpytest()`` inline, or an IDE that calls
``pytest.main`` twice, runs one session inside another. The first session to need them sets
them up, the last one to leave puts them back; an inner session never undoes the outer's.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any, ClassVar, TypeVar

from . import clock
from .inject import hook, protocol
from .inject.protocol import INTERRUPT_SIGNAL as INTERRUPT_SIGNAL

INJECT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inject", "site")

#: Called in the interrupted thread: the exception to raise there, or None (not its turn).
Receiver = Callable[[], BaseException | None]
#: How long a deadline that came due waits for the test's main thread to say whether a debugger
#: traces it (it answers between two bytecodes; one blocked in C never does, and fires as ever).
ASK_TRACE_S = 0.5
#: How long a helper's start may wait for the launcher thread.
LAUNCH_WAIT_S = 60.0

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int) -> bool:
    try:
        return int(_libc().prctl(option, arg, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Adopt orphans of this process's descendants (setsid'd daemons) so they stay in its tree."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits."""
    return _prctl(_PR_SET_PDEATHSIG, sig)


class _Shared:
    lock: ClassVar[threading.Lock] = threading.Lock()
    users: ClassVar[list[Receiver]] = []
    dump_dir: ClassVar[str | None] = None
    saved_env: ClassVar[dict[str, str | None]] = {}
    previous_handler: ClassVar[Any] = None
    handler_installed: ClassVar[bool] = False


def acquire(receiver: Receiver) -> str:
    """Join the process-wide guard (set it up if first); returns the shared dump directory."""
    with _Shared.lock:
        if not _Shared.users:
            _set_up()
        _Shared.users.append(receiver)
        assert _Shared.dump_dir is not None
        return _Shared.dump_dir


def release(receiver: Receiver) -> None:
    """Leave the process-wide guard; the last user puts everything back."""
    with _Shared.lock:
        if receiver in _Shared.users:
            _Shared.users.remove(receiver)
        if not _Shared.users and _Shared.dump_dir is not None:
            _tear_down()


def _set_up() -> None:
    _Shared.dump_dir = tempfile.mkdtemp(prefix="torchhang-")
    hook.install(_Shared.dump_dir)
    become_subreaper()
    if threading.current_thread() is threading.main_thread():
        # One handler for the process: a late interrupt (the test ended just as the watchdog
        # fired) finds no test in phase and does nothing, instead of meeting the signal's
        # default action, which would terminate the process.
        _Shared.previous_handler = signal.signal(INTERRUPT_SIGNAL, _on_interrupt)
        _Shared.handler_installed = True
    current = os.environ.get("PYTHONPATH")
    values = {
        protocol.DUMP_DIR_ENV: _Shared.dump_dir,
        "PYTHONPATH": INJECT_DIR + (os.pathsep + current if current else ""),
    }
    for key, value in hook.guarded_env().items():
        if key not in os.environ:  # the user's own setting wins
            values[key] = value
    _Shared.saved_env = {key: os.environ.get(key) for key in values}
    os.environ.update(values)


def _tear_down() -> None:
    for key, value in _Shared.saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _Shared.saved_env = {}
    hook.uninstall()
    if _Shared.handler_installed:
        signal.signal(INTERRUPT_SIGNAL, _Shared.previous_handler or signal.SIG_DFL)
        _Shared.handler_installed = False
    if _Shared.dump_dir:
        shutil.rmtree(_Shared.dump_dir, ignore_errors=True)
    _Shared.dump_dir = None


class _Question:
    """A question for the main thread, answered by the interrupt handler, which runs there."""

    lock: ClassVar[threading.Lock] = threading.Lock()  # one question at a time
    #: the question, the box for its answer, and the event that says it is there
    pending: ClassVar[tuple[Callable[[], object], list[object], threading.Event] | None] = None


def ask_main_thread(question: Callable[[], T], wait_s: float) -> tuple[bool, T | None]:
    """``question()`` run in the main thread (by the interrupt signal's handler, between two of
    its bytecodes), waiting at most ``wait_s``: (True, its answer), or (False, None) when the
    main thread did not answer in time (it sits in a call that no signal interrupts, or in code
    that does not look at signals) or no handler of ours is installed there.

    Some facts are the thread's own and unreadable from another: ``sys.gettrace()`` (a debugger
    set inside a test, issue 29). pytest-timeout reads it the same way, in its SIGALRM handler.
    """
    main = threading.main_thread().ident
    if not _Shared.handler_installed or main is None:
        return False, None
    box: list[object] = []
    answered = threading.Event()
    with _Question.lock:
        _Question.pending = (question, box, answered)
        try:
            signal.pthread_kill(main, INTERRUPT_SIGNAL)
            if answered.wait(wait_s) and box:
                _back_to_its_wait(threading.main_thread().native_id)
                return True, box[0]  # type: ignore[return-value]
            return False, None
        except (OSError, ValueError):
            return False, None
        finally:
            _Question.pending = None  # an answer after this goes into this question's box


#: After it answered, the main thread is given this long to go back into the call the signal
#: interrupted: a capture that reads its state meanwhile would see it running, not blocked.
SETTLE_S = 0.3


def _back_to_its_wait(tid: int | None) -> None:
    """Until thread ``tid`` of this process is no longer running (back in its blocking call,
    which the interrupt's handler left), at most ``SETTLE_S``; a thread that computes stays
    running, and costs that much."""
    if tid is None:
        return
    until = clock.monotonic() + SETTLE_S
    while clock.monotonic() < until:
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                state = f.read(4096).rpartition(b")")[2].split()[:1]
        except OSError:
            return
        if state != [b"R"]:
            return
        clock.sleep(0.002)


def main_thread_trace() -> tuple[bool, object]:
    """The main thread's own ``sys.gettrace()``, asked in it (``debuggers.DebuggerWatch``)."""
    return ask_main_thread(sys.gettrace, ASK_TRACE_S)


def _answer() -> None:
    pending, _Question.pending = _Question.pending, None
    if pending is None:
        return
    question, box, answered = pending
    with contextlib.suppress(Exception):  # a question must never raise in the test's code
        box.append(question())
    answered.set()


def _on_interrupt(signum: int, frame: FrameType | None) -> None:
    __tracebackhide__ = True  # a re-raised HangError (a wider fixture's) shows the user's frames
    _answer()  # a question first: it raises nothing, whoever else is interrupted
    for receiver in reversed(list(_Shared.users)):  # the innermost session first
        exc = receiver()
        if exc is not None:
            raise exc


class _ForkGate:
    """Keeps the process's own forks out of a helper's start.

    ``subprocess.Popen`` learns that its child exec'd when a pipe (close-on-exec) reaches end of
    file in the child; a fork by another thread of this process meanwhile (a DataLoader's
    worker, a test's ``multiprocessing`` child) copies that pipe's write end, and the start then
    waits until that fork exits or execs: for ever, for a child that hangs. Seen: the monitor's
    start blocked so behind a test's sleeping child, and the watchdog behind it. Forks through
    ``os.fork`` wait for a start in progress (its exec: milliseconds), at most ``WAIT_S``.
    """

    lock: ClassVar[threading.RLock] = threading.RLock()  # a fork in the launcher: re-entered
    held: ClassVar[threading.local] = threading.local()
    registered: ClassVar[bool] = False
    WAIT_S: ClassVar[float] = 10.0

    @classmethod
    def register(cls) -> None:
        if not cls.registered and hasattr(os, "register_at_fork"):
            cls.registered = True
            os.register_at_fork(
                before=cls.before, after_in_parent=cls.after, after_in_child=cls.after
            )

    @classmethod
    def before(cls) -> None:
        cls.held.got = [*getattr(cls.held, "got", []), cls.lock.acquire(timeout=cls.WAIT_S)]

    @classmethod
    def after(cls) -> None:
        got = getattr(cls.held, "got", [])
        if got and got.pop():
            with contextlib.suppress(RuntimeError):  # a child whose lock was not copied held
                cls.lock.release()


class _Launcher:
    """One thread that starts the plugin's helper processes (the zygote, the monitor).

    ``PR_SET_PDEATHSIG`` fires when the *thread* that started a process exits, not the process:
    a zygote started from a user's helper thread died with that thread. Started from this
    thread, which lives as long as the process, nothing the plugin starts depends on the
    lifetime of a user's thread.
    """

    lock: ClassVar[threading.Lock] = threading.Lock()
    thread: ClassVar[threading.Thread | None] = None
    work: ClassVar[list[tuple[Callable[[], Any], list[Any], threading.Event]]] = []
    ready: ClassVar[threading.Condition] = threading.Condition(lock)

    @classmethod
    def serve(cls) -> None:
        while True:
            with cls.ready:
                while not cls.work:
                    cls.ready.wait()
                fn, box, done = cls.work.pop(0)
            try:
                with _ForkGate.lock:  # no fork of this process copies the start's pipe
                    box.append((True, fn()))
            except BaseException as exc:  # handed to the caller, raised there
                box.append((False, exc))
            done.set()


def launcher_ident() -> int | None:
    """The launcher thread's ident (a plugin thread: never part of a hang report)."""
    thread = _Launcher.thread
    return thread.ident if thread is not None else None


def launch(fn: Callable[[], T], wait_s: float = LAUNCH_WAIT_S) -> T:
    """``fn()`` (which starts a helper process), run on the process's launcher thread."""
    if threading.current_thread() is _Launcher.thread:
        return fn()
    box, done = _submit(fn)
    if not done.wait(wait_s):
        raise RuntimeError(f"pytest-torchhang could not start a helper process in {wait_s:.0f}s")
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def launch_soon(fn: Callable[[], T]) -> Callable[[float], T]:
    """``fn()`` on the launcher thread, without waiting for it: returns ``result(wait_s)``,
    which waits up to ``wait_s`` for it and returns its value, raises what it raised, or raises
    ``TimeoutError`` while it has not finished (``result(0)`` never waits)."""
    box, done = _submit(fn)

    def result(wait_s: float) -> T:
        if not done.wait(wait_s):
            raise TimeoutError(f"pytest-torchhang's helper process is not started after {wait_s}s")
        ok, value = box[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    return result


def _submit(fn: Callable[[], Any]) -> tuple[list[Any], threading.Event]:
    box: list[Any] = []
    done = threading.Event()
    _ForkGate.register()
    with _Launcher.ready:
        if _Launcher.thread is None or not _Launcher.thread.is_alive():
            _Launcher.thread = threading.Thread(
                target=_Launcher.serve, name=f"{protocol.THREAD_PREFIX}launcher", daemon=True
            )
            _Launcher.thread.start()
            hook.name_thread(_Launcher.thread)
        _Launcher.work.append((fn, box, done))
        _Launcher.ready.notify()
    return box, done


def end_helper(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """Wait up to ``grace_s`` for a helper told to exit (its pipe closed), then kill it; bounded."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)


def set_async_exception(thread_id: int, exc: type[BaseException] | None) -> None:
    """Have thread ``thread_id`` raise ``exc`` at its next bytecode (None: cancel a pending one);
    the interrupt of a test in a thread other than the main one, which no signal reaches."""
    set_async = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None)


def cancel_async_exception(thread_id: int) -> None:
    """Cancel a pending ``set_async_exception`` (it must not land in pytest's own code)."""
    with contextlib.suppress(Exception):
        set_async_exception(thread_id, None)


def forget_torn_out_modules() -> None:
    """Make the next import of a cold-path module (``from .capture import pipeline``) load it
    again if it was torn out of ``sys.modules`` since it was first imported.

    pytester's inline sessions (``runpytest()``, ``inline_run()``) put ``sys.modules`` back as it
    was after them: a module of the plugin that an inner session loaded first is then gone from
    it, while a package the outer session had loaded (``capture``) still holds it as an
    attribute, which ``from package import name`` returns as it is. Such a stale module's psutil
    looks itself up in ``sys.modules`` and fails (``KeyError: 'psutil'``). Before the cold path
    loaded at the first fire, the outer session had it loaded from its start.
    """
    top = __name__.split(".")[0]
    ours = [m for n, m in list(sys.modules.items()) if n.split(".")[0] == top and m is not None]
    for package in ours:
        for attribute, value in list(vars(package).items()):
            if (
                isinstance(value, ModuleType)
                and value.__name__.startswith(top + ".")
                and sys.modules.get(value.__name__) is not value
            ):
                delattr(package, attribute)
