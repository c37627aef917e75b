"""The plugin's own threads are told from the test's by their stacks, and folded in the report."""

from __future__ import annotations

from pytest_torchhang.report.groups import is_plugin_thread as plugin_thread
from pytest_torchhang.report.model import Frame, ProcessReport, ThreadStack
from pytest_torchhang.report.text import _process_text

THREADING = "/usr/lib/python3.11/threading.py"
BOOTSTRAP = [Frame(THREADING, 982, "run"), Frame(THREADING, 1002, "_bootstrap")]


def thread(*frames: Frame, ident: str = "0x1") -> ThreadStack:
    return ThreadStack(ident=ident, frames=[*frames, *BOOTSTRAP])


WATCHDOG = thread(
    Frame(THREADING, 331, "wait"),
    Frame("/site/pytest_torchhang/watchdog.py", 338, "_run"),
    ident="0x2",
)
USERS = thread(
    Frame(THREADING, 331, "wait"),
    Frame("/home/me/app/pytest_torchhang_helpers.py", 3, "work"),  # not the plugin's package
    Frame("/site/pytest_torchhang/inject/hook.py", 10, "wrapped"),  # a patch of the plugin
    Frame("/home/me/app/server.py", 40, "serve"),
    ident="0x3",
)


def test_a_thread_the_plugin_started_is_the_plugins() -> None:
    assert plugin_thread(WATCHDOG)


def test_a_user_thread_that_passes_through_the_plugins_code_is_the_users() -> None:
    assert not plugin_thread(USERS)


def test_a_main_thread_is_never_the_plugins() -> None:
    child = Frame("/site/pytest_torchhang/runner/child.py", 1, "main")
    main = ThreadStack("0x4", current=True, frames=[child])
    assert not plugin_thread(main)


def test_the_report_folds_the_plugins_threads_into_one_line() -> None:
    proc = ProcessReport(
        pid=10, ppid=1, role="pytest", cmdline="pytest", state="sleeping", cpu_s=0.4,
        cpu_delta_s=0.0, rss_bytes=0, num_threads=3, age_s=5.0, dump_status="ok",
        threads=[USERS, WATCHDOG],
        thread_roles={"0x2": "torch-hang watchdog"},
    )  # fmt: skip
    text = "\n".join(_process_text(proc))
    assert "1 thread(s) of pytest-torchhang itself, not shown: torch-hang watchdog" in text
    assert "watchdog.py" not in text
    assert "server.py" in text


def test_only_the_thread_that_runs_the_watchdog_is_labelled_the_watchdog() -> None:
    # pytest's main thread waits in watchdog.py for a capture in progress, from its report hook
    # (seen in a real report: it was labelled "[torch-hang watchdog]")
    from pytest_torchhang.diagnosis.roles import label_roles

    main = ThreadStack(
        "0x1",
        name="MainThread",
        frames=[
            Frame(THREADING, 331, "wait"),
            Frame("/site/pytest_torchhang/watchdog.py", 235, "wait_for_capture"),
            Frame("/site/pytest_torchhang/watchdog.py", 277, "take_reports"),
            Frame("/site/pytest_torchhang/plugin.py", 688, "pytest_runtest_makereport"),
        ],
    )
    proc = ProcessReport(
        pid=10, ppid=1, role="", cmdline="pytest", state="sleeping", cpu_s=0.4,
        cpu_delta_s=0.0, rss_bytes=0, num_threads=2, age_s=5.0, dump_status="ok",
        threads=[main, WATCHDOG],
    )  # fmt: skip
    label_roles([proc], 10, {}, "pytest")
    assert proc.thread_roles == {"0x2": "torch-hang watchdog"}


def test_the_plugins_named_helper_threads_are_ignored_by_the_rules_whatever_code_they_run() -> None:
    # a capture's bounded-call thread runs psutil: its top frames are not the plugin's, and a
    # running thread of the pytest process made "nothing in it is working on an answer" false
    from pytest_torchhang.diagnosis.graph import ignored
    from pytest_torchhang.report.model import TaskWait

    psutil = [
        Frame("/site/psutil/_pslinux.py", 1700, "_parse_stat_file"),
        Frame("/site/psutil/_common.py", 480, "wrapper"),
        Frame("/site/psutil/_pslinux.py", 1800, "cpu_times"),
        Frame("/site/pytest_torchhang/capture/procfs.py", 350, "run"),
    ]
    helper = ThreadStack("0x5", name="torchhang-bounded-call", frames=[*psutil, *BOOTSTRAP])
    user = ThreadStack("0x6", name="Thread-1", frames=[*psutil[:3], *BOOTSTRAP])
    tasks = [
        TaskWait(11, name="torchhang-bound", state="R", call="running", python_thread="0x5"),
        TaskWait(12, name="python", state="R", call="running", python_thread="0x6"),
        TaskWait(13, name="torchhang-proc-", state="S", call="futex"),  # no Python stack read
    ]
    proc = ProcessReport(
        pid=10, ppid=1, role="pytest", cmdline="pytest", state="sleeping", cpu_s=0.4,
        cpu_delta_s=0.0, rss_bytes=0, num_threads=3, age_s=5.0, dump_status="ok",
        threads=[helper, user], tasks=tasks,
    )  # fmt: skip
    assert [ignored(proc, task) for task in tasks] == [True, False, True]
