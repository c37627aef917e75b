"""One import hook patches torch's modules for the flight recorder, the beats and the stress
(``inject/imports.py``, issue 30): each patch runs once, in the order registered, at the first
import, and two copies of the hook (pytester's inline sessions import the package anew) chain
instead of asking each other in a circle, as the three finders before it did.

A real module written to ``tmp_path`` stands in for torch's: the hook matches it by name only.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from pytest_torchhang.inject import imports


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package ``torchhang_fake`` with a module ``c10d`` not imported yet."""
    package = tmp_path / "torchhang_fake"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "c10d.py").write_text("def init_process_group():\n    return 'init'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "torchhang_fake.c10d"
    for name in ("torchhang_fake.c10d", "torchhang_fake"):
        sys.modules.pop(name, None)
    for owner in ("recorder", "beats", "stress"):
        imports.forget(owner)


def _mark(owner: str, seen: list[str]) -> imports.Patch:
    def patch(module: ModuleType) -> None:
        seen.append(owner)
        module.marks = [*getattr(module, "marks", []), owner]  # type: ignore[attr-defined]

    return patch


def test_every_owners_patch_runs_once_in_order_at_the_first_import(module_dir: str) -> None:
    seen: list[str] = []
    for owner in ("recorder", "beats", "stress"):
        assert imports.after_import(module_dir, owner, _mark(owner, seen)) is None
    imports.after_import(module_dir, "beats", _mark("beats", seen))  # again: replaces, runs once
    module = importlib.import_module(module_dir)
    assert seen == ["recorder", "stress", "beats"]
    assert module.init_process_group() == "init"
    # the loader is the module's own for everything but running it: its source is still read
    assert "def init_process_group" in module.__loader__.get_source(module_dir)
    # imported already: handed back for the caller to patch now
    assert imports.after_import(module_dir, "stress", _mark("stress", seen)) is module


def test_a_patch_that_raises_does_not_break_the_import(module_dir: str) -> None:
    seen: list[str] = []

    def broken(module: ModuleType) -> None:
        raise RuntimeError("boom")

    imports.after_import(module_dir, "recorder", broken)
    imports.after_import(module_dir, "beats", _mark("beats", seen))
    assert importlib.import_module(module_dir).init_process_group() == "init"
    assert seen == ["beats"]


def test_a_forgotten_owners_patch_does_not_run(module_dir: str) -> None:
    seen: list[str] = []
    imports.after_import(module_dir, "stress", _mark("stress", seen))
    imports.after_import(module_dir, "beats", _mark("beats", seen))
    imports.forget("stress")
    importlib.import_module(module_dir)
    assert seen == ["beats"]


def test_two_copies_of_the_hook_chain_rather_than_ask_each_other_forever(module_dir: str) -> None:
    path = Path(imports.__file__)
    spec = importlib.util.spec_from_file_location("torchhang_fake_imports_copy", path)
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    seen: list[str] = []
    try:
        imports.after_import(module_dir, "recorder", _mark("recorder", seen))
        copy.after_import(module_dir, "stress", _mark("stress", seen))
        module = importlib.import_module(module_dir)  # no RecursionError
        assert sorted(seen) == ["recorder", "stress"]
        assert sorted(module.marks) == ["recorder", "stress"]
    finally:
        sys.meta_path.remove(copy._Finder)


def test_a_fresh_child_with_stall_detection_and_stress_imports_torch_distributed(
    tmp_path: Path,
) -> None:
    # The start-up hook's real path: sitecustomize installs the recorder, the beats and the
    # stress, then the child imports c10d (a stand-in, so that no torch is imported here).
    import os
    import subprocess

    from pytest_torchhang.inject import beats, protocol

    fake = tmp_path / "fake" / "torch" / "distributed"
    fake.mkdir(parents=True)
    for package in (fake.parent, fake):
        (package / "__init__.py").write_text("")
    (fake / "distributed_c10d.py").write_text(
        "def init_process_group(*a, **k):\n    return 'init'\n"
        "def all_reduce(*a, **k):\n    return 'all_reduce'\n"
    )
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    reader = beats.new_board(str(dumps), 1)
    site = Path(protocol.__file__).parent / "site"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(tmp_path / "fake")]),
        protocol.DUMP_DIR_ENV: str(dumps),
        protocol.PROGRESS_ENV: beats.pointer_path(str(dumps)),
        protocol.STRESS_ENV: "7",
    }
    code = (
        "import torch.distributed.distributed_c10d as m\n"
        "print(m.init_process_group._torch_hang_wrapped, m.all_reduce(), flush=True)\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        beats.end_board(reader)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "all_reduce"]
    assert not [n for n in os.listdir(dumps) if n.endswith(".notes")]  # no patch failed
