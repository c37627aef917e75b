"""Build hook: the example suite travels in the wheel, for ``python -m pytest_torchhang examples``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class ExamplesInTheWheel(BuildHookInterface):  # type: ignore[type-arg]
    """Copies ``examples/`` into the wheel as ``pytest_torchhang/examples``.

    An index user has no examples/ folder; a source checkout (an editable install included) runs
    its own, so an editable wheel gets no copy (the ``force-include`` table would put one, which
    never changes again, into site-packages).
    """

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if version == "standard":
            build_data["force_include"][str(Path(self.root) / "examples")] = (
                "pytest_torchhang/examples"
            )
