"""Where a test's timeout comes from: ini < env < command line < marker, validated as usage errors."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

TIMEOUT_OPTION = "--torch-hang-timeout"
TIMEOUT_INI = "torch_hang_timeout"
TIMEOUT_ENV = "PYTEST_TORCH_HANG_TIMEOUT"
REPORT_DIR_OPTION = "--torch-hang-report-dir"
REPORT_DIR_INI = "torch_hang_report_dir"
NATIVE_OPTION = "--torch-hang-native"
NATIVE_INI = "torch_hang_native"
MARKER = "torch_hang"


def seconds_or_nan(value: object) -> float:
    """``value`` as a float number of seconds, NaN when it is not one (booleans are not)."""
    if isinstance(value, bool):
        return math.nan
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def fail_collection_on_bad_markers(
    report: pytest.CollectReport,
    check: Callable[[pytest.Item], object],
    errors: tuple[type[Exception], ...],
) -> pytest.CollectReport:
    """Turn ``report`` into a collection error listing the items whose markers ``check`` rejects.

    On a pytest-xdist worker a usage error raised during collection becomes an INTERNALERROR
    that loses its message; a failed collection report keeps it.
    """
    if not report.passed:
        return report
    problems = []
    for node in report.result:
        if isinstance(node, pytest.Item):
            try:
                check(node)
            except errors as exc:
                problems.append(str(exc))
    if problems:
        report.outcome = "failed"
        report.longrepr = "\n".join(problems)
        report.result = []
    return report


def parse_timeout(value: object, source: str) -> float:
    """Turn ``value`` into seconds (0 = off) or raise a usage error naming ``source``."""
    seconds = seconds_or_nan(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise pytest.UsageError(
            f"{source} must be a finite number of seconds >= 0 (0 turns the guard off), got {value!r}"
        )
    return seconds


@dataclass(frozen=True)
class SessionSettings:
    """What the session was configured with, before any marker."""

    timeout: float  # 0 means off
    source: str  # where the timeout came from, for messages and the report header
    report_dir: str | None
    native: bool


def session_settings(config: pytest.Config) -> SessionSettings:
    """Resolve the session-wide settings (ini < env < CLI); raises pytest.UsageError when invalid."""
    timeout, source = 0.0, "default"
    ini_value = config.getini(TIMEOUT_INI)
    if ini_value not in ("", None):
        timeout, source = parse_timeout(ini_value, f"ini option {TIMEOUT_INI}"), "ini"
    env_value = os.environ.get(TIMEOUT_ENV)
    if env_value not in (None, ""):
        timeout, source = parse_timeout(env_value, f"environment variable {TIMEOUT_ENV}"), "env"
    cli_value = config.getoption("torch_hang_timeout")
    if cli_value is not None:
        timeout, source = parse_timeout(cli_value, TIMEOUT_OPTION), "command line"
    # A relative directory is fixed now, not at hang time (a test may chdir): the command line's
    # against the invocation directory, the ini file's against the ini file's directory.
    report_dir, dir_source = config.getoption("torch_hang_report_dir"), REPORT_DIR_OPTION
    base = config.invocation_params.dir
    if not report_dir:
        report_dir, dir_source = (
            config.getini(REPORT_DIR_INI) or None,
            f"ini option {REPORT_DIR_INI}",
        )
        base = config.inipath.parent if config.inipath is not None else base
    given = report_dir
    if report_dir:
        report_dir = os.path.join(base, os.path.expanduser(report_dir))
    if report_dir and os.path.exists(report_dir) and not os.path.isdir(report_dir):
        where = "" if given == report_dir else f" ({report_dir})"
        raise pytest.UsageError(
            f"{dir_source} must be a directory (created if missing), got {given!r}{where}, "
            "which is a file"
        )
    try:
        native_ini = bool(config.getini(NATIVE_INI))
    except ValueError:
        raise pytest.UsageError(
            f"ini option {NATIVE_INI} must be true or false, got {config.inicfg.get(NATIVE_INI)!r}"
        ) from None
    native = bool(config.getoption("torch_hang_native")) or native_ini
    return SessionSettings(timeout, source, report_dir, native)


@dataclass(frozen=True)
class ItemSettings:
    """What applies to one test after its ``torch_hang`` marker."""

    timeout: float
    isolate: bool


def _marker_args(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, bool]:
    unknown = set(kwargs) - {"timeout", "isolate"}
    if unknown or len(args) > 1:
        raise TypeError(f"takes (timeout=None, isolate=False), got args={args!r} kwargs={kwargs!r}")
    if args and "timeout" in kwargs:
        raise TypeError(
            f"timeout given twice (positionally {args[0]!r} and as timeout={kwargs['timeout']!r})"
        )
    timeout = args[0] if args else kwargs.get("timeout")
    isolate = kwargs.get("isolate", False)
    if not isinstance(isolate, bool):
        raise TypeError(f"isolate must be True or False, got {isolate!r}")
    return timeout, isolate


def item_settings(item: pytest.Item, session: SessionSettings) -> ItemSettings:
    """Apply the closest ``torch_hang`` marker to the session settings; usage error when invalid."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return ItemSettings(session.timeout, False)
    source = f"@pytest.mark.{MARKER} on {item.nodeid}"
    try:
        timeout, isolate = _marker_args(marker.args, marker.kwargs)
    except TypeError as exc:
        raise pytest.UsageError(f"{source}: {exc}") from None
    seconds = session.timeout if timeout is None else parse_timeout(timeout, f"{source}: timeout")
    return ItemSettings(seconds, isolate)
