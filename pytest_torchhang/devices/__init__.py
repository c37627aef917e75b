"""GPUs for tests: the gpu/cpu markers, CUDA-free detection, and GPU leases under pytest-xdist."""

from __future__ import annotations

from .detect import FAKE_GPUS_ENV, fake_gpu_count
from .leases import LEASE_TIMEOUT_ENV, LEASE_TIMEOUT_INI
from .markers import DevicePlugin, leased_devices, leased_gpus

__all__ = [
    "FAKE_GPUS_ENV",
    "LEASE_TIMEOUT_ENV",
    "LEASE_TIMEOUT_INI",
    "DevicePlugin",
    "fake_gpu_count",
    "leased_devices",
    "leased_gpus",
]
