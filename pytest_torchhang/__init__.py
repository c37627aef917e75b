"""pytest-torchhang: make hangs in PyTorch multiprocess tests bounded and explainable.

Public names are loaded lazily, so the start-up hook injected into every child interpreter can
import ``pytest_torchhang._hook`` without paying for pytest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
    from ._progress import progress
    from .exceptions import ChildCrashed, HangError, RemoteTraceback
    from .fixtures import TorchHang
    from .jobs import LoaderStats
    from .report import HangReport


def __getattr__(name: str) -> Any:
    if name in ("HangError", "ChildCrashed", "RemoteTraceback"):
        from . import exceptions

        return getattr(exceptions, name)
    if name == "TorchHang":
        from .fixtures import TorchHang

        return TorchHang
    if name == "LoaderStats":
        from .jobs import LoaderStats

        return LoaderStats
    if name == "progress":
        from ._progress import progress

        return progress
    if name == "HangReport":
        from .report import HangReport

        return HangReport
    raise AttributeError(f"module 'pytest_torchhang' has no attribute {name!r}")
