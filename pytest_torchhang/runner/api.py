"""The ``torch_hang`` fixture: run work in subprocesses under a deadline."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .. import clock, devices, settings
from ..exceptions import add_note
from ..report.text import to_text
from . import client, jobs
from .child import LINGER_ENV
from .jobs import LoaderStats

#: The bound of fixture calls when neither the call nor the test has a timeout.
DEFAULT_TIMEOUT_S = 60.0
#: A call's deadline stays this far inside the test's own, so the call reports first.
MARGIN_S = 0.5
#: A rank that failed lingers up to 10 times this (killed as soon as its peers' stacks are taken).
PEER_GRACE_S = 0.5

__all__ = ["LoaderStats", "TorchHang"]


class CallWatch(Protocol):
    """The test's deadline, told of each fixture call (``watchdog.TestDeadline`` is one): its
    own fire then never overlaps a call's capture, and captures the call's children too."""

    def call_started(self, seconds: float, pids: list[int]) -> int: ...
    def call_capturing(self, key: int) -> None: ...
    def call_ended(self, key: int, hung: bool) -> None: ...


class _Call:
    """One fixture call as its test's deadline sees it."""

    def __init__(self, watch: CallWatch | None, key: int) -> None:
        self._watch, self._key = watch, key
        self.hung = False

    def capturing(self, hung: bool = True) -> None:
        """The call captures and kills its children now (``hung``: it will raise HangError)."""
        self.hung = hung
        if self._watch is not None:
            self._watch.call_capturing(self._key)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def check_picklable(obj: Any, what: str) -> None:
    """Raise a TypeError a user can act on when ``obj`` cannot travel to a child process."""
    try:
        pickle.dumps(obj)
    except Exception as exc:
        raise TypeError(
            f"{what} must be picklable to run in a child process, and {_name(obj)!r} is not "
            f"({type(exc).__name__}: {exc}). Define it at module level (not a lambda, a local "
            "function or a method of a local class), and pass data that pickles."
        ) from None


