"""``--torch-hang-hunt-stress``: seeded delays where the processes and threads of a tree meet.

Loaded only when a hunted run is stressed (``PYTEST_TORCH_HANG_STRESS`` names the hunt's switch
file, which holds the run's seed): by the start-up hook in every fresh interpreter, by the
runner's forked children, and in the pytest process around the run itself. Standard library only, like all of ``inject/``.

A rare race between processes or threads needs one of them to reach a meeting point (a queue's
``get``, a lock, a shared ``Value``, an event, a pipe, a collective) a little earlier or later
than usual. Pinning the tree to one CPU or a tiny switch interval do not move those moments; so
this module waits, briefly and at random, just before and just after each such operation:

- multiprocessing: ``Queue``/``JoinableQueue``/``SimpleQueue`` (``put``, ``get``, ``empty``,
  ``qsize``), ``Connection`` (``send``, ``recv``, their bytes forms, ``poll``), every ``SemLock``
  (locks, semaphores, and the conditions, events and barriers built on them), shared
  ``Value``/``Array`` reads and writes, ``Process.start``/``join``;
- threading: ``Lock``/``RLock`` made while stressed, ``Condition``, ``Event``, ``Semaphore``,
  ``Barrier``, ``Thread.start``/``join``;
- torch, only once the user imports it (this module never does): ``torch.distributed``'s
  collectives and point-to-point calls, its ``Store`` operations, and the start of a DataLoader
  worker's loop (its index queue is a multiprocessing queue, stressed as above).

Each thread of each process follows its own schedule, in the manner of PCT (Burckhardt et al.,
"A randomized scheduler with probabilistic guarantees of finding bugs", ASPLOS 2010): it has a
priority, which drops at a few random points of its run; a low priority waits more often and
longer, above all right after it signals another (set, notify, release, put, send) or reads
shared state (empty, qsize, is_set, poll, a Value). Only the outermost operation is a point:
what a queue's ``get`` does inside (its lock, its pipe) is not. A schedule is drawn from
``random.Random(f"{seed}/{process}/{thread}")``, where the process is its place in the tree
(``0`` for the first, ``0.2`` for its second fork, ``0.s3`` for a child spawned by its third
``Process.start``) and the thread its start order in that process: never a pid, so a seed
replays the same decisions. No CPU pinning: races between processes need both CPUs.

Every wait is bounded (``MAX_DELAY_S`` each, ``BUDGET_S`` in all per process, then yields
only); the plugin's own threads (named ``torchhang-...``, ``protocol.THREAD_PREFIX``) are never
delayed.
``PYTEST_TORCH_HANG_STRESS_RECORD=DIR`` writes each process's decisions to
``DIR/<process>.schedule`` (one line a decision), so that a test can compare two runs.
"""

from __future__ import annotations

import functools
import os
import random
import sys
import threading
from collections.abc import Callable
from typing import Any

from .imports import C10D, after_import, forget

# The environment keys and the preparation data's key (inject/protocol.py, the child protocol).
from .protocol import STRESS_ENV as STRESS_ENV
from .protocol import STRESS_IDENTITY_ENV as IDENTITY_ENV
from .protocol import STRESS_PLACE_KEY as PLACE_KEY
from .protocol import STRESS_RECORD_ENV as RECORD_ENV

# The schedule (stress_schedule.py); its bounds and weights are read here by tests too.
from .stress_schedule import BUDGET_S, START_JITTER_S, WAITER_ENTER, Callback, _sleep, _State
from .stress_schedule import HEAVY as HEAVY
from .stress_schedule import LIGHT as LIGHT
from .stress_schedule import MAX_DELAY_S as MAX_DELAY_S
from .stress_schedule import OWN_THREADS as OWN_THREADS
from .stress_schedule import _Schedule as _Schedule
from .stress_schedule import _schedule as _schedule
from .stress_schedule import call as call
from .stress_schedule import point as point

# --- the patches ------------------------------------------------------------------------------


def _around(owner: Any, name: str, before: bool = True, after: bool = True) -> None:
    """Wrap ``owner.name`` (a class's method) with meeting points before and after it."""
    original = owner.__dict__.get(name)
    if original is None or getattr(original, "_torch_hang_stress", False):
        return
    site = f"{owner.__module__.rsplit('.', 1)[-1]}.{owner.__name__}.{name}"

    def stressed(*args: Any, **kwargs: Any) -> Any:
        op = functools.partial(original, **kwargs) if kwargs else original
        return call(site, op, *args, before=before, after=after)

    _set(owner, name, _like(stressed, original))


