"""Injected into guarded tests' child interpreters through PYTHONPATH; chains to the real one.

It installs pytest-torchhang's stack-dump handler and its copy of the child's last stderr
lines, then removes its own folder from ``sys.path`` and imports the ``sitecustomize`` it
shadows (a distribution's or the user's), so nothing else changes for the child.
"""

import importlib.util as _ilu
import os as _os
import sys as _sys


def _load(package_dir: str, name: str) -> object:
    """Load ``pytest_torchhang.inject.<name>`` by path, without importing the package (it
    needs pytest), under its package name: a later ``from pytest_torchhang.inject import <name>``
    in this process gets this very module (one registration, one at-fork handler, one file)."""
    spec = _ilu.spec_from_file_location(
        f"pytest_torchhang.inject.{name}", _os.path.join(package_dir, f"{name}.py")
    )
    if spec is None or spec.loader is None:
        return None
    module = _ilu.module_from_spec(spec)
    _sys.modules[f"pytest_torchhang.inject.{name}"] = module
    spec.loader.exec_module(module)
    return module


def _note(protocol: object, hook: object, text: str) -> None:
    """Say what failed, for the hang report (``hook.child_note``, or its format by hand when
    ``hook`` itself could not be loaded; nothing when the protocol could not be either)."""
    note = getattr(hook, "child_note", None)
    if note is not None:
        note(text)
        return
    dump_dir = _os.environ.get(getattr(protocol, "DUMP_DIR_ENV", ""))
    notes_path = getattr(protocol, "notes_path", None)
    if not dump_dir or notes_path is None:
        return
    import time

    try:
        with open(notes_path(dump_dir, _os.getpid()), "a") as out:
            out.write(f"{time.time():.3f} {' '.join(text.split())[:1000]}\n")
    except OSError:
        pass  # nowhere left to say it


def _torchhang_bootstrap() -> None:
    here = _os.path.dirname(_os.path.abspath(__file__))
    package_dir = _os.path.dirname(here)  # inject/, above inject/site/
    protocol = hook = None
    step = "load its start-up hook"
    try:
        # first: what hook.py imports (``from .protocol import``), so it finds them loaded
        protocol = _load(package_dir, "protocol")
        _load(package_dir, "stderr")
        _load(package_dir, "snapshot")
        _load(package_dir, "imports")
        hook = _load(package_dir, "hook")
        step = "install its stack-dump handler"
        if hook.install():  # type: ignore[attr-defined]
            step = "keep its stderr lines"
            hook.keep_stderr_tail()  # type: ignore[attr-defined]
        if _os.environ.get(protocol.PROGRESS_ENV):  # type: ignore[attr-defined]  # stall detection
            step = "install its progress beats"
            _load(package_dir, "beats").install()  # type: ignore[attr-defined]
        switch = _os.environ.get(protocol.STRESS_ENV, "")  # type: ignore[attr-defined]
        if hook.stress_requested(switch):  # type: ignore[attr-defined]
            step = "start --torch-hang-hunt-stress"
            _load(package_dir, "stress_schedule")  # what stress.py imports, loaded first
            _load(package_dir, "stress").install_from_env(fresh=True)  # type: ignore[attr-defined]
    except Exception as exc:  # never break the child's start-up: say it instead
        _note(
            protocol,
            hook,
            f"pytest-torchhang could not {step} in pid {_os.getpid()}: {type(exc).__name__}: {exc}",
        )
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != here]
    me = _sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401 - the one we shadowed
    except ImportError:
        if me is not None:  # site.py expects a module under this name once we return
            _sys.modules["sitecustomize"] = me


_torchhang_bootstrap()