class TorchHang:
    """Run callables, DataLoader iterations and distributed steps in children, under a deadline."""

    def __init__(
        self,
        get_runner: Callable[[], client.Runner],
        test_id: str,
        deadline: Callable[[], float | None],
        gpus: list[str] | None = None,
        native: bool = False,
        watch: Callable[[], CallWatch | None] = lambda: None,
    ) -> None:
        self._watch = watch
        self._native = native
        self._get_runner = get_runner
        self._test_id = test_id
        self._deadline = deadline
        self._gpus = gpus

    def _timeout(self, timeout: float | None, name: str = "timeout") -> float:
        if timeout is not None:
            if (
                isinstance(timeout, bool)
                or not isinstance(timeout, (int, float))
                or not math.isfinite(timeout)
                or timeout <= 0
                or timeout > settings.MAX_SECONDS
            ):
                raise ValueError(
                    f"{name} must be a number of seconds > 0 and {settings.LONGEST}, "
                    f"got {timeout!r}"
                )
            return float(timeout)
        deadline = self._deadline()  # read now: the test's deadline may have moved
        if deadline is not None:
            return max(deadline - clock.monotonic() - MARGIN_S, 0.1)
        return DEFAULT_TIMEOUT_S

    @contextlib.contextmanager
    def _watched(
        self, the_runner: client.Runner, children: list[client.Child], seconds: float
    ) -> Iterator[_Call]:
        """Tell the test's deadline of this call while it runs; whatever ends it (a result, a
        hang of its own, the test's HangError), its children are gone and its files removed."""
        watch = self._watch()
        key = watch.call_started(seconds, [c.pid for c in children]) if watch else 0
        call = _Call(watch, key)
        try:
            yield call
        finally:
            try:
                client.stop(the_runner, children)  # a no-op when every child has exited
            finally:
                the_runner.forget(children)
                if watch is not None:
                    watch.call_ended(key, call.hung)

    def _method(self, start_method: str | None) -> str:
        method = start_method or "zygote"
        if method not in client.START_METHODS:
            raise ValueError(
                f"start_method must be one of {', '.join(client.START_METHODS)}, got {method!r}"
            )
        return method

    def _relay(self, the_runner: client.Runner, children: list[client.Child]) -> None:
        for child in children:
            output = the_runner.output(child)
            if output:
                sys.stdout.write(output)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        start_method: str | None = None,
        env: dict[str, str | None] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` in a child process and return its result.

        The child's exception is raised here with its traceback attached; a child killed by a
        signal raises ``ChildCrashed``; a child still running at the deadline raises ``HangError``
        with the stacks of its whole tree (which is killed). ``timeout=None``: the test's timeout.
        """
        for key, value in (env or {}).items():
            if not isinstance(key, str) or not (value is None or isinstance(value, str)):
                raise TypeError(
                    f"env maps variable names (str) to values (str, or None to unset), got "
                    f"{key!r}: {value!r}"
                )
        return self._run_one(
            fn,
            args,
            kwargs,
            timeout=timeout,
            start_method=start_method,
            env=env,
            label=f"torch_hang.run({_name(fn)})",
        )

    def _run_one(
        self,
        fn: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        timeout: float | None,
        start_method: str | None,
        env: dict[str, str | None] | None,
        label: str,
    ) -> Any:
        check_picklable(fn, label.split("(")[0] + "'s callable")
        seconds, method = self._timeout(timeout), self._method(start_method)
        the_runner = self._get_runner()
        child = the_runner.start(fn, args, kwargs, method=method, role=f"{label} child", env=env)
        with self._watched(the_runner, [child], seconds) as call:
            left = client.wait(the_runner, [child], seconds, stop_on_error=False)
            if left <= 0 and the_runner.is_running(child):
                call.capturing()
                report = client.hang_report(
                    the_runner, [child], f"{label} in {self._test_id}", seconds, self._native
                )
                self._relay(the_runner, [child])
                client.raise_hang(report)
            self._relay(the_runner, [child])
            return client.raise_outcome(the_runner, child)

    def dataloader(
        self,
        dataset_or_factory: Any,
        *,
        batches: int | None = None,
        timeout: float | None = None,
        multiprocessing_context: str | None = None,
        start_method: str | None = None,
        **loader_kwargs: Any,
    ) -> LoaderStats:
        """Build a DataLoader in a child and iterate ``batches`` batches (all when None).

        ``dataset_or_factory`` is a picklable dataset, or a picklable callable returning a
        dataset or a DataLoader; ``loader_kwargs`` go to ``DataLoader``.
        """
        if batches is not None and (
            isinstance(batches, bool) or not isinstance(batches, int) or batches < 0
        ):
            raise ValueError(f"batches must be None or an int >= 0, got {batches!r}")
        check_picklable(dataset_or_factory, "torch_hang.dataloader's dataset or factory")
        return self._run_one(  # type: ignore[no-any-return]
            jobs.iterate_loader,
            (dataset_or_factory, batches, multiprocessing_context, loader_kwargs),
            {},
            timeout=timeout,
            start_method=start_method,
            env=None,
            label=f"torch_hang.dataloader({_name(dataset_or_factory)})",
        )

    def distributed(
        self,
        fn: Callable[..., Any],
        *args: Any,
        world_size: int = 2,
        backend: str | None = None,
        timeout: float | None = None,
        init_timeout: float | None = None,
        start_method: str | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` ranks; per-rank results.

        The process group (gloo on CPU, nccl when each rank can have a leased GPU of its own) is
        set up through a FileStore private to this call and destroyed after ``fn``.
        """
        backend = self._backend(world_size, backend)
        check_picklable(fn, "torch_hang.distributed's callable")
        seconds, method = self._timeout(timeout), self._method(start_method)
        init_seconds = (
            self._timeout(init_timeout, "init_timeout") if init_timeout is not None else seconds
        )
        the_runner = self._get_runner()
        ranks = self._start_ranks(
            the_runner, fn, args, kwargs, world_size, backend, method, seconds, init_seconds
        )
        label = f"torch_hang.distributed({_name(fn)}, world_size={world_size}) in {self._test_id}"
        with self._watched(the_runner, ranks, seconds) as call:
            left = client.wait(the_runner, ranks, seconds, stop_on_error=True)
            failed = [c for c in ranks if the_runner.failed(c)]
            if failed:
                self._raise_first_failure(the_runner, ranks, failed, left, label, seconds, call)
            if left <= 0 and any(the_runner.is_running(c) for c in ranks):
                call.capturing()
                report = client.hang_report(the_runner, ranks, label, seconds, self._native)
                self._relay(the_runner, ranks)
                client.raise_hang(report)
            self._relay(the_runner, ranks)
            return [client.raise_outcome(the_runner, c) for c in ranks]

    def _backend(self, world_size: int, backend: str | None) -> str:
        """The backend to use (gloo, or nccl when every rank has a GPU of its own); bad input
        is a ValueError that says what to do."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        gpus = self._gpus or []
        if backend is None:
            # fake GPUs (a testing aid) have no CUDA behind them: ranks still get one leased
            # device each, but talk gloo
            fake = devices.fake_gpu_count(os.environ) is not None
            backend = "nccl" if len(gpus) >= world_size and not fake else "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or None (automatic), got {backend!r}")
        if backend == "nccl" and len(gpus) < world_size:
            raise ValueError(
                f"backend 'nccl' needs one GPU per rank: world_size {world_size}, GPUs leased to this "
                f"test: {len(gpus)}. Mark the test @pytest.mark.gpu({world_size}), or use backend='gloo'."
            )
        return backend

    def _start_ranks(
        self,
        the_runner: client.Runner,
        fn: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        world_size: int,
        backend: str,
        method: str,
        seconds: float,
        init_seconds: float,
    ) -> list[client.Child]:
        """One child per rank, each with its rank's environment (and leased GPU)."""
        gpus = self._gpus or []
        store = os.path.join(the_runner.workdir, f"store-{os.getpid()}-{clock.monotonic_ns()}")
        # gloo would wait 30 minutes by default: bound it, just past our own deadline, so the
        # plugin (which reports every rank's stack) decides first.
        pg_timeout = seconds + 5.0
        ranks = []
        for rank in range(world_size):
            env: dict[str, str | None] = {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "TORCH_HANG_BACKEND": backend,
                LINGER_ENV: str(PEER_GRACE_S * 10),
            }
            if len(gpus) >= world_size:
                env["CUDA_VISIBLE_DEVICES"] = gpus[rank]  # this rank's leased GPU, alone
            ranks.append(
                the_runner.start(
                    jobs.rank_main,
                    (fn, rank, world_size, backend, store, pg_timeout, init_seconds, args, kwargs),
                    {},
                    method=method,
                    role=f"rank {rank}/{world_size} ({backend})",
                    env=env,
                )
            )
        return ranks

    def _raise_first_failure(
        self,
        the_runner: client.Runner,
        ranks: list[client.Child],
        failed: list[client.Child],
        left: float,
        label: str,
        seconds: float,
        call: _Call,
    ) -> None:
        """Raise the first failed rank's error, with what every other rank did as a note."""
        first = min(failed, key=lambda c: c.ended)
        # A rank that returns closes its connections before its outcome is written, so a peer
        # can fail first: let the others report for a moment (bounded) before telling finished
        # ranks from waiting ones. Waiting ranks stay blocked meanwhile: the failed rank lingers
        # with its connections open.
        others = [c for c in ranks if c not in failed]
        client.wait(the_runner, others, min(PEER_GRACE_S, max(left, 0.05)), stop_on_error=False)
        waiting = [
            c
            for c in ranks
            if c not in failed and the_runner.peek(c) is None and the_runner.is_running(c)
        ]
        fates = "\n".join(f"  {_fate(the_runner, c)}" for c in ranks if c is not first)
        note = f"{first.role} failed first; the other ranks:\n{fates}"
        if any(c.outcome is not None and c.outcome.ok for c in ranks):
            note += (
                "\na rank that returns (or dies) while its peers are still in a collective "
                "makes them fail (gloo: connection reset) or wait forever (nccl)"
            )
        if waiting:
            call.capturing(hung=False)  # the rank's own error is raised, not a HangError
            report = client.hang_report(the_runner, waiting, label, seconds, self._native)
            note += "\nstacks of the ranks still running (then killed):\n" + to_text(report)
        client.stop(the_runner, ranks)
        self._relay(the_runner, ranks)
        try:
            client.raise_outcome(the_runner, first)
        except BaseException as exc:
            add_note(exc, note)
            raise


