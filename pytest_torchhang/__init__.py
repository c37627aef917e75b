"""pytest-torchhang: make hangs in PyTorch multiprocess tests bounded and explainable.

Public names are loaded lazily, so the start-up hook injected into every child interpreter can
import ``pytest_torchhang.inject.hook`` without paying for pytest.
"""

from __future__ import annotations

# not ``from typing import ...``: the monitor and every child's start-up hook import this
# package in an interpreter that has not loaded typing (some 10 ms of CPU)
TYPE_CHECKING = False

__all__ = [
    "ChildCrashed",
    "HangError",
    "HangReport",
    "LoaderStats",
    "RemoteTraceback",
    "TorchHang",
    "progress",
]

if TYPE_CHECKING:
    from typing import Any

    from .exceptions import ChildCrashed, HangError, RemoteTraceback
    from .inject.beats import progress
    from .report.model import HangReport
    from .runner.api import TorchHang
    from .runner.jobs import LoaderStats


def __getattr__(name: str) -> Any:
    if name in ("HangError", "ChildCrashed", "RemoteTraceback"):
        from . import exceptions

        return getattr(exceptions, name)
    if name == "TorchHang":
        from .runner.api import TorchHang

        return TorchHang
    if name == "LoaderStats":
        from .runner.jobs import LoaderStats

        return LoaderStats
    if name == "progress":
        from .inject.beats import progress

        return progress
    if name == "HangReport":
        from .report.model import HangReport

        return HangReport
    raise AttributeError(f"module 'pytest_torchhang' has no attribute {name!r}")
