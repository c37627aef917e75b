"""An exited process's last stderr lines read as a traceback: the uncaught exception, the user's
frame that raised it and the library frame that called the user's code (diagnosis/tracebacks.py),
and how an exited end of a wait says them (diagnosis/ends.py)."""

from __future__ import annotations

import sysconfig

import pytest

from pytest_torchhang.diagnosis.ends import render
from pytest_torchhang.diagnosis.tracebacks import last_traceback
from pytest_torchhang.report.waits import WaitEnd, WaitFacts

POOL = f"{sysconfig.get_paths()['stdlib']}/multiprocessing/pool.py"
PROCESS = f"{sysconfig.get_paths()['stdlib']}/multiprocessing/process.py"

#: A Pool worker whose initializer raised (as multiprocessing prints it).
INITIALIZER = [
    "Process ForkPoolWorker-1:",
    "Traceback (most recent call last):",
    f'  File "{PROCESS}", line 314, in _bootstrap',
    "    self.run()",
    f'  File "{POOL}", line 109, in worker',
    "    initializer(*initargs)",
    '  File "/work/cases/test_store.py", line 13, in open_store',
    "    with open(path) as fh:",
    "         ^^^^^^^^^^",
    "FileNotFoundError: [Errno 2] No such file or directory: '/tmp/missing.db'",
]


@pytest.mark.parametrize(
    ("lines", "found"),
    [
        (
            INITIALIZER,
            (
                "FileNotFoundError",
                "open_store at test_store.py:13",
                "worker at multiprocessing/pool.py:109, as initializer",
            ),
        ),
        # a script's own traceback: the user's code is outermost, nothing called it
        (
            [
                "Traceback (most recent call last):",
                '  File "/work/train.py", line 3, in <module>',
                "    main()",
                '  File "/work/train.py", line 2, in main',
                "    raise ValueError('bad record')",
                "ValueError: bad record",
            ],
            ("ValueError", "main at train.py:2", ""),
        ),
        # the last of two tracebacks is the one that ended the process
        (
            [
                "Traceback (most recent call last):",
                '  File "/work/a.py", line 1, in f',
                "KeyError: 'x'",
                "Traceback (most recent call last):",
                '  File "/work/b.py", line 5, in g',
                "    raise RuntimeError('late')",
                "RuntimeError: late",
            ],
            ("RuntimeError", "g at b.py:5", ""),
        ),
        # no traceback, or one cut before its exception's line: nothing is claimed
        (["bad config: 'broken'"], None),
        (["Traceback (most recent call last):", '  File "/work/a.py", line 1, in f'], None),
        ([], None),
    ],
)
def test_the_last_traceback_names_the_exception_and_where_it_was_raised(
    lines: list[str], found: tuple[str, str, str] | None
) -> None:
    raised = last_traceback(lines)
    got = None if raised is None else (raised.kind(), raised.raised_in(), raised.called_by())
    assert got == found


def test_a_long_message_is_cut() -> None:
    raised = last_traceback(["Traceback (most recent call last):", "OSError: " + "x" * 500])
    assert raised is not None and len(raised.exception) == 120
    assert raised.exception.endswith("...")


def test_an_exited_end_says_its_exception_where_it_was_raised_and_what_called_it() -> None:
    end = WaitEnd(
        7,
        who="child process (pid 7)",
        state="exited",
        where="ended",
        last_lines=INITIALIZER[-4:],
        exception=INITIALIZER[-1],
        raised_in="open_store at test_store.py:13",
        called_by="worker at multiprocessing/pool.py:109, as initializer",
    )
    text = render(WaitFacts(1, "MainThread", "Pool.map() at t.py:5", [end]))
    assert text == (
        "waits in Pool.map() at t.py:5. Who could end it: child process (pid 7) ended with an "
        "uncaught FileNotFoundError, raised in open_store at test_store.py:13 (called by the "
        "library's worker at multiprocessing/pool.py:109, as initializer): "
        f"`{INITIALIZER[-1]}`."
    )
    end.exception = ""  # no traceback: its last stderr line, as before
    assert "(its last stderr line: `FileNotFoundError:" in render(
        WaitFacts(1, "MainThread", "Pool.map() at t.py:5", [end])
    )
