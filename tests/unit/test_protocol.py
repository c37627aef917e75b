"""The child protocol has one home: ``inject/protocol.py`` spells every name both sides share, and
the stress code knows the plugin's threads by the names they have now (issue 29, issue 30)."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

import pytest_torchhang
from pytest_torchhang.inject import protocol

PACKAGE = Path(pytest_torchhang.__file__).parent

#: The strings only protocol.py may spell: its environment keys, the preparation data's key and
#: the dump directory's file suffixes.
SHARED = {
    value
    for name, value in vars(protocol).items()
    if isinstance(value, str) and name.endswith(("_ENV", "_KEY", "_SUFFIX"))
}


def _strings(node: ast.AST) -> list[str]:
    """The literal text of ``node``: a string, or the literal parts of an f-string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.Tuple):
        return [text for item in node.elts for text in _strings(item)]
    return []


def _spellings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, literal) of each protocol literal spelled in ``tree``: a shared key or file suffix,
    a thread name or name test that spells a plugin thread prefix, the dump signal's number."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in SHARED:  # f-strings' parts too
            found.append((node.lineno, node.value))
        if isinstance(node, ast.Attribute) and node.attr == "SIGRTMIN":
            found.append((node.lineno, "SIGRTMIN"))
        if not isinstance(node, ast.Call):
            continue
        named = [k.value for k in node.keywords if k.arg == "name"]
        if isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
            named += node.args
        for text in (text for arg in named for text in _strings(arg)):
            if text.startswith(protocol.PLUGIN_THREAD_NAMES):
                found.append((node.lineno, text))
    return sorted(found)


def test_no_module_but_the_protocol_spells_its_names_keys_signal_prefix_or_files() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name == "inject/protocol.py":
            continue
        for line, text in _spellings(ast.parse(path.read_text(), name)):
            offenders.append(f"{name}:{line} spells {text!r}")
    assert offenders == []


def test_the_check_finds_each_kind_of_spelling() -> None:
    source = (
        "import os, signal, threading\n"
        "os.environ.get('PYTEST_TORCH_HANG_STRESS')\n"
        "path = f'{dump_dir}/{pid}.stderr'\n"
        "threading.Thread(target=f, name='torchhang-reader')\n"
        "thread.name.startswith(('torch-hang ', 'x'))\n"
        "signal.SIGRTMIN + 5\n"
        "threading.Thread(target=f, name=f'{protocol.THREAD_PREFIX}reader')\n"  # the right way
        "pm.register(plugin, 'torchhang-per-test')\n"  # a plugin's name, not a thread's
    )
    assert [line for line, _ in _spellings(ast.parse(source))] == [2, 3, 4, 5, 6]


def test_the_child_side_modules_use_the_protocols_own_values() -> None:
    from pytest_torchhang.inject import beats, hook, stress

    assert hook.DUMP_DIR_ENV is protocol.DUMP_DIR_ENV
    assert hook.DUMP_SIGNAL == protocol.DUMP_SIGNAL
    assert beats.PROGRESS_ENV is protocol.PROGRESS_ENV
    assert stress.STRESS_ENV is protocol.STRESS_ENV
    assert stress.OWN_THREADS == protocol.PLUGIN_THREAD_NAMES
    assert protocol.THREAD_PREFIX in protocol.PLUGIN_THREAD_NAMES


def test_file_names_are_per_pid_and_found_back_by_suffix() -> None:
    for path in (
        protocol.dump_path("/d", 12),
        protocol.stderr_path("/d", 12),
        protocol.tasks_path("/d", 12),
        protocol.collectives_path("/d", 12),
    ):
        name = path.rpartition("/")[2]
        suffix = name[len("12") :]
        assert protocol.pid_of(name, suffix) == 12
    assert protocol.pid_of("12.collectives.json", protocol.STDERR_SUFFIX) is None
    assert protocol.pid_of("x12.stderr", protocol.STDERR_SUFFIX) is None


@pytest.fixture
def stressed() -> object:
    from pytest_torchhang.inject import stress

    stress.install(seed=7)
    try:
        yield stress
    finally:
        stress.uninstall()


def test_stress_leaves_the_plugins_threads_alone_and_out_of_the_numbering(stressed: object) -> None:
    from pytest_torchhang.inject import stress

    seen: dict[str, object] = {}

    def look(key: str) -> None:
        seen[key] = stress._schedule()

    before = stress._State.threads
    ours = threading.Thread(target=look, args=("ours",), name=f"{protocol.THREAD_PREFIX}reader")
    ours.start()
    ours.join(10)
    assert seen["ours"] is None  # no schedule: never delayed
    assert stress._State.threads == before  # the user's next thread keeps its number
    users = threading.Thread(target=look, args=("users",), name="loader")
    users.start()
    users.join(10)
    assert stress._State.threads == before + 1
    assert getattr(seen["users"], "key", "") == f"t{before + 1}"
