"""Settings: where a timeout and a stall time come from (ini < env < CLI < marker), and usage errors.

Configs are parsed in process (``pytester.parseconfig``: options and ini, no configure hook,
no session); items are collected in process with the plugin left out, so that only
``settings`` decides. Installed plugins are not loaded (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``):
importing hypothesis's alone costs seconds a test, as pytester unloads it after each.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from pytest_torchhang import settings
from pytest_torchhang.settings import SessionSettings

ENVS = (settings.TIMEOUT_ENV, settings.STALL_ENV)


@pytest.fixture(autouse=True)
def _no_outside_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def _settings(
    pytester: pytest.Pytester,
    *args: str,
    ini: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
) -> SessionSettings:
    if ini:
        pytester.makeini("[pytest]\n" + "".join(f"{k} = {v}\n" for k, v in ini.items()))
    for name, value in (env or {}).items():
        pytester._monkeypatch.setenv(name, value)
    return settings.session_settings(_config(pytester, *args))


def _config(pytester: pytest.Pytester, *args: str) -> pytest.Config:
    """A parsed config with this plugin's options and ini keys (and no other plugin's)."""
    return pytester.parseconfig("-p", "pytest_torchhang.plugin", *args)


def _one_setting(
    pytester: pytest.Pytester,
    names: tuple[str, str, str],
    ini: str | None,
    env: str | None,
    cli: str | None,
) -> SessionSettings:
    """The settings with one setting given where the values are not None: (option, ini, env)."""
    option, ini_key, env_var = names
    return _settings(
        pytester,
        *([f"{option}={cli}"] if cli is not None else []),
        ini={ini_key: ini} if ini is not None else None,
        env={env_var: env} if env is not None else None,
    )


def _usage_error(pytester: pytest.Pytester, *args: str, **kw: dict[str, str]) -> str:
    with pytest.raises(pytest.UsageError) as caught:
        _settings(pytester, *args, **kw)
    return str(caught.value)


# (ini, env, command line) -> (seconds, source): each later one wins when it is given
PRECEDENCE = [
    (None, None, None, 0.0, "default"),
    ("7", None, None, 7.0, "ini"),
    ("7", "5", None, 5.0, "env"),
    (None, "5", None, 5.0, "env"),
    ("7", "5", "3", 3.0, "command line"),
    ("7", None, "3", 3.0, "command line"),
    ("7", "5", "0", 0.0, "command line"),  # the command line turns it off
    ("7", "", None, 7.0, "ini"),  # an empty variable is not set
    ("0.25", None, None, 0.25, "ini"),
    ("1e1", None, None, 10.0, "ini"),
]


@pytest.mark.parametrize(("ini", "env", "cli", "seconds", "source"), PRECEDENCE)
def test_the_timeout_comes_from_ini_then_env_then_the_command_line(
    pytester: pytest.Pytester,
    ini: str | None,
    env: str | None,
    cli: str | None,
    seconds: float,
    source: str,
) -> None:
    names = (settings.TIMEOUT_OPTION, settings.TIMEOUT_INI, settings.TIMEOUT_ENV)
    got = _one_setting(pytester, names, ini, env, cli)
    assert (got.timeout, got.source) == (seconds, source)
    assert got.stall == 0.0


@pytest.mark.parametrize(("ini", "env", "cli", "seconds", "source"), PRECEDENCE)
def test_the_stall_time_comes_from_ini_then_env_then_the_command_line(
    pytester: pytest.Pytester,
    ini: str | None,
    env: str | None,
    cli: str | None,
    seconds: float,
    source: str,
) -> None:
    names = (settings.STALL_OPTION, settings.STALL_INI, settings.STALL_ENV)
    got = _one_setting(pytester, names, ini, env, cli)
    assert got.stall == seconds
    assert (got.timeout, got.source) == (0.0, "default")


def test_timeout_and_stall_are_resolved_apart(pytester: pytest.Pytester) -> None:
    got = _settings(
        pytester,
        f"{settings.STALL_OPTION}=2",
        ini={settings.TIMEOUT_INI: "9", settings.STALL_INI: "4"},
        env={settings.TIMEOUT_ENV: "8"},
    )
    assert (got.timeout, got.source, got.stall) == (8.0, "env", 2.0)


BAD = ["-1", "nan", "inf", "-inf", "abc", "1s", "True"]


@pytest.mark.parametrize("value", [*BAD, ""])
@pytest.mark.parametrize(
    ("option", "off"),
    [(settings.TIMEOUT_OPTION, "the guard"), (settings.STALL_OPTION, "stall detection")],
)
def test_a_bad_command_line_value_is_a_usage_error_naming_the_option(
    pytester: pytest.Pytester, option: str, off: str, value: str
) -> None:
    message = _usage_error(pytester, f"{option}={value}")
    assert message == (
        f"{option} must be a finite number of seconds >= 0 (0 turns {off} off), got {value!r}"
    )


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("key", [settings.TIMEOUT_INI, settings.STALL_INI])
def test_a_bad_ini_value_is_a_usage_error_naming_the_key(
    pytester: pytest.Pytester, key: str, value: str
) -> None:
    message = _usage_error(pytester, ini={key: value})
    assert message.startswith(f"ini option {key} must be a finite number of seconds >= 0")
    assert message.endswith(f"got {value!r}")


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("name", ENVS)
def test_a_bad_environment_value_is_a_usage_error_naming_the_variable(
    pytester: pytest.Pytester, name: str, value: str
) -> None:
    message = _usage_error(pytester, env={name: value})
    assert message.startswith(f"environment variable {name} must be a finite number of seconds")
    assert message.endswith(f"got {value!r}")


TOO_LONG = "must be at most 1e9 seconds (about 31 years)"


@pytest.mark.parametrize("value", ["1e10", "9.3e9", "1000000001"])
@pytest.mark.parametrize("where", ["cli", "ini", "env"])
@pytest.mark.parametrize(
    "names",
    [
        (settings.TIMEOUT_OPTION, settings.TIMEOUT_INI, settings.TIMEOUT_ENV),
        (settings.STALL_OPTION, settings.STALL_INI, settings.STALL_ENV),
    ],
)
def test_a_timeout_too_long_for_a_timed_wait_is_a_usage_error_wherever_it_is_given(
    pytester: pytest.Pytester, names: tuple[str, str, str], where: str, value: str
) -> None:
    option, ini, env = names
    if where == "cli":
        message, source = _usage_error(pytester, f"{option}={value}"), option
    elif where == "ini":
        message, source = _usage_error(pytester, ini={ini: value}), f"ini option {ini}"
    else:
        message, source = _usage_error(pytester, env={env: value}), f"environment variable {env}"
    assert message.startswith(f"{source} {TOO_LONG}")
    assert message.endswith(f"got {value!r}")


def test_the_longest_timeout_accepted_is_1e9_seconds(pytester: pytest.Pytester) -> None:
    got = _settings(pytester, f"{settings.TIMEOUT_OPTION}=1e9", f"{settings.STALL_OPTION}=1e9")
    assert (got.timeout, got.stall) == (1e9, 1e9)


def test_a_bad_lower_source_is_an_error_even_when_a_higher_one_wins(
    pytester: pytest.Pytester,
) -> None:
    """A typo in the ini file is reported, not hidden by today's command line."""
    message = _usage_error(
        pytester, f"{settings.TIMEOUT_OPTION}=5", ini={settings.TIMEOUT_INI: "soon"}
    )
    assert message.startswith(f"ini option {settings.TIMEOUT_INI} must be")


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(3, 3.0), (2.5, 2.5), ("4", 4.0), (0, 0.0), (True, math.nan), (None, math.nan)],
)
def test_seconds_or_nan_takes_numbers_and_their_text_but_not_booleans(
    value: object, seconds: float
) -> None:
    got = settings.seconds_or_nan(value)
    assert got == seconds or (math.isnan(got) and math.isnan(seconds))