def _fate(the_runner: client.Runner, child: client.Child) -> str:
    outcome = the_runner.peek(child)
    if outcome is not None and outcome.ok:
        return f"{child.role}: returned {outcome.value!r:.60}"
    if outcome is not None:
        return f"{child.role}: raised {outcome.exc_type}: {outcome.exc_message:.120}"
    if child.exitcode is not None:
        return f"{child.role}: died (exit status {child.exitcode}) without a result"
    return f"{child.role}: still running"


def run_isolated(
    the_runner: client.Runner,
    function: Any,
    funcargs: dict[str, Any],
    test_id: str,
    timeout: float,
    watch: CallWatch | None = None,
) -> None:
    """Run a whole test body in a child (``@pytest.mark.torch_hang(isolate=True)``)."""
    check_picklable(function, f"the isolated test {test_id}")
    for name, value in funcargs.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise TypeError(
                f"isolate=True runs {test_id} in a child process, so its fixture values must be "
                f"picklable; {name!r} is not ({type(exc).__name__}: {exc})"
            ) from None
    hang = TorchHang(lambda: the_runner, test_id, lambda: None, watch=lambda: watch)
    hang._run_one(
        jobs.call_test,
        (function, funcargs),
        {},
        timeout=timeout,
        start_method=None,
        env=None,
        label=f"isolated test {test_id}",
    )
