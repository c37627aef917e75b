"""Fixture children see the calling test's world: its environment and working directory."""

from __future__ import annotations

from conftest import GuardedRunner
from outcomes import assert_outcomes

ENVIRONMENTS = """
import os


def read(name):
    return os.environ.get(name)


def where():
    return os.getcwd()


def torch_threads():
    import torch

    return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


def test_1_sets_a_variable(torch_hang, monkeypatch):
    monkeypatch.setenv("TORCHHANG_PROBE", "from test 1")
    assert torch_hang.run(read, "TORCHHANG_PROBE") == "from test 1"


def test_2_does_not_see_test_1s_variable(torch_hang):
    assert os.environ.get("TORCHHANG_PROBE") is None
    assert torch_hang.run(read, "TORCHHANG_PROBE") is None


def test_3_thread_count_reaches_the_child(torch_hang, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert torch_hang.run(torch_threads) == ("1", 1)


def test_4_working_directory(torch_hang, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert torch_hang.run(where) == str(tmp_path)


def test_5_spawned_children_too(torch_hang, monkeypatch):
    monkeypatch.setenv("TORCHHANG_PROBE", "from test 5")
    assert torch_hang.run(read, "TORCHHANG_PROBE", start_method="spawn") == "from test 5"
"""


def test_each_fixture_child_gets_its_own_tests_environment(guarded: GuardedRunner) -> None:
    guarded.pytester.makepyfile(test_environments=ENVIRONMENTS)
    # The zygote starts during test 1 and so inherits test 1's variable: later tests must not.
    guarded.monkeypatch.setenv("OMP_NUM_THREADS", "2")
    session = guarded.run("-p", "no:randomly", timeout=120)
    assert_outcomes(session.result, passed=5)
    session.assert_clean()
