"""Every option, ini key, environment variable, marker and fixture argument, with a wrong value.

Each gives an error that names where the value came from, what is accepted, and what was given;
never an INTERNALERROR or a crash somewhere later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pytest_torchhang import devices, settings

ONE_TEST = "def test_one():\n    pass\n"

FIXTURE_TEST = """
def add(*args, **kwargs):
    return 0


def test_one(torch_hang):
    torch_hang.{call}
"""

#: Environment variables the plugin reads; unset for every case but the one it sets.
ENV_VARS = (settings.TIMEOUT_ENV, devices.FAKE_GPUS_ENV, devices.LEASE_TIMEOUT_ENV)


@dataclass(frozen=True)
class Case:
    """One wrong value: where it goes, and what the error line must say."""

    id: str
    needles: tuple[str, ...]  # all of these on one line of the output
    args: tuple[str, ...] = ()
    ini: str = ""
    env: dict[str, str] = field(default_factory=dict)
    marker: str = ""  # @pytest.mark.<marker> on test_bad.py::test_one
    call: str = ""  # torch_hang.<call> in test_bad.py::test_one

    @property
    def exit_code(self) -> pytest.ExitCode:
        if self.call:
            return pytest.ExitCode.TESTS_FAILED  # the test fails with the error
        if self.marker.startswith(("gpu", "cpu")):
            return pytest.ExitCode.INTERRUPTED  # the module fails to collect
        return pytest.ExitCode.USAGE_ERROR


TIMEOUT = "--torch-hang-timeout must be a finite number of seconds >= 0 (0 turns the guard off)"
MARKER = "@pytest.mark.torch_hang on test_bad.py::test_one: "
GPU = "@pytest.mark.gpu on test_bad.py::test_one: "

CASES = [
    # --- command line
    *(
        Case(
            f"option-timeout-{value}",
            (TIMEOUT, f"got '{value}'"),
            (f"--torch-hang-timeout={value}",),
        )
        for value in ("-1", "nan", "inf", "abc")
    ),
    *(
        Case(
            f"option-{name}-too-long",
            (f"--torch-hang-{name} must be at most 1e9 seconds (about 31 years)", "got '1e10'"),
            (f"--torch-hang-{name}=1e10",),
        )
        for name in ("timeout", "stall")
    ),
    Case(
        "option-report-dir-under-a-file",
        ("--torch-hang-report-dir", "'not_a_dir/hangs'", "not_a_dir is a file"),
        ("--torch-hang-report-dir=not_a_dir/hangs",),
    ),
    Case(
        "option-report-dir-is-a-file",
        ("--torch-hang-report-dir", "'not_a_dir'", "directory"),
        ("--torch-hang-report-dir=not_a_dir",),
    ),
    # --- ini keys
    *(
        Case(
            f"ini-timeout-{value}",
            (
                f"ini option {settings.TIMEOUT_INI} must be a finite number of seconds >= 0",
                f"'{value}'",
            ),
            ini=f"{settings.TIMEOUT_INI} = {value}",
        )
        for value in ("soon", "-3")
    ),
    Case(
        "ini-timeout-too-long",
        (f"ini option {settings.TIMEOUT_INI} must be at most 1e9 seconds", "got '2e10'"),
        ini=f"{settings.TIMEOUT_INI} = 2e10",
    ),
    Case(
        "ini-native-not-a-bool",
        (settings.NATIVE_INI, "true", "false", "'maybe'"),
        ini=f"{settings.NATIVE_INI} = maybe",
    ),
    Case(
        "ini-report-dir-is-a-file",
        (settings.REPORT_DIR_INI, "'not_a_dir'", "directory"),
        ini=f"{settings.REPORT_DIR_INI} = not_a_dir",
    ),
    Case(
        "ini-gpu-lease-timeout",
        (f"ini option {devices.LEASE_TIMEOUT_INI} must be a finite number of seconds >= 0", "'-2'"),
        ini=f"{devices.LEASE_TIMEOUT_INI} = -2",
    ),
    # --- environment variables
    *(
        Case(
            f"env-timeout-{value}",
            (
                f"environment variable {settings.TIMEOUT_ENV} must be a finite number of seconds >= 0",
                f"got '{value}'",
            ),
            env={settings.TIMEOUT_ENV: value},
        )
        for value in ("-5", "ten")
    ),
    Case(
        "env-timeout-too-long",
        (f"environment variable {settings.TIMEOUT_ENV} must be at most 1e9 seconds", "'1e10'"),
        env={settings.TIMEOUT_ENV: "1e10"},
    ),
    *(
        Case(
            f"env-fake-gpus-{value}",
            (
                f"environment variable {devices.FAKE_GPUS_ENV} must be a whole number of fake GPUs >= 0",
                f"got '{value}'",
            ),
            env={devices.FAKE_GPUS_ENV: value},
        )
        for value in ("two", "-1", "1.5")
    ),
    Case(
        "env-gpu-lease-timeout",
        (
            f"environment variable {devices.LEASE_TIMEOUT_ENV} must be a finite number of seconds >= 0",
            "got 'x'",
        ),
        env={devices.LEASE_TIMEOUT_ENV: "x"},
    ),
    # --- markers
    Case(
        "marker-timeout-too-long",
        (f"{MARKER}timeout must be at most 1e9 seconds (about 31 years)", "got 100000000000.0"),
        marker="torch_hang(timeout=1e11)",
    ),
    Case(
        "marker-timeout-text",
        (f"{MARKER}timeout must be a finite number of seconds >= 0", "got 'soon'"),
        marker='torch_hang(timeout="soon")',
    ),
    Case(
        "marker-timeout-negative",
        (f"{MARKER}timeout must be a finite number", "got -1"),
        marker="torch_hang(timeout=-1)",
    ),
    Case(
        "marker-timeout-bool",
        (f"{MARKER}timeout must be a finite number", "got True"),
        marker="torch_hang(timeout=True)",
    ),
    Case(
        "marker-timeout-nan",
        (f"{MARKER}timeout must be a finite number", "got nan"),
        marker='torch_hang(timeout=float("nan"))',
    ),
    Case(
        "marker-timeout-list",
        (f"{MARKER}timeout must be a finite number", "got [5]"),
        marker="torch_hang([5])",
    ),
    Case(
        "marker-unknown-kwarg",
        (f"{MARKER}takes (timeout=None, stall=None, isolate=False)", "'bogus'"),
        marker="torch_hang(bogus=1)",
    ),
    Case(
        "marker-two-positionals",
        (f"{MARKER}takes (timeout=None, stall=None, isolate=False)", "args=(1, 2)"),
        marker="torch_hang(1, 2)",
    ),
    Case(
        "marker-timeout-twice",
        (MARKER, "timeout"),
        marker="torch_hang(1, timeout=2)",
    ),
    Case(
        "marker-isolate-text",
        (f"{MARKER}isolate must be True or False", "got 'yes'"),
        marker='torch_hang(isolate="yes")',
    ),
    Case(
        "marker-isolate-int",
        (f"{MARKER}isolate must be True or False", "got 1"),
        marker="torch_hang(isolate=1)",
    ),
    Case(
        "marker-gpu-zero",
        (f"{GPU}count must be a whole number of GPUs >= 1", "got 0"),
        marker="gpu(0)",
    ),
    Case(
        "marker-gpu-text",
        (f"{GPU}count must be a whole number of GPUs >= 1", "got 'two'"),
        marker='gpu("two")',
    ),
    Case(
        "marker-gpu-unknown-kwarg",
        (f"{GPU}takes one argument, gpu(count=1)", "'memory'"),
        marker="gpu(count=1, memory=8)",
    ),
    Case(
        "marker-cpu-argument",
        ("@pytest.mark.cpu on test_bad.py::test_one: takes no arguments", "args=(1,)"),
        marker="cpu(1)",
    ),
    # --- fixture arguments
    Case(
        "run-timeout-negative",
        ("ValueError: timeout must be a number of seconds > 0", "got -1"),
        call="run(add, timeout=-1)",
    ),
    Case(
        "run-timeout-too-long",
        (
            "ValueError: timeout must be a number of seconds > 0 and at most 1e9",
            "got 10000000000.0",
        ),
        call="run(add, timeout=1e10)",
    ),
    Case(
        "run-timeout-text",
        ("ValueError: timeout must be a number of seconds > 0", "got '5'"),
        call='run(add, timeout="5")',
    ),
    Case(
        "run-start-method",
        ("ValueError: start_method must be one of zygote, spawn, forkserver", "got 'bogus'"),
        call='run(add, start_method="bogus")',
    ),
    Case(
        "run-unpicklable",
        ("TypeError: torch_hang.run's callable must be picklable", "Define it at module level"),
        call="run(lambda: 1)",
    ),
    Case(
        "run-env-not-str",
        ("env", "'MY_FLAG'", "str"),
        call='run(add, env={"MY_FLAG": 1})',
    ),
    Case(
        "dataloader-batches-negative",
        ("ValueError: batches must be None or an int >= 0", "got -1"),
        call="dataloader([1, 2], batches=-1)",
    ),
    Case(
        "dataloader-batches-bool",
        ("batches must be None or an int >= 0", "got True"),
        call="dataloader([1, 2], batches=True)",
    ),
    Case(
        "dataloader-unpicklable",
        ("TypeError: torch_hang.dataloader's dataset or factory must be picklable",),
        call="dataloader(lambda: [1])",
    ),
    Case(
        "distributed-world-size-zero",
        ("ValueError: world_size must be an int >= 1", "got 0"),
        call="distributed(add, world_size=0)",
    ),
    Case(
        "distributed-world-size-text",
        ("ValueError: world_size must be an int >= 1", "got '2'"),
        call='distributed(add, world_size="2")',
    ),
    Case(
        "distributed-backend-mpi",
        ("ValueError: backend must be 'gloo', 'nccl' or None (automatic)", "got 'mpi'"),
        call='distributed(add, backend="mpi")',
    ),
    Case(
        "distributed-nccl-without-gpus",
        (
            "ValueError: backend 'nccl' needs one GPU per rank",
            "@pytest.mark.gpu(2)",
            "backend='gloo'",
        ),
        call='distributed(add, backend="nccl")',
    ),
    Case(
        "distributed-unpicklable",
        ("TypeError: torch_hang.distributed's callable must be picklable",),
        call="distributed(lambda rank, world_size: 1)",
    ),
    Case(
        "distributed-init-timeout-negative",
        ("init_timeout must be a number of seconds > 0", "got -1"),
        call="distributed(add, init_timeout=-1)",
    ),
]


def _param(case: Case) -> object:
    return pytest.param(case, id=case.id)


def _on_one_line(text: str, needles: tuple[str, ...]) -> bool:
    return any(all(needle in line for needle in needles) for line in text.splitlines())


@pytest.mark.parametrize("case", [_param(case) for case in CASES])
def test_a_wrong_value_is_a_clear_error_naming_its_source(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, case: Case
) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    if case.ini:
        pytester.makeini(f"[pytest]\n{case.ini}\n")
    pytester.makefile("", not_a_dir="a file, not a directory")
    if case.call:
        pytester.makepyfile(test_bad=FIXTURE_TEST.format(call=case.call))
        args = case.args
    else:
        decorator = f"import pytest\n\n@pytest.mark.{case.marker}\n" if case.marker else ""
        pytester.makepyfile(test_bad=decorator + ONE_TEST)
        args = ("--co", *case.args)
    # In process: these errors come before any process is started, and this is 50 times faster.
    # (pytester forgets the modules an inner run imported: hypothesis's plugin would import
    # hypothesis again each time, for most of the cost; pytest-benchmark warns under xdist.)
    quiet = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark")
    result = pytester.runpytest_inprocess(*quiet, *args)
    text = result.stdout.str() + "\n" + result.stderr.str()
    assert "INTERNALERROR" not in text, text[-3000:]
    assert result.ret == case.exit_code, text[-3000:]
    assert _on_one_line(text, case.needles), f"no line with all of {case.needles}:\n{text[-3000:]}"
