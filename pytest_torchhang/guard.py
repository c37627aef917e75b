"""One hang, one pipeline: snapshot -> capture -> diagnose -> report -> kill.

Used in the pytest process by the watchdog, by the monitor process when the pytest process itself
cannot move, and by the subprocess runner for its children.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

import psutil

from . import diagnose
from ._hook import role_path
from .native import native_stacks, tool_available
from .proctree import (
    KillResult,
    ProcessId,
    cleanup_shm,
    descendants,
    helper_kind,
    is_zombie,
    kill_tree,
)
from .report import HangReport, ProcessReport

__all__ = ["GuardTarget", "HangReport", "capture", "kill", "tree"]
from .stacks import Dump, in_process_threads, request_dumps, trim_pytest_frames

#: Environment variables read from each process (roles of ranks).
_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCH_HANG_BACKEND")


@dataclass
class GuardTarget:
    """What one guard watches: the tree under ``root_pid``, minus the guard's own processes."""

    test_id: str
    timeout_s: float
    root_pid: int
    dump_dir: str | None
    started: float = field(default_factory=time.monotonic)
    exclude: set[int] = field(default_factory=set)
    shm_baseline: set[str] = field(default_factory=set)
    root_in_process: bool = True  # the root is this very process: read its stacks directly
    kill_root: bool = False
    root_role: str = "pytest"
    phase: str = "call"
    capture_budget_s: float = 2.0
    #: When set, the tree is these processes and their descendants (runner children), not the
    #: root's descendants; the root is then only the process the report is written for.
    roots: list[int] | None = None
    native: bool = False  # add native stacks (pystack / py-spy) where installed and permitted


def _cpu(proc: psutil.Process) -> float:
    try:
        times = proc.cpu_times()
        return float(times.user + times.system)
    except psutil.Error:
        return 0.0


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        env = proc.environ()
    except (psutil.Error, OSError):
        return {}
    return {k: env[k] for k in _ENV_KEYS if k in env}


def _helper(proc: psutil.Process, cmdline: list[str], name: str) -> str | None:
    kind = helper_kind(cmdline, name)
    if kind is None:
        return None
    with contextlib.suppress(psutil.Error):
        if proc.parent() is not None and proc.parent().cmdline() == cmdline:  # type: ignore[union-attr]
            return None  # forked by the helper (a forkserver's child), not the helper itself
    return kind


def _facts(proc: psutil.Process, now: float, dump: Dump, cpu_before: float) -> ProcessReport:
    with proc.oneshot():
        try:
            cmdline = proc.cmdline()
            name = proc.name()
            state: str = proc.status()
            rss = proc.memory_info().rss
            threads = proc.num_threads()
            age = now - proc.create_time()
            ppid = proc.ppid()
        except psutil.Error:
            cmdline, name, state, rss, threads, age, ppid = [], "?", "gone", 0, 0, 0.0, 0
    cpu = _cpu(proc)
    if dump.was_stopped:
        state = "stopped (SIGSTOP)"
    return ProcessReport(
        pid=proc.pid,
        ppid=ppid,
        role=_helper(proc, cmdline, name) or "",
        cmdline=(" ".join(cmdline) or name).replace("\n", "\\n"),
        state=state,
        cpu_s=cpu,
        cpu_delta_s=max(cpu - cpu_before, 0.0),
        rss_bytes=rss,
        num_threads=threads,
        age_s=age,
        dump_status=dump.status,
        threads=dump.threads,
    )


def tree(target: GuardTarget) -> list[psutil.Process]:
    """The processes a target covers, the root (or the roots) first."""
    procs: list[psutil.Process] = []
    for root in target.roots if target.roots is not None else [target.root_pid]:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(root))
            procs.extend(descendants(root, target.exclude))
    seen: set[int] = set()
    unique = [p for p in procs if not (p.pid in seen or seen.add(p.pid))]  # type: ignore[func-returns-value]
    # zombies wait for nothing: they are a parent's unfinished business, not part of a hang
    return [p for p in unique if p.pid == target.root_pid or not is_zombie(p)]


def _roles(dump_dir: str | None, pids: list[int]) -> dict[int, str]:
    roles: dict[int, str] = {}
    if dump_dir is None:
        return roles
    for pid in pids:
        with contextlib.suppress(OSError), open(role_path(dump_dir, pid)) as role:
            roles[pid] = role.read().strip()
    return roles