# --- the marker ---------------------------------------------------------------------------------


def _item(pytester: pytest.Pytester, marker: str) -> pytest.Item:
    source = f"import pytest\n\n@pytest.mark.torch_hang({marker})\ndef test_func():\n    pass\n"
    if not marker:
        source = "def test_func():\n    pass\n"
    module = pytester.getmodulecol(source)
    (item,) = pytester.genitems([module])
    return item


SESSION = SessionSettings(timeout=10.0, source="command line", report_dir=None, native=False)
SESSION_WITH_STALL = SessionSettings(10.0, "ini", None, False, stall=4.0)


@pytest.mark.parametrize(
    ("session", "marker", "timeout", "stall", "isolate"),
    [
        (SESSION, "", 10.0, 0.0, False),  # no marker: the session's
        (SESSION, "timeout=3", 3.0, 0.0, False),
        (SESSION, "3", 3.0, 0.0, False),  # positional, as pytest-timeout's marker
        (SESSION, "timeout=30", 30.0, 0.0, False),  # looser than the session's: still wins
        (SESSION, "timeout=0", 0.0, 0.0, False),  # turns the guard off for this test
        (SESSION, "timeout=None", 10.0, 0.0, False),
        (SESSION, "stall=2", 10.0, 2.0, False),
        (SESSION, "isolate=True", 10.0, 0.0, True),
        (SESSION_WITH_STALL, "", 10.0, 4.0, False),
        (SESSION_WITH_STALL, "timeout=1", 1.0, 4.0, False),
        (SESSION_WITH_STALL, "stall=0", 10.0, 0.0, False),
        (SESSION_WITH_STALL, "timeout='2.5', stall=1", 2.5, 1.0, False),
    ],
)
def test_the_marker_wins_over_the_session(
    pytester: pytest.Pytester,
    session: SessionSettings,
    marker: str,
    timeout: float,
    stall: float,
    isolate: bool,
) -> None:
    got = settings.item_settings(_item(pytester, marker), session)
    assert (got.timeout, got.stall, got.isolate) == (timeout, stall, isolate)


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        ('timeout="soon"', "timeout must be a finite number of seconds >= 0 (0 turns the guard"),
        ("timeout=-1", "timeout must be a finite number of seconds >= 0"),
        ("timeout=float('nan')", "timeout must be a finite number"),
        ("stall=-2", "stall must be a finite number of seconds >= 0 (0 turns stall detection"),
        ("timeout=1e11", "timeout must be at most 1e9 seconds (about 31 years); 0 turns the"),
        ("stall=1e10", "stall must be at most 1e9 seconds (about 31 years); 0 turns stall"),
        ("bogus=1", "takes (timeout=None, stall=None, isolate=False), got args=() kwargs="),
        ("1, 2", "takes (timeout=None, stall=None, isolate=False), got args=(1, 2)"),
        ("1, timeout=2", "timeout given twice (positionally 1 and as timeout=2)"),
        ('isolate="yes"', "isolate must be True or False, got 'yes'"),
    ],
)
def test_a_bad_marker_is_a_usage_error_naming_the_test(
    pytester: pytest.Pytester, marker: str, message: str
) -> None:
    item = _item(pytester, marker)
    with pytest.raises(pytest.UsageError) as caught:
        settings.item_settings(item, SESSION)
    assert str(caught.value).startswith(f"@pytest.mark.torch_hang on {item.nodeid}: ")
    assert message in str(caught.value)