def _like(wrapper: Callback, original: Callback) -> Callback:
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        try:  # noqa: SIM105
            setattr(wrapper, attr, getattr(original, attr))
        except (AttributeError, TypeError):
            pass
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper._torch_hang_stress = True  # type: ignore[attr-defined]
    return wrapper


def _set(owner: Any, name: str, value: Any) -> None:
    _State.patched.append((owner, name, owner.__dict__.get(name)))
    setattr(owner, name, value)


class _Lock:
    """A ``threading.Lock``/``RLock`` made while stressed: meeting points around the real one."""

    __slots__ = ("_torch_hang_lock",)

    def __init__(self, lock: Any) -> None:
        self._torch_hang_lock = lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got: bool = call(
            "threading.Lock.acquire", self._torch_hang_lock.acquire, blocking, timeout, after=False
        )
        return got

    def release(self) -> None:
        call("threading.Lock.release", self._torch_hang_lock.release, before=False)

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __getattr__(self, name: str) -> Any:  # locked, _is_owned, _at_fork_reinit, ...
        return getattr(self._torch_hang_lock, name)

    def __repr__(self) -> str:
        return repr(self._torch_hang_lock)


def _patch_threading() -> None:
    original_start = threading.Thread.__dict__["start"]

    def start(self: threading.Thread) -> None:
        if self.name.startswith(OWN_THREADS):
            return original_start(self)  # type: ignore[no-any-return]
        _State.threads += 1
        self._torch_hang_stress_index = _State.threads  # type: ignore[attr-defined]
        call("threading.Thread.start", original_start, self)

    _set(threading.Thread, "start", _like(start, original_start))
    _around(threading.Thread, "join", after=False)
    for name in ("wait", "notify"):
        _around(threading.Condition, name)
    _patch_condition_enter()
    _around(threading.Condition, "__exit__", before=False)
    for name in ("set", "clear", "wait"):
        _around(threading.Event, name)
    _around(threading.Event, "is_set", before=False)
    _around(threading.Semaphore, "acquire", after=False)
    _around(threading.Semaphore, "release", before=False)
    _around(threading.BoundedSemaphore, "release", before=False)
    _around(threading.Barrier, "wait")
    lock, rlock = threading.Lock, threading.RLock
    _set(threading, "Lock", lambda: _Lock(lock()))
    _set(threading, "RLock", lambda *a, **k: _Lock(rlock(*a, **k)))


def _waits(code: Any) -> bool:
    """Whether ``code`` (the function that takes a condition's lock) calls a ``wait``."""
    waits = _State.waiters.get(code)
    if waits is None:
        waits = _State.waiters[code] = not {"wait", "wait_for"}.isdisjoint(code.co_names)
    return waits


def _patch_condition_enter() -> None:
    """``with condition:`` as a meeting point whose weights depend on the caller: a waiter's or
    another's (see ``WAITER_ENTER``). Decided by the calling code alone, so a seed replays."""
    original = threading.Condition.__dict__["__enter__"]

    def __enter__(self: threading.Condition) -> bool:
        waiter = _State.active and _waits(sys._getframe(1).f_code)
        site = WAITER_ENTER if waiter else "threading.Condition.__enter__"
        return call(site, original, self)  # type: ignore[no-any-return]

    _set(threading.Condition, "__enter__", _like(__enter__, original))


