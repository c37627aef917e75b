"""Injected into guarded tests' child interpreters through PYTHONPATH; chains to the real one.

It installs pytest-torchhang's stack-dump handler, then removes its own folder from ``sys.path``
and imports the ``sitecustomize`` it shadows (a distribution's or the user's), so nothing else
changes for the child.
"""

import importlib.util as _ilu
import os as _os
import sys as _sys


def _torchhang_bootstrap() -> None:
    here = _os.path.dirname(_os.path.abspath(__file__))
    try:
        # Loaded under its package name (without importing the package, which needs pytest), so
        # a later ``from pytest_torchhang import _hook`` in this process gets this very module:
        # one registration, one at-fork handler, one open dump file.
        spec = _ilu.spec_from_file_location(
            "pytest_torchhang._hook", _os.path.join(_os.path.dirname(here), "_hook.py")
        )
        if spec is not None and spec.loader is not None:
            hook = _ilu.module_from_spec(spec)
            _sys.modules["pytest_torchhang._hook"] = hook
            spec.loader.exec_module(hook)
            hook.install()
    except Exception:  # never break the child's start-up
        pass
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != here]
    me = _sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401 - the one we shadowed
    except ImportError:
        if me is not None:  # site.py expects a module under this name once we return
            _sys.modules["sitecustomize"] = me


_torchhang_bootstrap()
