"""The GPUs tests may use, found without initialising CUDA, or faked as a testing aid."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest

from .build import torch_build

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
#: Testing aid: report this many GPUs and touch neither CUDA nor the driver.
FAKE_GPUS_ENV = "PYTEST_TORCH_HANG_FAKE_GPUS"
PROC_NVIDIA_GPUS = "/proc/driver/nvidia/gpus"
NVIDIA_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class GpuInventory:
    """The GPUs this session may hand to tests, found without initialising CUDA."""

    devices: tuple[str, ...]  # the CUDA_VISIBLE_DEVICES entry of each usable GPU, in CUDA order
    source: str  # where the count came from, for the report header and skip reasons
    note: str = ""  # why GPUs that are present cannot be used, or ""
    fake: bool = False

    @property
    def count(self) -> int:
        return len(self.devices)

    def describe(self) -> str:
        return self.note or self.source


def fake_gpu_count(environ: Mapping[str, str]) -> int | None:
    """``PYTEST_TORCH_HANG_FAKE_GPUS`` as a count, None when unset; usage error when invalid."""
    raw = environ.get(FAKE_GPUS_ENV, "").strip()
    if raw == "":
        return None
    try:
        count = int(raw, 10)
    except ValueError:
        count = -1
    if count < 0:
        raise pytest.UsageError(
            f"environment variable {FAKE_GPUS_ENV} must be a whole number of fake GPUs >= 0, "
            f"got {environ[FAKE_GPUS_ENV]!r}; unset it to detect real GPUs"
        )
    return count


def _strtoul(entry: str) -> int:
    """The leading integer of ``entry`` as CUDA's strtoul-like parser reads it, or -1."""
    match = re.match(r"[+-]?\d+", entry)
    return int(match.group()) if match else -1


def visible_devices(
    cuda_visible_devices: str | None, physical: int, uuids: Sequence[str] = ()
) -> tuple[str, ...]:
    """Which GPUs CUDA would expose, as ``CUDA_VISIBLE_DEVICES`` entries in CUDA's order.

    Mirrors CUDA's (and ``torch.cuda._parse_visible_devices``') reading of the variable: entries
    up to the first invalid one count; a repeated entry hides every device; ``""`` hides all.
    ``uuids`` are the driver's GPU UUIDs, when known, to check ``GPU-...`` entries against.
    """
    if physical <= 0:
        return ()
    if cuda_visible_devices is None:
        return tuple(str(index) for index in range(physical))
    entries = [entry.strip() for entry in cuda_visible_devices.split(",")]
    if entries[0].startswith(("GPU-", "MIG-")):
        prefix = entries[0][:4]
        named: list[str] = []
        for entry in entries:
            if entry in named:
                return ()
            if not entry.startswith(prefix):
                break
            if prefix == "GPU-" and uuids and not any(u.startswith(entry) for u in uuids):
                break
            named.append(entry)
        return tuple(named[:physical] if prefix == "GPU-" else named)
    ordinals: list[int] = []
    for entry in entries:
        ordinal = _strtoul(entry)
        if ordinal in ordinals:
            return ()
        if ordinal < 0 or ordinal >= physical:
            break
        ordinals.append(ordinal)
    return tuple(str(ordinal) for ordinal in ordinals)


def _physical_gpus(proc_dir: str = PROC_NVIDIA_GPUS) -> tuple[int, tuple[str, ...], str]:
    """(count, UUIDs if known, source) of the NVIDIA GPUs on this machine; never touches CUDA."""
    with contextlib.suppress(OSError):
        # One directory per GPU the driver exposes to this container; no process is started.
        return len(os.listdir(proc_dir)), (), proc_dir
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, (), "no NVIDIA driver found"
    try:
        # nvidia-smi talks to the driver through NVML, which does not create a CUDA context.
        proc = subprocess.Popen(
            [smi, "-L"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    except OSError as exc:
        return 0, (), f"nvidia-smi -L could not run: {exc}"
    try:
        out, _ = proc.communicate(timeout=NVIDIA_SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)  # a driver-wedged nvidia-smi may not even die: do not wait for it
        return 0, (), f"nvidia-smi -L did not answer within {NVIDIA_SMI_TIMEOUT_S:g}s"
    if proc.returncode != 0:
        first = out.strip().splitlines()[0] if out.strip() else f"exit code {proc.returncode}"
        return 0, (), f"nvidia-smi -L failed: {first}"
    gpus = re.findall(r"^GPU \d+:.*?(?:\(UUID: (GPU-[^)\s]+)\))?\s*$", out, re.MULTILINE)
    return len(gpus), tuple(u for u in gpus if u), "nvidia-smi -L"


def detect_gpus(environ: Mapping[str, str] | None = None) -> GpuInventory:
    """Find the GPUs tests may use, without initialising CUDA or importing torch.

    ``PYTEST_TORCH_HANG_FAKE_GPUS=N`` overrides detection entirely (a testing aid). Otherwise
    GPUs are counted from ``/proc/driver/nvidia/gpus`` or ``nvidia-smi -L``, filtered through
    ``CUDA_VISIBLE_DEVICES``, and none count when the installed torch is a CPU-only build.
    """
    env = os.environ if environ is None else environ
    fake = fake_gpu_count(env)
    if fake is not None:
        return GpuInventory(
            tuple(str(i) for i in range(fake)), f"fake: {FAKE_GPUS_ENV}={fake}", fake=True
        )
    physical, uuids, source = _physical_gpus()
    cvd = env.get(CUDA_VISIBLE_DEVICES)
    devices = visible_devices(cvd, physical, uuids)
    if cvd is not None and physical:
        source = f"{source}, {CUDA_VISIBLE_DEVICES}={cvd!r}"
    if devices and not (build := torch_build()).supports_gpus:  # read only where it matters
        note = f"{len(devices)} present, but torch {build.version} is a CPU-only build"
        return GpuInventory((), source, note=note)
    return GpuInventory(devices, source)


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA through torch; never imports or inits it."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    try:
        return bool(is_initialized()) if callable(is_initialized) else False
    except Exception:  # a half-imported torch: nothing was initialised through it
        return False