def _patch_multiprocessing() -> None:
    import multiprocessing.connection as connection
    import multiprocessing.process as process
    import multiprocessing.queues as queues
    import multiprocessing.sharedctypes as sharedctypes
    import multiprocessing.synchronize as synchronize

    for owner, names, reads in (
        (queues.Queue, ("put", "get"), ("empty", "qsize")),
        (queues.JoinableQueue, ("put", "task_done", "join"), ()),
        (queues.SimpleQueue, ("put", "get"), ("empty",)),
        (connection._ConnectionBase, ("send", "send_bytes", "recv", "recv_bytes"), ("poll",)),
        (synchronize.Condition, ("wait", "notify", "notify_all"), ()),
        (synchronize.Event, ("set", "clear", "wait"), ("is_set",)),
        (synchronize.Barrier, ("wait",), ()),
        (sharedctypes.SynchronizedArray, ("__setitem__", "__getitem__"), ()),
        (sharedctypes.SynchronizedBase, (), ("get_obj",)),
        (process.BaseProcess, ("join",), ()),
    ):
        for name in names:
            _around(owner, name)
        for name in reads:
            _around(owner, name, before=False)  # a check's answer ages: check-then-act
    _around(synchronize.SemLock, "__enter__")
    _around(synchronize.SemLock, "__exit__", before=False)
    make_methods = synchronize.SemLock.__dict__["_make_methods"]

    def _make_methods(self: Any) -> None:  # acquire/release are the C lock's, per instance
        make_methods(self)
        acquire, release = self.acquire, self.release

        def stressed_acquire(*args: Any, **kwargs: Any) -> Any:
            op = functools.partial(acquire, **kwargs) if kwargs else acquire
            return call("synchronize.SemLock.acquire", op, *args, after=False)

        def stressed_release() -> Any:
            return call("synchronize.SemLock.release", release, before=False)

        self.acquire, self.release = stressed_acquire, stressed_release

    _set(synchronize.SemLock, "_make_methods", _like(_make_methods, make_methods))
    value = sharedctypes.Synchronized.__dict__.get("value")
    if isinstance(value, property) and value.fget is not None and value.fset is not None:
        get, put = value.fget, value.fset

        def get_value(self: Any) -> Any:
            return call("sharedctypes.Value.get", get, self)  # read, then write: a gap

        def set_value(self: Any, new: Any) -> None:
            call("sharedctypes.Value.set", put, self, new)

        _set(sharedctypes.Synchronized, "value", property(get_value, set_value))
    original_start = process.BaseProcess.__dict__["start"]

    def start(self: Any) -> None:
        _State.spawns += 1  # a spawned child's place; a forked one takes its fork number
        call("process.Process.start", original_start, self)

    _set(process.BaseProcess, "start", _like(start, original_start))
    _patch_spawn()


def _patch_spawn() -> None:
    import multiprocessing.spawn as spawn

    get_data, prepare = spawn.get_preparation_data, spawn.prepare

    def get_preparation_data(name: str) -> dict[str, Any]:
        data: dict[str, Any] = get_data(name)
        if _State.active:
            data[PLACE_KEY] = f"{_State.identity}.s{_State.spawns}"
        return data

    def prepare_with_place(data: dict[str, Any]) -> None:
        place = data.pop(PLACE_KEY, None)
        prepare(data)
        if place and _State.active:
            _rename(str(place))

    _set(spawn, "get_preparation_data", _like(get_preparation_data, get_data))
    _set(spawn, "prepare", _like(prepare_with_place, prepare))


_DISTRIBUTED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "irecv",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "destroy_process_group",
)
_STORE_OPS = ("set", "get", "add", "wait", "compare_set", "check", "delete_key")


def _wrap_function(module: Any, name: str, site: str) -> Callback | None:
    original = getattr(module, name, None)
    if original is None or getattr(original, "_torch_hang_stress", False):
        return None

    def stressed(*args: Any, **kwargs: Any) -> Any:
        op = functools.partial(original, **kwargs) if kwargs else original
        return call(site, op, *args)

    wrapped = _like(stressed, original)
    _set(module, name, wrapped)
    return wrapped


def _patch_c10d(module: Any) -> None:
    package = sys.modules.get("torch.distributed")
    for name in _DISTRIBUTED:
        wrapped = _wrap_function(module, name, f"distributed.{name}")
        if wrapped is not None and package is not None and name in vars(package):
            _set(package, name, wrapped)
    store = getattr(module, "Store", None)
    for name in _STORE_OPS if store is not None else ():
        original = getattr(store, name, None)
        if original is None or getattr(original, "_torch_hang_stress", False):
            continue

        def stressed(self: Any, *args: Any, _op: Any = original, _site: str = name) -> Any:
            return call(f"distributed.Store.{_site}", _op, self, *args)

        try:  # a compiled class may refuse new attributes: then its stores go unstressed
            _set(store, name, _like(stressed, original))
        except (AttributeError, TypeError):
            _State.patched.pop()


def _patch_worker(module: Any) -> None:
    _wrap_function(module, "_worker_loop", "dataloader.worker_loop")


#: Modules of torch patched when they are imported (or at install, when they already are).
_LATER: dict[str, Callable[[Any], None]] = {
    C10D: _patch_c10d,
    "torch.utils.data._utils.worker": _patch_worker,
}


def _quietly(patch: Callable[[Any], None]) -> Callable[[Any], None]:
    """``patch`` run at the user's import of its module: stress is a bonus, never an error."""

    def run(module: Any) -> None:
        try:  # noqa: SIM105
            patch(module)
        except Exception:
            pass

    return run


