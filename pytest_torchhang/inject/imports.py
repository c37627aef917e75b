"""The one import hook of ``inject/``: the patches that the start-up hook (the flight recorder's
``init_process_group``), the progress beats and the hunt's stress register for a module of
torch run right after that module is first imported.

One finder on ``sys.meta_path`` for all three: three finders that each asked the others for the
module's spec asked one another in a circle, and an import of ``torch.distributed`` in a child
with both stall detection and ``--torch-hang-hunt-stress`` ended in ``RecursionError``.

Standard library only and cheap to import, like all of ``inject/``: the start-up hook loads it by
path before the modules that register here. It never imports torch itself.
"""

from __future__ import annotations

import sys
from _thread import get_ident
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

    Patch = Callable[[ModuleType], None]

#: torch's module of ``init_process_group`` and the collectives, patched by all three.
C10D = "torch.distributed.distributed_c10d"


class _Patches:
    """The registered patches, and the finder that runs them (one per copy of this module)."""

    #: Module name -> (owner, patch), in the order they were registered: they run in it.
    by_module: ClassVar[dict[str, list[tuple[str, Patch]]]] = {}
    installed = False
    #: (thread, module) whose spec the finder is looking for now: a finder it asks may ask it
    #: again (another copy of this module, which pytester's inline sessions import anew).
    busy: ClassVar[set[tuple[int, str]]] = set()


def after_import(name: str, owner: str, patch: Patch) -> ModuleType | None:
    """Run ``patch(module)`` right after each later import of module ``name``.

    One patch per ``owner`` and module: registering again replaces it. ``patch`` says its own
    failures (an exception that escapes it is dropped: a patch never breaks the user's import).
    Returns the module when it is imported already: the caller patches it now, its own way.
    """
    patches = _Patches.by_module.setdefault(name, [])
    patches[:] = [(o, p) for o, p in patches if o != owner] + [(owner, patch)]
    if not _Patches.installed:
        _Patches.installed = True
        sys.meta_path.insert(0, _Finder)
    return sys.modules.get(name)


def forget(owner: str) -> None:
    """Drop every patch of ``owner`` (the stress, when it is undone); the finder stays, idle."""
    for patches in _Patches.by_module.values():
        patches[:] = [(o, p) for o, p in patches if o != owner]


def _patch(name: str, module: ModuleType) -> None:
    for _owner, patch in list(_Patches.by_module.get(name, ())):
        try:  # noqa: SIM105 - no contextlib: this module must stay cheap to import
            patch(module)
        except Exception:  # each patch says its own failures; none breaks the import
            pass


class _PatchingLoader:
    """The module's own loader, which patches the module once it has run; everything else
    (``get_source``, ``get_resource_reader``, ...) is the loader's own."""

    def __init__(self, loader: Any, name: str) -> None:
        self._torchhang_loader = loader
        self._torchhang_name = name

    def create_module(self, spec: Any) -> ModuleType | None:
        create = getattr(self._torchhang_loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._torchhang_loader.exec_module(module)
        _patch(self._torchhang_name, module)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_torchhang_"):  # not set yet (a copy made without __init__)
            raise AttributeError(attr)
        return getattr(self._torchhang_loader, attr)


class _Finder:
    """Finds a registered module through the other finders, and wraps its loader."""

    @classmethod
    def find_spec(cls, name: str, path: object = None, target: object = None) -> Any:
        key = (get_ident(), name)
        if not _Patches.by_module.get(name) or key in _Patches.busy:
            return None
        _Patches.busy.add(key)
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is cls or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    break
        finally:
            _Patches.busy.discard(key)
        if spec is None or getattr(spec.loader, "exec_module", None) is None:
            return spec
        spec.loader = _PatchingLoader(spec.loader, name)
        return spec


def sibling(name: str) -> ModuleType:
    """``pytest_torchhang.inject.<name>``, loaded by path as the start-up hook loads this package's
    modules (importing the package would need pytest); the loaded one when there is one."""
    import importlib.util
    import os

    full = f"pytest_torchhang.inject.{name}"
    module = sys.modules.get(full)
    if module is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        spec = importlib.util.spec_from_file_location(full, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"no {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    return module