# --- the report directory -----------------------------------------------------------------------


def test_no_report_dir_by_default(pytester: pytest.Pytester) -> None:
    assert _settings(pytester).report_dir is None


def test_a_relative_report_dir_is_fixed_against_where_it_was_given(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command line's against the invocation directory, the ini file's against the ini
    file's directory: a test that changes directory does not move the reports."""
    pytester.makeini(f"[pytest]\n{settings.REPORT_DIR_INI} = from-ini\n")
    below = pytester.mkdir("below")
    monkeypatch.chdir(below)
    from_ini = settings.session_settings(_config(pytester)).report_dir
    assert from_ini == os.path.join(pytester.path, "from-ini")
    from_cli = settings.session_settings(
        _config(pytester, f"{settings.REPORT_DIR_OPTION}=from-cli")
    ).report_dir
    assert from_cli == os.path.join(below, "from-cli")  # and the command line wins


def test_an_absolute_report_dir_and_a_home_one_are_kept(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    assert _settings(pytester, f"{settings.REPORT_DIR_OPTION}={tmp_path}").report_dir == str(
        tmp_path
    )
    home = _settings(pytester, f"{settings.REPORT_DIR_OPTION}=~/hangs").report_dir
    assert home == os.path.join(os.path.expanduser("~"), "hangs")


@pytest.mark.parametrize("where", ["cli", "ini"])
def test_a_report_dir_that_is_a_file_is_a_usage_error_naming_its_source(
    pytester: pytest.Pytester, where: str
) -> None:
    pytester.makefile(".txt", taken="not a directory")
    if where == "cli":
        message = _usage_error(pytester, f"{settings.REPORT_DIR_OPTION}=taken.txt")
        source = settings.REPORT_DIR_OPTION
    else:
        message = _usage_error(pytester, ini={settings.REPORT_DIR_INI: "taken.txt"})
        source = f"ini option {settings.REPORT_DIR_INI}"
    assert message.startswith(
        f"{source} must be a directory (created if missing), got 'taken.txt' "
        f"({pytester.path / 'taken.txt'}), which is a file"
    )


@pytest.mark.parametrize("where", ["cli", "ini"])
def test_a_report_dir_under_a_file_is_a_usage_error_at_start(
    pytester: pytest.Pytester, where: str
) -> None:
    taken = pytester.makefile(".txt", taken="not a directory")
    given = "taken.txt/hangs/deeper"
    if where == "cli":
        message = _usage_error(pytester, f"{settings.REPORT_DIR_OPTION}={given}")
        source = settings.REPORT_DIR_OPTION
    else:
        message = _usage_error(pytester, ini={settings.REPORT_DIR_INI: given})
        source = f"ini option {settings.REPORT_DIR_INI}"
    assert message == (
        f"{source} must be a directory (created if missing), got {given!r} "
        f"({pytester.path / given}), but {taken} is a file"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any directory")
def test_a_report_dir_nobody_may_create_is_a_usage_error_at_start(
    pytester: pytest.Pytester,
) -> None:
    locked = pytester.mkdir("locked")
    locked.chmod(0o500)
    try:
        message = _usage_error(pytester, f"{settings.REPORT_DIR_OPTION}=locked/hangs")
    finally:
        locked.chmod(0o700)
    assert message.startswith(f"{settings.REPORT_DIR_OPTION} must be a directory pytest may")
    assert message.endswith(f"which cannot be created in {locked}: choose another directory")


def test_a_missing_report_dir_is_fine_and_not_created_at_start(
    pytester: pytest.Pytester,
) -> None:
    got = _settings(pytester, f"{settings.REPORT_DIR_OPTION}=later/deeper")
    assert got.report_dir == os.path.join(pytester.path, "later", "deeper")
    assert not (pytester.path / "later").exists()


# --- hunting and native stacks ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "hunt", "hunt_all", "hunt_stress"),
    [
        ((), 0, False, False),
        (("--torch-hang-hunt=5", "--torch-hang-timeout=2"), 5, False, False),
        (("--torch-hang-hunt=1", "--torch-hang-stall=2"), 1, False, False),  # a stall bounds too
        (
            ("--torch-hang-hunt=9", "--torch-hang-timeout=2", "--torch-hang-hunt-all"),
            9,
            True,
            False,
        ),
        (
            ("--torch-hang-hunt=9", "--torch-hang-timeout=2", "--torch-hang-hunt-stress"),
            9,
            False,
            True,
        ),
    ],
)
def test_hunt_options(
    pytester: pytest.Pytester, args: tuple[str, ...], hunt: int, hunt_all: bool, hunt_stress: bool
) -> None:
    got = _settings(pytester, *args)
    assert (got.hunt, got.hunt_all, got.hunt_stress) == (hunt, hunt_all, hunt_stress)


@pytest.mark.parametrize("value", ["0", "-3", "abc", "1.5", ""])
def test_a_bad_hunt_count_is_a_usage_error(pytester: pytest.Pytester, value: str) -> None:
    message = _usage_error(pytester, f"--torch-hang-hunt={value}", "--torch-hang-timeout=2")
    assert message == (
        f"--torch-hang-hunt must be a whole number of runs >= 1 per selected test, got {value!r}"
    )


@pytest.mark.parametrize("flag", ["--torch-hang-hunt-all", "--torch-hang-hunt-stress"])
def test_a_hunt_flag_without_a_hunt_is_a_usage_error(pytester: pytest.Pytester, flag: str) -> None:
    message = _usage_error(pytester, flag, "--torch-hang-timeout=2")
    assert message == f"{flag} goes with --torch-hang-hunt=N (how many runs per test)"


@pytest.mark.parametrize(
    "args", [("--torch-hang-hunt=3",), ("--torch-hang-hunt=3", "--torch-hang-timeout=0")]
)
def test_a_hunt_without_a_bound_is_a_usage_error(
    pytester: pytest.Pytester, args: tuple[str, ...]
) -> None:
    message = _usage_error(pytester, *args)
    assert message.startswith("--torch-hang-hunt needs a bound for each run")
    assert "--torch-hang-timeout=SECONDS or --torch-hang-stall=SECONDS" in message


def test_a_hunt_is_bounded_by_an_ini_timeout_too(pytester: pytest.Pytester) -> None:
    got = _settings(pytester, "--torch-hang-hunt=3", ini={settings.TIMEOUT_INI: "4"})
    assert (got.hunt, got.timeout) == (3, 4.0)


@pytest.mark.parametrize(
    ("args", "ini", "native"),
    [
        ((), None, False),
        (("--torch-hang-native",), None, True),
        ((), "true", True),
        ((), "YES", True),
        ((), "off", False),
        (("--torch-hang-native",), "false", True),  # the command line adds it
    ],
)
def test_native_stacks_from_the_flag_or_the_ini_key(
    pytester: pytest.Pytester, args: tuple[str, ...], ini: str | None, native: bool
) -> None:
    ini_values = {settings.NATIVE_INI: ini} if ini is not None else None
    assert _settings(pytester, *args, ini=ini_values).native is native


def test_a_bad_native_ini_value_names_the_key(pytester: pytest.Pytester) -> None:
    message = _usage_error(pytester, ini={settings.NATIVE_INI: "maybe"})
    assert message == f"ini option {settings.NATIVE_INI} must be true or false, got 'maybe'"
