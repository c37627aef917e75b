"""Start-up hook for every Python process of a guarded test: dump all thread stacks on a signal.

This module must stay standard-library only and cheap to import: the injected ``sitecustomize``
loads it by path in every interpreter a guarded test starts, before any user code runs.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from typing import TextIO

#: Set by the plugin while a timeout is armed; names the directory for per-process dump files.
DUMP_DIR_ENV = "PYTEST_TORCH_HANG_DUMP_DIR"
#: The signal a guarded process answers by writing the stacks of all its threads. A real-time
#: signal, so it does not collide with SIGUSR1/SIGUSR2 handlers that training code installs.
DUMP_SIGNAL = signal.SIGRTMIN + 5


def dump_path(dump_dir: str, pid: int) -> str:
    """The file process ``pid`` writes its stacks to."""
    return os.path.join(dump_dir, f"{pid}.stack")


def role_path(dump_dir: str, pid: int) -> str:
    """The file where a process may state its role (a rank, a runner child) for reports."""
    return os.path.join(dump_dir, f"{pid}.role")


def set_role(role: str) -> None:
    """Record this process's role for hang reports (no-op when no dump directory is set)."""
    dump_dir = _Registration.dump_dir or os.environ.get(DUMP_DIR_ENV)
    if dump_dir and os.path.isdir(dump_dir):
        try:
            with open(role_path(dump_dir, os.getpid()), "w") as out:
                out.write(role)
        except OSError:
            pass


class _Registration:
    """Per-process state of the hook: which file the handler writes to (kept open on purpose)."""

    dump_dir: str | None = None
    file: TextIO | None = None
    pid: int = 0  # the process the handler was registered in (a fork child re-registers)
    fork_hook_installed = False


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
    except OSError:
        return
    faulthandler.register(DUMP_SIGNAL, file=new_file, all_threads=True, chain=False)
    _Registration.file = new_file
    _Registration.pid = os.getpid()
    if inherited is not None and inherited is not new_file:
        # After fork the parent's file object came along; close our copy of its descriptor so
        # every fork generation does not carry one more open file.
        try:  # noqa: SIM105 - no contextlib: this module must stay cheap to import
            inherited.close()
        except OSError:
            pass


def install(dump_dir: str | None = None) -> bool:
    """Register the dump handler for this process and, through ``os.register_at_fork``, its forks.

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
        os.register_at_fork(after_in_child=_register)
        _Registration.fork_hook_installed = True
    return True


def uninstall() -> None:
    """Stop answering the dump signal in this process (used by the pytest process at the end)."""
    _Registration.dump_dir = None
    _Registration.pid = 0
    try:  # noqa: SIM105
        faulthandler.unregister(DUMP_SIGNAL)
    except (RuntimeError, ValueError):
        pass
    if _Registration.file is not None:
        _Registration.file.close()
        _Registration.file = None
