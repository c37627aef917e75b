"""torch's DataLoader SIGCHLD check, told which workers the guard itself killed.

A DataLoader installs a SIGCHLD handler that raises ``RuntimeError: DataLoader worker (pid N) is
killed by signal: Killed`` in the main thread whenever a worker of a loader still alive has died.
The guard kills a hung test's workers from the watchdog's thread, so that handler runs in the main
thread wherever it happens to be: in the test, where the hang is reported anyway, or, for a worker
whose SIGCHLD comes a moment later, inside pytest's own hooks (making the test's report), where
the error is an INTERNALERROR and ends the session. Before each kill, the guard names its victims
here; the check then stays silent about them, and still raises for any worker that died otherwise.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Iterable

import psutil

from .tree import ProcessId, same_process

_MODULE = "torch.utils.data._utils.signal_handling"
_CHECK = "_error_if_any_worker_fails"
_PID = re.compile(r"\(pid (\d+)\)")
#: Processes the guard killed, by pid: the check's errors about them are the guard's doing.
_KILLED: dict[int, ProcessId] = {}


def expect_killed(idents: Iterable[ProcessId]) -> None:
    """Before the guard SIGKILLs ``idents``: torch's worker check says nothing about them."""
    module = sys.modules.get(_MODULE)
    if module is None:
        return  # no DataLoader was ever made in this process: nothing raises on SIGCHLD
    for pid in [pid for pid in _KILLED if not psutil.pid_exists(pid)]:
        del _KILLED[pid]  # reaped: the entry can only ever match a recycled pid now
    _KILLED.update((ident.pid, ident) for ident in idents)
    check = getattr(module, _CHECK, None)
    if check is not None and not getattr(check, "_torchhang_quiet", False):
        setattr(module, _CHECK, _quiet(check))


def _quiet(check: Callable[[], None]) -> Callable[[], None]:
    @functools.wraps(check)
    def quiet() -> None:
        try:
            check()
        except RuntimeError as exc:
            if not _killed_by_guard(str(exc)):
                raise

    quiet._torchhang_quiet = True  # type: ignore[attr-defined]
    return quiet


def _killed_by_guard(message: str) -> bool:
    """Whether torch's error is about a process the guard killed (the same process, not its pid
    recycled: the check only sees an unreaped child, whose identity can still be read)."""
    found = _PID.search(message)
    ident = _KILLED.get(int(found.group(1))) if found else None
    if ident is None:
        return False
    try:
        return same_process(psutil.Process(ident.pid), ident)
    except psutil.Error:
        return True  # reaped since the check saw it: it was the guard's