# --- the process's life -----------------------------------------------------------------------


def _open_record() -> None:
    if _State.record_fd >= 0:
        os.close(_State.record_fd)
        _State.record_fd = -1
    if _State.record_dir:
        path = os.path.join(_State.record_dir, f"{_State.identity}.schedule")
        try:  # noqa: SIM105
            _State.record_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError:
            pass


def _start_jitter() -> None:
    """A random pause at a process's start (and after each fork), from its own schedule."""
    rng = random.Random(f"{_State.seed}/{_State.identity}/start")
    _sleep(rng.random() * START_JITTER_S)


def _before_fork() -> None:
    if _State.active:
        _State.forks += 1


def _rename(identity: str) -> None:
    """This process's place is ``identity`` from now on: fresh schedules, its own record."""
    _State.identity = identity
    _State.forks = _State.spawns = _State.threads = 0
    _State.budget_s = BUDGET_S
    _State.local = threading.local()
    _open_record()


def _after_fork_in_child() -> None:
    if not _State.active:
        return
    _rename(f"{_State.identity}.{_State.forks}")
    # one thread left, none native: the environment may change here, for the child's own
    # children that multiprocessing does not start (a subprocess, the resource tracker)
    os.environ[IDENTITY_ENV] = _State.identity
    _start_jitter()


def install(seed: int, identity: str = "0", record_dir: str = "") -> None:
    """Stress this process (and, through fork, its children) with the schedule of ``seed``."""
    if _State.active:
        uninstall()
    _State.seed, _State.identity, _State.record_dir = seed, identity, record_dir
    _State.forks = _State.spawns = _State.threads = 0
    _State.budget_s = BUDGET_S
    _State.local = threading.local()
    _open_record()
    _patch_threading()
    _patch_multiprocessing()
    for name, patch in _LATER.items():
        module = after_import(name, "stress", _quietly(patch))
        if module is not None:
            patch(module)
    if not _State.fork_hook:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _State.fork_hook = True
    _State.switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads of one process switch at every chance
    _State.active = True
    _start_jitter()


def _exec_place() -> str:
    """The place of a fresh interpreter that its parent did not name: a multiprocessing child
    has its own (``Process.start`` handed it over); another (``resource_tracker``, a
    ``subprocess`` child) is told apart from its parent by its command line's shape, never by
    paths or pids: the name of its script (``c`` for ``-c``) and how many arguments it has."""
    argv = list(getattr(sys, "argv", None) or [""])
    if argv[-1] == "--multiprocessing-fork":
        return ""
    name = "".join(ch for ch in os.path.basename(argv[0]) if ch.isalnum())[:24]
    return f".x{name}{len(argv)}"


def seed_from_env() -> int | None:
    """The seed of this run: ``PYTEST_TORCH_HANG_STRESS`` holds it, or names the hunt's switch
    file that does (set once a session; the file says, run by run, which one is stressed).
    None when this run is plain."""
    text = os.environ.get(STRESS_ENV, "")
    if text and not text.isdigit():
        try:
            with open(text) as switch:
                text = switch.read(32).strip()
        except OSError:
            return None
    return int(text) if text.isdigit() else None


def install_from_env(place: str = "", fresh: bool = False) -> bool:
    """:func:`install` with the seed, place and record directory of the environment; False when
    this run is not stressed (``PYTEST_TORCH_HANG_STRESS`` unset or not a number).

    ``place`` is added to the inherited place (a runner's child names itself so); ``fresh``
    (the start-up hook of a new interpreter) adds the shape of its command line, unless
    multiprocessing started it.
    """
    seed = seed_from_env()
    if seed is None:
        return False
    identity = (os.environ.get(IDENTITY_ENV) or "0") + place
    if fresh:
        identity += _exec_place()
    install(seed, identity, os.environ.get(RECORD_ENV, ""))
    return True


def uninstall() -> None:
    """Stop stressing this process: every patch undone (locks made meanwhile stop waiting)."""
    if not _State.active:
        return
    _State.active = False
    while _State.patched:
        owner, name, original = _State.patched.pop()
        if original is None:
            try:  # noqa: SIM105
                delattr(owner, name)
            except (AttributeError, TypeError):
                pass
        else:
            setattr(owner, name, original)
    forget("stress")
    if _State.record_fd >= 0:
        os.close(_State.record_fd)
        _State.record_fd = -1
    sys.setswitchinterval(_State.switch)