def capture(target: GuardTarget, skip_threads: set[int] | None = None) -> HangReport:
    """Snapshot the tree and take every process's stacks; kills nothing."""
    t0 = time.monotonic()
    elapsed = t0 - target.started  # when the hang was declared, whatever the capture costs
    procs = tree(target)
    cpu_before = {p.pid: _cpu(p) for p in procs}
    idents: list[ProcessId] = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if (
                proc.pid != target.root_pid
                or not target.root_in_process
                or target.roots is not None
            ):
                idents.append(ProcessId(proc.pid, proc.create_time()))
    dumps = request_dumps(idents, target.dump_dir, target.capture_budget_s)
    if target.root_in_process and target.roots is None:
        dumps[target.root_pid] = Dump("ok", in_process_threads(skip_threads))
    for dump in dumps.values():
        for thread in dump.threads:
            trim_pytest_frames(thread)
    time.sleep(max(0.0, 0.1 - (time.monotonic() - t0)))  # a CPU sample needs a little time
    now = time.time()
    reports = [
        _facts(
            p,
            now,
            dumps.get(p.pid, Dump("gone before its stack could be taken")),
            cpu_before.get(p.pid, 0.0),
        )
        for p in procs
    ]
    env = {p.pid: _environ(p) for p in procs if p.pid != target.root_pid}
    stated = _roles(target.dump_dir, [r.pid for r in reports])
    for report_ in reports:
        report_.role = stated.get(report_.pid, report_.role)
    diagnose.label_roles(reports, target.root_pid, env, target.root_role)
    notes: list[str] = []
    if target.native:
        notes = _add_native(target, reports)
    else:
        _read_from_outside(reports)
    report = HangReport(
        test_id=target.test_id,
        timeout_s=target.timeout_s,
        elapsed_s=elapsed,
        phase=target.phase,
        headline=diagnose.headline(
            target.test_id + (f" (during {target.phase})" if target.phase != "call" else ""),
            elapsed,
            reports,
            target.root_pid,
        ),
        hints=diagnose.hints(reports),
        processes=reports,
        notes=notes,
    )
    report.capture_s = time.monotonic() - t0
    return report


def _add_native(target: GuardTarget, reports: list[ProcessReport]) -> list[str]:
    # A process cannot ptrace itself: the pytest process's own stacks stay Python-only.
    me = os.getpid()
    candidates = [r for r in reports if r.pid != me and r.state not in ("zombie", "gone")]
    candidates.sort(key=lambda r: (r.role.startswith(diagnose.HELPER_ROLES), r.pid))
    result = native_stacks(
        [r.pid for r in candidates], {r.pid for r in candidates if r.role.startswith("rank ")}
    )
    for report in reports:
        report.native = result.stacks.get(report.pid, "")
    return [result.note] if result.note else []


def _read_from_outside(reports: list[ProcessReport]) -> None:
    """Python processes without the dump handler: read their stacks with pystack or py-spy,
    when one is installed (silently skipped otherwise: nobody asked for it)."""
    silent = [
        r
        for r in reports
        if r.dump_status.startswith("no stack: no dump handler")
        and os.path.basename(r.cmdline.split(" ", 1)[0]).startswith("python")
    ]
    if not silent or not tool_available():
        return
    result = native_stacks([r.pid for r in silent], set(), native=False)
    for report in silent:
        if report.pid in result.stacks:
            report.native = result.stacks[report.pid]
            report.dump_status += "; its Python stack below was read from outside (pystack/py-spy)"


def kill(target: GuardTarget, report: HangReport | None = None) -> KillResult:
    """Kill the tree (identity-checked), reap, remove its /dev/shm leftovers; note it in ``report``."""
    started = time.monotonic()
    if target.roots is None:
        result = kill_tree(target.root_pid, exclude=target.exclude, include_root=target.kill_root)
    else:
        result = KillResult()
        for root in target.roots:
            part = kill_tree(
                root, exclude=target.exclude, include_root=True, spare_root_helpers=False
            )
            result.killed += part.killed
            result.spared += part.spared
            result.survivors += part.survivors
            result.reaped.update(part.reaped)
    result.shm_removed = cleanup_shm(target.shm_baseline, [p.pid for p in result.killed])
    if report is not None:
        report.killed = [p.pid for p in result.killed]
        report.spared = [p.pid for p in result.spared]
        report.survivors = [p.pid for p in result.survivors]
        report.shm_removed = result.shm_removed
        report.kill_s = time.monotonic() - started
    return result


def tree_alive(root_pid: int, exclude: set[int]) -> list[int]:
    """Live (non-zombie) descendants, for checks that a tree is gone."""
    out = []
    for proc in descendants(root_pid, exclude):
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
    return out
