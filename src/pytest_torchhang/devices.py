"""GPU and CPU markers, CUDA-safe GPU detection, GPU leases under pytest-xdist, fake GPUs."""

from __future__ import annotations

import pytest


class DevicePlugin:
    """Hooks for the ``gpu``/``cpu`` markers; registered by ``plugin.pytest_configure``."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
