"""Off Linux the plugin registers its options and markers, says once that it is off, and stops."""

from __future__ import annotations

import sys

import pytest

MARKED = """
import pytest


@pytest.mark.torch_hang(timeout=5)
def test_marked():
    pass


@pytest.mark.gpu(1)
def test_gpu():
    pass


@pytest.mark.cpu
def test_fixture(torch_hang):
    pass
"""

# macOS as far as the plugin can tell: another sys.platform, and no real-time signals. Other
# plugins are not loaded (sysconfig and psutil would look for macOS files on this machine).
AS_MACOS = """
import signal
import sys

sys.platform = "darwin"
for name in ("SIGRTMIN", "SIGRTMAX"):
    delattr(signal, name)

import pytest

code = pytest.main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m.startswith(("pytest_torchhang", "psutil", "torch")))
print("loaded:", " ".join(loaded))
sys.exit(code)
"""


def test_off_linux_options_and_markers_work_and_nothing_else_loads(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTEST_TORCH_HANG_TIMEOUT", "30")
    # an outer guarded session (this suite run with a timeout) injects its hook: not here
    monkeypatch.delenv("PYTEST_TORCH_HANG_DUMP_DIR", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    pytester.makepyfile(test_marked=MARKED)
    script = pytester.makepyfile(as_macos=AS_MACOS)
    result = pytester.run(
        sys.executable,
        str(script),
        "-p",
        "pytest_torchhang.plugin",
        "-p",
        "no:cacheprovider",
        "--strict-markers",
        "--torch-hang-timeout=3",
        "--torch-hang-report-dir=reports",
        "-rs",
        timeout=60,
    )
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(
        [
            "torch-hang: off on darwin: the guard needs Linux*",
            "*the torch_hang fixture needs Linux (this is darwin)*",
            "*2 passed, 1 skipped*",
            "loaded: pytest_torchhang pytest_torchhang.plugin pytest_torchhang.settings",
        ]
    )
    assert result.stdout.str().count("torch-hang: off") == 1


def test_off_linux_a_bad_option_is_still_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(test_marked=MARKED)
    script = pytester.makepyfile(as_macos=AS_MACOS)
    result = pytester.run(
        sys.executable, str(script), "-p", "pytest_torchhang.plugin", "--torch-hang-timeout=abc"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--torch-hang-timeout must be a finite number of seconds*"])
