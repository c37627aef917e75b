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
STALL_OPTION = "--torch-hang-stall"
STALL_INI = "torch_hang_stall"
STALL_ENV = "PYTEST_TORCH_HANG_STALL"
HUNT_OPTION = "--torch-hang-hunt"
HUNT_ALL_OPTION = "--torch-hang-hunt-all"
HUNT_STRESS_OPTION = "--torch-hang-hunt-stress"
HUNT_SEED_OPTION = "--torch-hang-hunt-seed"
REPORT_DIR_OPTION = "--torch-hang-report-dir"
REPORT_DIR_INI = "torch_hang_report_dir"
NATIVE_OPTION = "--torch-hang-native"
NATIVE_INI = "torch_hang_native"
MARKER = "torch_hang"
#: The longest timeout accepted (about 31 years): a timed wait overflows past some 292 years
#: (``threading.TIMEOUT_MAX``), and a bound that long is a typo, not a bound.
MAX_SECONDS = 1e9
LONGEST = "at most 1e9 seconds (about 31 years)"  # MAX_SECONDS, as messages say it


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


def parse_timeout(value: object, source: str, off: str = "the guard") -> float:
    """Turn ``value`` into seconds (0 = off) or raise a usage error naming ``source``."""
    seconds = seconds_or_nan(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise pytest.UsageError(
            f"{source} must be a finite number of seconds >= 0 (0 turns {off} off), got {value!r}"
        )
    if seconds > MAX_SECONDS:
        raise pytest.UsageError(f"{source} must be {LONGEST}; 0 turns {off} off; got {value!r}")
    return seconds


def _seconds(
    config: pytest.Config, dest: str, option: str, ini: str, env: str, off: str
) -> tuple[float, str]:
    """A number of seconds from ini < env < command line, and where it came from."""
    seconds, source = 0.0, "default"
    ini_value = config.getini(ini)
    if ini_value not in ("", None):
        seconds, source = parse_timeout(ini_value, f"ini option {ini}", off), "ini"
    env_value = os.environ.get(env)
    if env_value not in (None, ""):
        seconds, source = parse_timeout(env_value, f"environment variable {env}", off), "env"
    cli_value = config.getoption(dest)
    if cli_value is not None:
        seconds, source = parse_timeout(cli_value, option, off), "command line"
    return seconds, source


_TRUE = ("1", "true", "yes", "on", "y", "t")
_FALSE = ("", "0", "false", "no", "off", "n", "f")


def _ini_bool(config: pytest.Config, name: str) -> bool:
    """A true/false ini key, read as pytest reads its own (but with an error that names it)."""
    value = config.getini(name)
    text = str(value).strip().lower() if not isinstance(value, bool) else str(value).lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise pytest.UsageError(f"ini option {name} must be true or false, got {value!r}")


def _hunt_runs(config: pytest.Config) -> int:
    value = config.getoption("torch_hang_hunt")
    if value is None:
        return 0
    try:
        runs = int(value, 10)
    except ValueError:
        runs = -1
    if runs < 1:
        raise pytest.UsageError(
            f"{HUNT_OPTION} must be a whole number of runs >= 1 per selected test, got {value!r}"
        )
    return runs


def _hunt_seed(config: pytest.Config) -> int | None:
    value = config.getoption("torch_hang_hunt_seed", None)
    if value is None:
        return None
    try:
        seed = int(value, 10)
    except ValueError:
        seed = -1
    if seed < 0:
        raise pytest.UsageError(
            f"{HUNT_SEED_OPTION} must be a whole number >= 0 (a seed a hunt printed), got {value!r}"
        )
    return seed


PYTEST_TIMEOUT_ENV = "PYTEST_TIMEOUT"


def pytest_timeout_seconds(config: pytest.Config) -> float:
    """pytest-timeout's session-wide timeout (``--timeout``, ``PYTEST_TIMEOUT``, ini ``timeout``),
    read through public APIs in pytest-timeout's order (CLI > env > ini); 0 when unset, when
    pytest-timeout is not installed or disabled, or when its value is not a number (pytest-timeout
    reports that itself)."""
    if not config.pluginmanager.has_plugin("timeout"):
        return 0.0
    value: object = config.getoption("timeout", None)
    if value is None:
        value = os.environ.get(PYTEST_TIMEOUT_ENV) or None
    if value is None:
        try:
            value = config.getini("timeout") or None
        except ValueError:  # pytest-timeout registered no ini key (an old or a stub version)
            value = None
    seconds = seconds_or_nan(value) if value is not None else 0.0
    return seconds if math.isfinite(seconds) and seconds > 0 else 0.0


@dataclass(frozen=True)
class SessionSettings:
    """What the session was configured with, before any marker."""

    timeout: float  # 0 means off
    source: str  # where the timeout came from, for messages and the report header
    report_dir: str | None
    native: bool
    stall: float = 0.0  # fail after this long without progress; 0 means off
    hunt: int = 0  # runs per selected test when hunting rare hangs; 0 means not hunting
    hunt_all: bool = False  # hunt: run all of them, rather than stop at the first hang
    hunt_stress: bool = False  # hunt: make races likelier (seeded delays where processes meet)
    hunt_seed: int | None = None  # hunt: stress every run with this seed's schedule


def session_settings(config: pytest.Config) -> SessionSettings:
    """Resolve the session-wide settings (ini < env < CLI); raises pytest.UsageError when invalid."""
    timeout, source = _seconds(
        config, "torch_hang_timeout", TIMEOUT_OPTION, TIMEOUT_INI, TIMEOUT_ENV, "the guard"
    )
    stall, _ = _seconds(
        config, "torch_hang_stall", STALL_OPTION, STALL_INI, STALL_ENV, "stall detection"
    )
    hunt = _hunt_runs(config)
    hunt_all = bool(config.getoption("torch_hang_hunt_all"))
    hunt_stress = bool(config.getoption("torch_hang_hunt_stress"))
    hunt_seed = _hunt_seed(config)
    if (hunt_all or hunt_stress or hunt_seed is not None) and not hunt:
        flag = HUNT_ALL_OPTION if hunt_all else HUNT_STRESS_OPTION
        flag = HUNT_SEED_OPTION if hunt_seed is not None else flag
        raise pytest.UsageError(f"{flag} goes with {HUNT_OPTION}=N (how many runs per test)")
    if hunt and not (timeout or stall):
        raise pytest.UsageError(
            f"{HUNT_OPTION} needs a bound for each run, so that a hang ends and is counted: "
            f"set {TIMEOUT_OPTION}=SECONDS or {STALL_OPTION}=SECONDS (or their ini keys or "
            "environment variables)"
        )
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
    if report_dir:
        _check_report_dir(report_dir, given, dir_source)
    native = bool(config.getoption("torch_hang_native")) or _ini_bool(config, NATIVE_INI)
    hunt_stress = hunt_stress or hunt_seed is not None  # a seed names a stress schedule
    return SessionSettings(
        timeout, source, report_dir, native, stall, hunt, hunt_all, hunt_stress, hunt_seed
    )


def _check_report_dir(path: str, given: str, source: str) -> None:
    """A usage error now, when the report directory could not be made at the first hang: a file
    in its place or above it, or a directory nobody may write into (checked, not created)."""
    where = "" if given == path else f" ({path})"
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "which is a file" if existing == path else f"but {existing} is a file"
        raise pytest.UsageError(
            f"{source} must be a directory (created if missing), got {given!r}{where}, {what}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created in {existing}"
        raise pytest.UsageError(
            f"{source} must be a directory pytest may write into, got {given!r}{where}, which "
            f"{what}: choose another directory"
        )


@dataclass(frozen=True)
class ItemSettings:
    """What applies to one test after its ``torch_hang`` marker."""

    timeout: float
    isolate: bool
    stall: float = 0.0


#: Each test's settings, resolved at collection (a bad marker is a usage error then).
ITEM_SETTINGS = pytest.StashKey[ItemSettings]()


_MARKER_SIGNATURE = "(timeout=None, stall=None, isolate=False)"


def _marker_args(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, Any, bool]:
    unknown = set(kwargs) - {"timeout", "stall", "isolate"}
    if unknown or len(args) > 1:
        raise TypeError(f"takes {_MARKER_SIGNATURE}, got args={args!r} kwargs={kwargs!r}")
    if args and "timeout" in kwargs:
        raise TypeError(
            f"timeout given twice (positionally {args[0]!r} and as timeout={kwargs['timeout']!r})"
        )
    timeout = args[0] if args else kwargs.get("timeout")
    isolate = kwargs.get("isolate", False)
    if not isinstance(isolate, bool):
        raise TypeError(f"isolate must be True or False, got {isolate!r}")
    return timeout, kwargs.get("stall"), isolate


def item_settings(item: pytest.Item, session: SessionSettings) -> ItemSettings:
    """Apply the closest ``torch_hang`` marker to the session settings; usage error when invalid."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return ItemSettings(session.timeout, False, session.stall)
    source = f"@pytest.mark.{MARKER} on {item.nodeid}"
    try:
        timeout, stall, isolate = _marker_args(marker.args, marker.kwargs)
    except TypeError as exc:
        raise pytest.UsageError(f"{source}: {exc}") from None
    seconds = session.timeout if timeout is None else parse_timeout(timeout, f"{source}: timeout")
    stall_s = (
        session.stall
        if stall is None
        else parse_timeout(stall, f"{source}: stall", "stall detection")
    )
    return ItemSettings(seconds, isolate, stall_s)


def add_options(parser: pytest.Parser) -> None:
    """The plugin's command-line options and ini keys (``plugin.pytest_addoption``)."""
    group = parser.getgroup("torch-hang", "hang detection for PyTorch multiprocess tests")
    group.addoption(
        TIMEOUT_OPTION,
        dest="torch_hang_timeout",
        default=None,
        metavar="SECONDS",
        help="Fail a test that runs longer than SECONDS, with the stacks of every process in its "
        f"tree, then kill that tree; 0 turns it off (env {TIMEOUT_ENV}, "
        f"ini {TIMEOUT_INI})",
    )
    group.addoption(
        STALL_OPTION,
        dest="torch_hang_stall",
        default=None,
        metavar="SECONDS",
        help="Fail a test whose process tree makes no progress (DataLoader batches, optimizer "
        "steps, collectives, pytest_torchhang.progress()) for SECONDS; 0 turns it off "
        f"(env {STALL_ENV}, ini {STALL_INI})",
    )
    group.addoption(
        HUNT_OPTION,
        dest="torch_hang_hunt",
        default=None,
        metavar="N",
        help="Hunt rare hangs: run each selected test up to N times under the guard, stopping "
        "at its first hang, and show each distinct way it hung once",
    )
    group.addoption(
        HUNT_ALL_OPTION,
        dest="torch_hang_hunt_all",
        action="store_true",
        default=False,
        help=f"With {HUNT_OPTION}: run all N runs and count the hangs",
    )
    group.addoption(
        HUNT_STRESS_OPTION,
        dest="torch_hang_hunt_stress",
        action="store_true",
        default=False,
        help=f"With {HUNT_OPTION}: make races likelier: odd runs wait briefly, at "
        "random, where the tree's processes and threads meet (queues, pipes, locks, events, "
        "shared values, process start and join, collectives), even runs stay plain for "
        "comparison; changes timing, not semantics",
    )
    group.addoption(
        HUNT_SEED_OPTION,
        dest="torch_hang_hunt_seed",
        default=None,
        metavar="SEED",
        help=f"With {HUNT_OPTION}: stress every run with the schedule of SEED, as a "
        "stressed run that hung printed it",
    )
    group.addoption(
        "--torch-hang-rerun",
        dest="torch_hang_rerun",
        action="store_true",
        default=False,
        help="Run only the tests that hung or stalled last time (pytest's cache, as --lf), or "
        "every test when none did",
    )
    group.addoption(
        REPORT_DIR_OPTION,
        dest="torch_hang_report_dir",
        default=None,
        metavar="DIR",
        help="Write one JSON report per hang into DIR (relative to the invocation directory)",
    )
    group.addoption(
        NATIVE_OPTION,
        dest="torch_hang_native",
        action="store_true",
        default=False,
        help="Add native stacks through pystack (or else py-spy) where installed and permitted",
    )
    parser.addini(TIMEOUT_INI, "Seconds before a test counts as hung (0 = off)", default="")
    parser.addini(
        STALL_INI,
        "Seconds without progress before a test counts as stalled (0 = off)",
        default="",
    )
    parser.addini(REPORT_DIR_INI, "Directory for one JSON report per hang", default="")
    parser.addini(
        # a string checked by the plugin: pytest's own "bool" type fails without naming the key
        NATIVE_INI,
        "Add native stacks through pystack or py-spy (true/false)",
        default="",
    )
