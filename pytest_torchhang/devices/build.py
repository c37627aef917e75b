"""What the installed torch was built with (version, CUDA, ROCm), read without importing torch."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class TorchBuild:
    """The installed torch, as far as can be told without importing it (the import costs ~3 s)."""

    version: str | None  # None: torch is not installed
    cuda: str | None  # CUDA version torch was built with; None for a CPU-only or ROCm build
    hip: str | None
    known: bool  # False when the build could not be read: then assume it can use GPUs

    @property
    def supports_gpus(self) -> bool:
        return not self.known or self.cuda is not None or self.hip is not None


def torch_build() -> TorchBuild:
    """Read torch's version and CUDA build from its metadata and ``torch/version.py``."""
    torch_mod = sys.modules.get("torch")
    version_mod = getattr(torch_mod, "version", None)
    if version_mod is not None:  # already imported by someone else: free to ask
        return TorchBuild(
            str(getattr(torch_mod, "__version__", "")) or None,
            getattr(version_mod, "cuda", None),
            getattr(version_mod, "hip", None),
            known=True,
        )
    try:
        version: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        # find_spec of a top-level package locates it without running its __init__.
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return TorchBuild(version, None, None, known=False)
    fields = _version_py_fields(os.path.join(spec.submodule_search_locations[0], "version.py"))
    if fields is None or "cuda" not in fields:
        return TorchBuild(version, None, None, known=False)
    return TorchBuild(version, fields.get("cuda"), fields.get("hip"), known=True)


def _version_py_fields(path: str) -> dict[str, str | None] | None:
    try:
        with open(path, encoding="utf-8") as source:
            text = source.read()
    except OSError:
        return None
    fields: dict[str, str | None] = {}
    for name, value in re.findall(r"^(cuda|hip)\s*(?::[^=\n]*)?=\s*(.+)$", text, re.MULTILINE):
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            continue
        fields[name] = str(parsed) if parsed is not None else None
    return fields
